"""train.gradient_checkpointing: each block recomputed in backward gives the same loss and
gradients (atol 1e-6) as keeping its activations, for the LM, the reward model and the policy
with a value head, with LoRA adapters too, in a seeded pretraining run, under torch.compile and under FSDP2 (slow);
evaluation, no-grad and KV-cache forwards never recompute."""

import pytest
import torch
import torch.nn.functional as F
from proc import free_port
from test_train import data, losses, tiny_cfg  # noqa: F401, F811 (data: a fixture)

import sprout.model.transformer as transformer
from sprout.engine.configs import LoraConfig
from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
from sprout.engine.optim import OptimConfig, build_optimizer, lr_schedule
from sprout.model.heads import PolicyWithValue, RewardModel
from sprout.model.lora import add_adapters
from sprout.model.transformer import ModelConfig, Transformer
from sprout.stages.pretrain import run_pretrain

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16,
                     tie_embeddings=False)


def lm_loss(model, ids, segments):
    logits = model(ids[:, :-1], segment_ids=segments[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def reward_loss(model, ids, segments):  # Bradley-Terry on rows 0 (chosen) and 1 (rejected)
    scores = model(ids, segment_ids=segments)[:, -1]
    return -F.logsigmoid(scores[0] - scores[1])


def policy_value_loss(model, ids, segments):
    logits, values = model(ids, segment_ids=segments, return_values=True)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) + values.square().mean()


def loss_and_grads(cls, loss_fn, checkpointing: bool, lora: LoraConfig | None = None):
    torch.manual_seed(0)
    model = cls(CONFIG).train()
    if lora is not None:  # adapters (B drawn too, so they matter), the scalar head trained beside them
        add_adapters(model, lora, seed=0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    model.gradient_checkpointing = checkpointing
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    segments = torch.tensor([[1] * 12, [1] * 5 + [2] * 7])  # two packed documents in row 1
    loss = loss_fn(model, ids, segments)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("cls, loss_fn", [(Transformer, lm_loss), (RewardModel, reward_loss),
                                          (PolicyWithValue, policy_value_loss)], ids=["lm", "reward", "lm+value"])
def test_loss_and_every_gradient_match_without_checkpointing(cls, loss_fn, monkeypatch):
    calls = []
    monkeypatch.setattr(transformer, "checkpoint", lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    loss, grads = loss_and_grads(cls, loss_fn, False)
    assert calls == []
    loss_ckpt, grads_ckpt = loss_and_grads(cls, loss_fn, True)
    assert len(calls) == CONFIG.n_layers  # one recomputed block per layer
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-6, rtol=0)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("cls, loss_fn", [(Transformer, lm_loss), (PolicyWithValue, policy_value_loss)],
                         ids=["lm", "lm+value"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_loss_and_gradients_match_without_checkpointing(cls, loss_fn, dropout):
    """With LoRA adapters (and their dropout, whose mask the recompute draws again alike)."""
    lora = LoraConfig(r=4, alpha=8.0, dropout=dropout)
    loss, grads = loss_and_grads(cls, loss_fn, False, lora)
    loss_ckpt, grads_ckpt = loss_and_grads(cls, loss_fn, True, lora)
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-6, rtol=0)
    assert grads.keys() == grads_ckpt.keys() and any(".lora_A" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=0, msg=name)


def test_eval_no_grad_and_cache_forwards_never_recompute(monkeypatch):
    calls = []
    monkeypatch.setattr(transformer, "checkpoint", lambda *a, **k: calls.append(1))
    model = Transformer(CONFIG)
    model.gradient_checkpointing = True
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8))
    model.eval()(ids).sum().backward()  # eval mode, grad on
    model.train()
    with torch.no_grad():
        model(ids)
        model(ids, cache=model.new_cache(2, 16))
    assert calls == []


def test_the_trainer_switches_it_on_for_the_trained_model():
    cfg = TrainConfig(max_steps=1, progress=False, gradient_checkpointing=True)
    for cls in (Transformer, RewardModel, PolicyWithValue):
        model = cls(CONFIG)
        Trainer(make_accelerator(cfg), model, build_optimizer(model, OptimConfig()), lr_schedule(OptimConfig(), 1), cfg)
        assert model.gradient_checkpointing
    assert not Transformer(CONFIG).gradient_checkpointing  # off unless asked


def test_a_seeded_pretraining_run_has_the_same_losses_at_every_step(data, tmp_path):  # noqa: F811
    for name, on in (("off", False), ("on", True)):
        run_pretrain(tiny_cfg(data, tmp_path / name, max_steps=4, eval_every=0, ckpt_every=0,
                              gradient_checkpointing=on))
    off, on = losses(tmp_path / "off"), losses(tmp_path / "on")
    assert sorted(off) == sorted(on) == [1, 2, 3, 4]
    assert max(abs(off[s] - on[s]) for s in off) < 1e-6


@pytest.mark.slow
def test_under_torch_compile_loss_and_gradients_match_eager():
    eager_loss, eager_grads = loss_and_grads(Transformer, lm_loss, False)
    torch.manual_seed(0)
    model = Transformer(CONFIG).train()
    model.gradient_checkpointing = True
    model.compile()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = lm_loss(model, ids, torch.tensor([[1] * 12, [1] * 5 + [2] * 7]))
    loss.backward()
    torch.testing.assert_close(loss.detach(), eager_loss, atol=1e-6, rtol=0)
    for name, p in model.named_parameters():
        # 1e-5: compiled kernels fuse and round apart from eager ones, with or without recomputation
        torch.testing.assert_close(p.grad, eager_grads[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_fsdp2_with_checkpointing_matches_one_process_without(data, tmp_path):  # noqa: F811
    from test_fsdp import short_fsdp_and_one

    one, fsdp = short_fsdp_and_one(data, tmp_path, free_port(), 3, "--train.gradient_checkpointing", "true")
    a, b = losses(one), losses(fsdp)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5  # FSDP's reduction order, as test_fsdp allows
