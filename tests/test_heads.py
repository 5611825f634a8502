"""Model heads and checkpoint architectures: the value and score heads, scores under left and
right padding, load_model's dispatch, building a head model from an LM checkpoint, and an RL-like
stage with a value head and tensor state resuming bit for bit."""

import dataclasses
import json
import shutil

import pytest
import torch

from sprout.checkpoint import load_train_state, read_meta, save_checkpoint
from sprout.model.load import init_from_lm, load_model
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import meta_digest
from sprout.losses.tokens import token_nll_sum
from sprout.model.generate import generate
from sprout.model.heads import PolicyWithValue, RewardModel, last_index, padding_inputs, score_at
from sprout.model.transformer import ModelConfig, Transformer
from sprout.engine.training_loop import fit
from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
from sprout.engine.metrics import read_metrics
from sprout.engine.optim import OptimConfig, build_optimizer, lr_schedule
from sprout.engine.stage import TokenStage

V = 64
CFG = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)


def build(cls, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(ModelConfig(**{**CFG, **kw}))


def lm_checkpoint(path, **kw):
    model = build(Transformer, **kw)
    return save_checkpoint(path, model, meta={"model_config": model.config, "stage": "sft", "step": 1}), model


# ---- heads ------------------------------------------------------------------------------------------
def test_value_head_reads_the_final_hidden_state_and_keeps_the_lm_path():
    policy = build(PolicyWithValue)
    lm = Transformer(policy.config)
    lm.load_state_dict({k: v for k, v in policy.state_dict().items() if k != "value_head.weight"})
    x = torch.randint(0, V, (2, 7))
    assert [n for n, _ in policy.named_parameters()] == [n for n, _ in lm.named_parameters()] + ["value_head.weight"]
    logits, values = policy(x, return_values=True)
    assert torch.equal(policy(x), lm(x)) and torch.equal(logits, lm(x))
    assert values.shape == (2, 7) and values.dtype == torch.float32
    assert torch.allclose(values, lm.hidden_states(x) @ policy.value_head.weight[0])
    assert policy.value_head.weight.shape == (1, 32)


def test_last_index_and_score_at_hand_checked():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert last_index(mask).tolist() == [4, 2, 4]
    scores = torch.arange(15.0).view(3, 5)
    assert score_at(scores, last_index(mask)).tolist() == [4.0, 7.0, 14.0]
    segments, positions = padding_inputs(mask)
    assert positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4]]
    assert segments.tolist() == mask.tolist()


def test_reward_score_is_the_same_under_left_and_right_padding():
    rm = build(RewardModel).eval()
    assert not hasattr(rm, "lm_head")
    rows = [[5, 9, 3, 7, 2, 11], [4, 8, 1], [6, 6, 10, 12]]
    alone = torch.stack([rm(torch.tensor([r]))[0, -1] for r in rows])
    L = max(map(len, rows))
    for side in ("left", "right"):
        pad = [[0] * (L - len(r)) + r if side == "left" else r + [0] * (L - len(r)) for r in rows]
        mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) if side == "left" else [1] * len(r) + [0] * (L - len(r))
                             for r in rows])
        segments, positions = padding_inputs(mask)
        scores = rm(torch.tensor(pad), segment_ids=segments, position_ids=positions)
        end = score_at(scores, last_index(mask))
        assert torch.allclose(end, alone, atol=1e-6), side
    # the score is not blind to the padding scheme by accident: without the segment ids it moves
    left = torch.tensor([[0] * (L - len(r)) + r for r in rows])
    assert not torch.allclose(rm(left)[1, -1], alone[1], atol=1e-4)


# ---- checkpoints: architecture, round trip, dispatch -----------------------------------------------------------
def test_value_model_checkpoint_round_trip(tmp_path):
    policy = build(PolicyWithValue)
    path = save_checkpoint(tmp_path / "ck", policy, meta={"model_config": policy.config})
    assert read_meta(path)["architecture"] == "lm+value"
    loaded, meta = load_model(path)
    assert type(loaded) is PolicyWithValue
    x = torch.randint(0, V, (3, 9))
    a, b = policy.eval()(x, return_values=True), loaded(x, return_values=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("cls, arch", [(Transformer, "lm"), (PolicyWithValue, "lm+value"), (RewardModel, "reward")])
def test_load_model_builds_the_recorded_architecture(tmp_path, cls, arch):
    model = build(cls, tie_embeddings=True)
    path = save_checkpoint(tmp_path / arch, model, meta={"model_config": model.config})
    assert json.loads((path / "meta.json").read_text())["architecture"] == arch
    loaded, _ = load_model(path)
    assert type(loaded) is cls
    x = torch.randint(0, V, (2, 5))
    assert torch.equal(loaded(x), model.eval()(x))


def test_an_unknown_architecture_is_refused(tmp_path):
    path, lm = lm_checkpoint(tmp_path / "old")
    meta = json.loads((path / "meta.json").read_text())
    meta["architecture"] = "critic"
    (path / "meta.json").write_text(json.dumps({**meta, "meta_sha256": meta_digest(meta)}))
    with pytest.raises(SproutError, match=r"old/meta.json: unknown architecture 'critic' \(known: lm, lm\+value, "
                                          r"reward\)"):
        load_model(path)


@pytest.mark.parametrize("arch, cls", [("reward", RewardModel), ("lm+value", PolicyWithValue)])
def test_head_model_from_an_lm_checkpoint(tmp_path, arch, cls):
    path, lm = lm_checkpoint(tmp_path / "lm", tie_embeddings=arch == "reward")
    rng = torch.get_rng_state()
    model, meta = init_from_lm(path, arch, seed=3)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left alone
    assert type(model) is cls and model.training and meta["step"] == 1
    head = "score_head.weight" if arch == "reward" else "value_head.weight"
    own, src = model.state_dict(), lm.state_dict()
    assert all(torch.equal(v, src[k]) for k, v in own.items() if k != head)  # the whole backbone
    assert set(own) - set(src) == {head}
    again, _ = init_from_lm(path, arch, seed=3)
    other, _ = init_from_lm(path, arch, seed=4)
    assert torch.equal(again.state_dict()[head], own[head])  # seeded
    assert not torch.equal(other.state_dict()[head], own[head])
    assert own[head].std().item() == pytest.approx(0.02, rel=0.5)  # N(0, init_std)


def test_a_reward_checkpoint_is_refused_by_chat(tmp_path):
    from sprout.model.chat_session import load_chat_model

    rm = build(RewardModel)
    path = save_checkpoint(tmp_path / "rm", rm, meta={"model_config": rm.config, "tokenizer": "tiktoken:r50k_base"})
    with pytest.raises(SproutError, match=r"rm/meta.json: a reward model scores text; it has no LM head"):
        load_chat_model(path)


def test_head_model_from_a_mismatched_checkpoint_is_refused(tmp_path):
    rm = build(RewardModel)
    path = save_checkpoint(tmp_path / "rm", rm, meta={"model_config": rm.config})
    with pytest.raises(SproutError, match=r"rm/model.safetensors: not a backbone for this model "
                                          r"\(missing lm_head.weight\)"):
        init_from_lm(path, "lm+value")  # a reward model has no lm_head to give a policy


# ---- a stage with a value head and a rollout buffer resumes bit for bit ---------------------------------------
class ValueStage(TokenStage):
    """Generates rollouts with the policy every 2 steps (sampled with the stage's own generator)
    into a buffer, then trains LM loss + value regression on them, one rollout batch per step."""

    name = "toy_value"

    def __init__(self, trainer_ref):
        self.trainer_ref = trainer_ref
        self.gen = torch.Generator().manual_seed(7)
        self.buffer: list[torch.Tensor] = []

    def next_micro_batches(self, step):
        if not self.buffer:
            model = self.trainer_ref[0].generation_model
            model.eval()  # (not `model.eval()` passed on: that is the module, not the uncompiled wrapper)
            prompts = torch.randint(1, V, (8, 3), generator=self.gen).tolist()
            gen = generate(model, prompts, 6, temperature=1.0, generator=self.gen)
            rows = torch.tensor([p + t for p, t in zip(prompts, gen.tokens)])  # no stop ids: all 9 long
            self.buffer = list(rows.split(4))
        rows = self.buffer.pop(0)
        returns = (rows[:, 1:] % 5).float() / 5  # a fixed function of the rollout
        return [{"input_ids": rows[:, :-1], "targets": rows[:, 1:], "returns": returns}]

    def loss(self, model, batch):
        logits, values = model(batch["input_ids"], return_values=True)
        nll, n = token_nll_sum(logits, batch["targets"])
        vf = 0.5 * (values - batch["returns"]).pow(2).sum()
        return nll + vf, n, {"vf_loss": (vf.detach(), n)}

    def evaluate(self, model):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def tensor_state(self):
        return {"generator": self.gen.get_state(), "buffer": list(self.buffer)}

    def load_tensor_state(self, state):
        self.gen.set_state(state["generator"])
        self.buffer = list(state["buffer"])


def value_run(out, start=None):
    cfg = TrainConfig(max_steps=6, log_every=1, eval_every=0, ckpt_every=3, progress=False, peak_tflops=-1)
    optim = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant")
    acc = make_accelerator(cfg)
    model = build(PolicyWithValue, seed=1)
    ref = []
    trainer = Trainer(acc, model, build_optimizer(model, optim), lr_schedule(optim, 6), cfg, out_dir=out,
                      meta={"model_config": dataclasses.asdict(model.config)})
    ref.append(trainer)
    stage = ValueStage(ref)
    if start is not None:
        trainer.resume(trainer.check_resume(start, stage), stage)
    fit(trainer, stage)
    return {r["step"]: (r["loss"], r["vf_loss"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def test_value_head_stage_resumes_bit_for_bit(tmp_path):
    a = value_run(tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000003"
    meta = read_meta(ckpt)
    assert meta["architecture"] == "lm+value" and "buffer" not in json.dumps(meta)
    extra = load_train_state(ckpt)["extra"]["stage"][0]  # read back with weights_only=True
    assert len(extra["buffer"]) == 1 and extra["buffer"][0].shape == (4, 9)  # stopped mid-buffer
    b_dir = tmp_path / "b"
    shutil.copytree(ckpt, b_dir / "checkpoints" / "step_00000003")
    b = value_run(b_dir, start=b_dir / "checkpoints" / "step_00000003")
    assert sorted(b) == [4, 5, 6]
    assert [b[s] for s in b] == [a[s] for s in b]  # exact float equality
    assert type(load_model(tmp_path / "a")[0]) is PolicyWithValue
