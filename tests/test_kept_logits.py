"""Logits at the loss positions only (`sprout.losses.tokens.loss_positions` as the model's
`logits_to_keep`): SFT on packed rows of several conversations, DPO (padded and padding-free,
with a live reference, several loss types) and the reward model's log-prob score give the loss,
every parameter's gradient (two accumulated micro-batches) and every logged metric of the same
loss functions fed the logits of every position, within 1e-6 in fp32; the lm_head really runs
at the kept positions alone; a row with nothing to score gives 0 and count 0; the stages'
FLOPs count the lm_head at the kept positions only."""

import random

import pytest
import torch
from preference_train_fixtures import WORDS, base  # noqa: F401 (base: a fixture)

from data_loader.preference_batches import PreferenceLoader
from sprout.engine.configs import LoraConfig
from sprout.formats.preference_pairs import write_preferences
from sprout.losses.tokens import loss_positions, sequence_logps, token_nll_sum
from sprout.model.config import ModelConfig
from sprout.model.load import load_model
from sprout.model.lora import add_adapters
from sprout.model.transformer import Transformer
from sprout.stages.configs import DPOLossConfig, RewardLossConfig
from sprout.stages.dpo import DPOStage
from sprout.stages.reward import RewardStage
from sprout.stages.sft import SFTStage, sft_batch_loss

TOL = 1e-6


class EveryPosition(torch.nn.Module):
    """`model` computing logits at every position whatever `logits_to_keep` asks: the loss
    functions then read the masked rows out of the full logits themselves (`logits_at`), what
    each stage computed before its logits were kept."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, logits_to_keep=0, **kwargs):
        return self.model(*args, **kwargs)


def lm_head_rows(model) -> list[int]:
    """A list that gets the number of rows of each lm_head call of `model`."""
    seen: list[int] = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1].numel()))
    return seen


def step(loss_fn, count_fn, model, batches) -> tuple[float, dict, dict]:
    """(loss / N, every parameter's gradient, each metric's summed (sum, count)) of one step of
    accumulated micro-batches, as `Trainer.step` takes it on one process."""
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    n = sum(int(count_fn(b)) for b in batches)
    total, metrics = 0.0, {}
    for b in batches:
        loss, count, m = loss_fn(b)
        (loss / n).backward()
        total += float(loss.detach())
        for k, (s, c) in m.items():
            old = metrics.get(k, (0.0, 0.0))
            metrics[k] = (old[0] + float(s), old[1] + float(c))
    return total / n, {k: p.grad.clone() for k, p in params.items() if p.grad is not None}, metrics


def max_diff(a, b) -> float:
    """The largest difference of the loss, any parameter's gradient and any metric's sum, each
    relative to its own scale once that passes 1."""
    (la, ga, ma), (lb, gb, mb) = a, b
    assert sorted(ga) == sorted(gb) and sorted(ma) == sorted(mb)
    assert all(ma[k][1] == mb[k][1] for k in ma)  # the same counts
    rel = lambda x, y: float((torch.as_tensor(x) - torch.as_tensor(y)).abs().max()) / max(  # noqa: E731
        1.0, float(torch.as_tensor(x).abs().max()))
    return max([rel(la, lb)] + [rel(ga[k], gb[k]) for k in ga] + [rel(ma[k][0], mb[k][0]) for k in ma])


# ---- SFT -------------------------------------------------------------------------------------------------------
def tiny_lm(seed: int = 0, **over) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{"vocab_size": 96, "d_model": 32, "n_layers": 2, "n_heads": 4,
                                      "max_seq_len": 32, **over}))


def packed_sft_batch(seed: int, segments: list[list[int]], width: int = 16) -> dict:
    """Rows of several conversations (`segments`: each row's conversation lengths, the rest
    padding), positions restarting per conversation, a random half of the real targets trained."""
    g = torch.Generator().manual_seed(seed)
    rows = len(segments)
    seg, pos = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width, dtype=torch.long)
    for r, lengths in enumerate(segments):
        at = 0
        for s, n in enumerate(lengths, start=1):
            seg[r, at:at + n], pos[r, at:at + n] = s, torch.arange(n)
            at += n
    mask = (torch.rand(rows, width, generator=g) < 0.5) & (seg > 0)
    return {"input_ids": torch.randint(0, 96, (rows, width), generator=g), "segment_ids": seg, "position_ids": pos,
            "targets": torch.randint(0, 96, (rows, width), generator=g), "loss_mask": mask.long()}


def test_sft_kept_logits_give_the_every_position_loss_gradients_and_metrics():
    model = tiny_lm()
    batches = [packed_sft_batch(1, [[5, 7, 4], [9, 5], [16]]), packed_sft_batch(2, [[3, 3, 3, 3], [11], [2, 14]])]
    batches[1]["loss_mask"][1] = 0  # a row that trains nothing
    stage = SFTStage(None, None, None, 1)
    rows = lm_head_rows(model)
    kept = step(lambda b: stage.loss(model, b), stage.count_targets, model, batches)
    assert rows == [int(b["loss_mask"].sum()) for b in batches]  # the lm_head ran at the trained positions alone
    every = step(lambda b: stage.loss(EveryPosition(model), b), stage.count_targets, model, batches)
    assert rows[2:] == [b["input_ids"].numel() for b in batches]
    assert set(kept[2]) == {"accuracy", "entropy"}
    diff = max_diff(kept, every)
    print(f"sft: max loss, gradient or metric difference, kept vs every position: {diff:.2g}")
    assert diff < TOL


def test_a_batch_or_row_with_nothing_to_score_gives_zero_and_count_zero():
    model = tiny_lm()
    batch = packed_sft_batch(3, [[8, 8], [16]])
    batch["loss_mask"].zero_()
    nll, n, metrics = sft_batch_loss(model, batch)
    assert float(nll.detach()) == 0.0 and int(n) == 0
    assert all(int(c) == 0 and float(s) == 0 for s, c in metrics.values())
    nll.backward()  # no logits, still a graph
    logits = model(batch["input_ids"], logits_to_keep=loss_positions(batch["loss_mask"]))
    assert logits.shape == (1, 0, 96)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]])
    full = torch.randn(3, 4, 96)
    targets = torch.randint(0, 96, (3, 4))
    kept = full.view(-1, 96)[loss_positions(mask)][None]
    for given in (full, kept):
        logp, count = sequence_logps(given, targets, mask)
        assert logp[1] == 0 and count.tolist() == [2, 0, 2]
        by_hand = full.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        torch.testing.assert_close(logp, (by_hand * mask).sum(-1))
        assert float(token_nll_sum(given, targets, mask)[0]) == pytest.approx(-float(logp.sum()), rel=1e-6)


# ---- DPO and the reward model's log-prob score ------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Pairs whose sides range from 1 to 9 words (padding to drop, short sides sharing packed rows)."""
    rng = random.Random(0)
    say = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9)))  # noqa: E731
    path = tmp_path_factory.mktemp("pairs") / "preferences.jsonl"
    write_preferences(path, [{"id": f"k{i}", "source": "synthetic",
                              "prompt": [{"role": "user", "content": f"Say {rng.choice(WORDS)} {i}."}],
                              "chosen": [{"role": "assistant", "content": say()}],
                              "rejected": [{"role": "assistant", "content": say()}]} for i in range(8)])
    return path


def preference_step(stage, model, batches, every: bool = False):
    """`step` of `stage`'s loss on `model`, its logits at every position when `every`."""
    run = EveryPosition(model) if every else model
    return step(lambda b: stage.loss(run, b), stage.count_targets, model, batches)


def nudged(model, seed: int = 1):
    """`model` with every weight moved a little: a policy apart from its reference."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", ["sigmoid", "sft"], "simpo", "orpo"])
def test_dpo_kept_logits_give_the_every_position_loss_gradients_and_metrics(loss_type, sp, base, pairs):
    policy, ref = nudged(load_model(base)[0]), load_model(base)[0]
    loss_cfg = DPOLossConfig(loss_type=loss_type)
    results, heads = {}, {}
    for name, options in {"kept": {}, "kept, padding_free": {"padding_free": True}, "every": {}}.items():
        loader = PreferenceLoader(pairs, sp, batch_size=8, seq_len=64, seed=0)
        stage = DPOStage(None, loader, loader, 2, loss_cfg, EveryPosition(ref) if name == "every" else ref, **options)
        batches = stage.next_micro_batches(0)
        heads[name] = lm_head_rows(policy)
        results[name] = preference_step(stage, policy, batches, every=name == "every")
        policy.lm_head._forward_hooks.clear()
    responses = [int(b["loss_mask"].sum()) for b in batches]
    assert heads["kept"] == heads["kept, padding_free"] == responses
    assert heads["every"] == [b["input_ids"].numel() for b in batches]
    assert {"logits/chosen", "logits/rejected", "logps/chosen", "rewards/margins"} <= set(results["kept"][2])
    diffs = {name: max_diff(results["every"], r) for name, r in results.items() if name != "every"}
    print(f"dpo {loss_type}: max loss, gradient or metric difference vs every position: "
          + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))
    assert max(diffs.values()) < TOL


def test_reward_logprob_kept_logits_give_the_every_position_loss_gradients_and_metrics(sp, base, pairs):
    model = load_model(base)[0]
    results = {}
    for name, options in {"kept": {}, "kept, padding_free": {"padding_free": True}, "every": {}}.items():
        loader = PreferenceLoader(pairs, sp, batch_size=8, seq_len=64, seed=0)
        stage = RewardStage(None, loader, loader, 2, RewardLossConfig(score="logprob"), **options)
        results[name] = preference_step(stage, model, stage.next_micro_batches(0), every=name == "every")
    diffs = {name: max_diff(results["every"], r) for name, r in results.items() if name != "every"}
    print("reward logprob: max loss, gradient or metric difference vs every position: "
          + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))
    assert max(diffs.values()) < TOL


# ---- FLOPs -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_flops_count_the_lm_head_at_the_kept_positions_only(tied):
    """6 per parameter of the lm_head's matmul at each kept position, 4 once it is frozen
    (LoRA's base); the blocks at every position."""
    model = tiny_lm(tie_embeddings=tied)
    batch = packed_sft_batch(4, [[5, 7, 4], [9, 5]])
    tokens, kept = batch["input_ids"].numel(), int(batch["loss_mask"].sum())
    assert 0 < kept < tokens
    head = 96 * 32
    assert model.lm_head_flops_per_token() == 6 * head
    stage = SFTStage(None, None, None, 1)
    assert stage.flops(model, batch) == model.flops_per_token(16) * tokens - 6 * head * (tokens - kept)
    assert model.training_flops(16, tokens) == model.flops_per_token(16) * tokens
    add_adapters(model, LoraConfig(r=2))  # lm_head is no LoRA target: frozen
    assert model.lm_head_flops_per_token() == 4 * head
    assert stage.flops(model, batch) == model.flops_per_token(16) * tokens - 4 * head * (tokens - kept)


def test_rl_flops_count_the_lm_head_at_the_completion_tokens_only():
    """The RL stages keep logits at the completion tokens (`CompletionRows`): the blocks count
    every real prompt and completion token, the lm_head the completion tokens alone."""
    from sprout.stages.rl_stage import RLStage

    model = tiny_lm()
    batch = {"prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
             "completion_ids": torch.tensor([[4, 3, 0], [2, 2, 2]]),
             "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    tokens, kept = 5 + 5, 5
    stage = RLStage.__new__(RLStage)  # flops and num_tokens read nothing of the stage's state
    flops = stage.flops(model, batch)
    assert flops == model.flops_per_token(6) * tokens - model.lm_head_flops_per_token() * (tokens - kept)
    assert flops < model.flops_per_token(6) * tokens
