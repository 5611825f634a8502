"""Padding-free micro-batches and micro-batches by a token budget (`sprout.stages.packing`): the
packed layout, the cuts and their agreement over processes, and for DPO, the reward model, GRPO
and PPO one optimizer step's loss and every parameter's gradient equal to the padded path's of a
fixed count (fp32, under gradient accumulation, within 1e-6); position and segment ids shown to
matter; bad values refused in one line; the new options leave a default config's hash as it was."""

import copy
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from grpo_fixtures import config_dict
from grpo_fixtures import data as prompts  # noqa: F401 (a fixture)
from preference_train_fixtures import WORDS, base, cli_flags, tiny_cfg, write_pairs  # noqa: F401 (base: a fixture)
from proc import free_port, run_group

from data_loader.preference_batches import PreferenceLoader
from data_loader.prompt_batches import PromptLoader
from sprout.config import from_dict, resume_config
from sprout.engine.metrics import read_metrics
from sprout.errors import SproutError
from sprout.formats.preference_pairs import write_preferences
from sprout.losses.tokens import sequence_logps
from sprout.model.load import init_from_lm, load_model
from sprout.stages.configs import (DPOConfig, DPOLossConfig, GRPOConfig, GRPOLossConfig, PPOBatchConfig,
                                   PPOLossConfig, PromptBatchConfig, RewardConfig, RewardLossConfig, RolloutConfig)
from sprout.stages.dpo import DPOStage, run_dpo
from sprout.stages.grpo import GRPOStage, run_grpo
from sprout.stages.packing import PackedRows, budget_slices, packed_cost, split_to
from sprout.stages.ppo import PPOStage
from sprout.stages.reward import RewardStage
from sprout.stages.rl_rewards import RewardsConfig, build_rewards

TOL = 1e-6
ROOT = Path(__file__).resolve().parents[1]


# ---- the layout and the cuts ----------------------------------------------------------------------------------
def test_packed_rows_lay_every_sequence_once_with_its_own_positions():
    """Right, left and prompt-then-completion padding: each real token once, in order, positions
    from 0 and a segment of its own per sequence; no row wider than the longest sequence; unpack
    gives the padded batch back (0 off the mask)."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]]).bool()
    x = torch.arange(25).view(5, 5) + 100
    rows = PackedRows(mask)
    assert rows.width == 5 and rows.rows == 3
    packed = rows.pack(x)
    assert sorted(packed[rows.segment_ids > 0].tolist()) == sorted(x[mask].tolist())
    for i in range(5):
        place = rows.index[i][mask[i]]
        assert torch.equal(packed.view(-1)[place], x[i][mask[i]])
        assert rows.position_ids.view(-1)[place].tolist() == list(range(int(mask[i].sum())))
        assert len(set(rows.segment_ids.view(-1)[place].tolist())) <= 1
    seqs = {(int(r), int(s)) for r, s in zip(torch.arange(3)[:, None].expand(3, 5)[rows.segment_ids > 0],
                                              rows.segment_ids[rows.segment_ids > 0])}
    assert len(seqs) == 4  # four non-empty sequences, each its own (row, segment)
    assert torch.equal(rows.unpack(packed), torch.where(mask, x, 0))
    with pytest.raises(ValueError, match="contiguous"):
        PackedRows(torch.tensor([[1, 0, 1]]).bool())


def test_budget_slices_cut_consecutive_units_within_the_budget():
    lengths = np.array([[10, 12], [30, 31], [5, 5], [8, 9], [40, 2]])
    cost = packed_cost(lengths)
    got = budget_slices(5, 8, 64, cost, unit="pairs")
    assert got == [slice(0, 1), slice(1, 2), slice(2, 4), slice(4, 5)]  # 22 | 61 | 10 + 17 | 42
    assert all(cost(s.start, s.stop) <= 64 for s in got)
    assert budget_slices(5, 2, 0) == [slice(0, 2), slice(2, 4), slice(4, 5)]  # no budget: today's fixed count
    assert budget_slices(5, 1, 1000, cost) == [slice(i, i + 1) for i in range(5)]  # max_units still caps
    with pytest.raises(SproutError, match=r"^batch\.micro_batch_tokens 40: one of the pairs has 61 tokens"):
        budget_slices(5, 8, 40, cost, unit="pairs")


def test_every_process_runs_as_many_micro_batches_as_the_busiest():
    """Another process needs 4 micro-batches: this one's 2 (4 + 2 units) are halved, the largest
    first (the first of equals), to 4, each within the budget; a count beyond the units is
    impossible (each process holds as many units)."""
    other = SimpleNamespace(num_processes=2, device="cpu", gather=lambda t: torch.cat([t, torch.tensor([4])]))
    cost = packed_cost(np.full((6, 1), 10))
    got = budget_slices(6, 8, 40, cost, other)
    assert got == [slice(0, 1), slice(1, 2), slice(2, 4), slice(4, 6)]
    assert split_to([slice(0, 3)], 3) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    with pytest.raises(ValueError):
        split_to([slice(0, 2)], 3)


# ---- one optimizer step, as the trainer takes it -----------------------------------------------------------------
def accumulate(stage, model, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """The step's loss and gradients as `Trainer.step` makes them on one process: N counted over
    every micro-batch first, each micro-batch's loss sum / N backpropagated."""
    model.zero_grad(set_to_none=True)
    n = sum(int(stage.count_targets(b)) for b in batches)
    total = 0.0
    for b in batches:
        loss, count, _ = stage.loss(model, b)
        (loss / n).backward()
        total += float(loss.detach())
    return total / n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def max_diff(a, b) -> float:
    """The largest difference of the loss and of any parameter's gradient, each relative to its
    own scale once that passes 1 (fp32 holds a loss of 25 to about 2e-6)."""
    (la, ga), (lb, gb) = a, b
    assert sorted(ga) == sorted(gb)
    rel = lambda x, y: float((x - y).abs().max()) / max(1.0, float(x.abs().max()))  # noqa: E731
    return max([rel(torch.tensor(la), torch.tensor(lb))] + [rel(ga[k], gb[k]) for k in ga])


def report(name: str, diffs: dict) -> None:
    print(f"{name}: max loss or gradient difference vs padded fixed count: "
          + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))


# ---- the preference stages ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("prefs"), n_train=32, n_test=8)


def varied_pairs(n: int, seed: int) -> list[dict]:
    """Pairs whose sides range from 1 to 9 words: short sides share a packed row."""
    rng = random.Random(seed)
    say = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9)))  # noqa: E731
    return [{"id": f"v{seed}-{i}", "source": "synthetic",
             "prompt": [{"role": "user", "content": f"Say {rng.choice(WORDS)} {i}."}],
             "chosen": [{"role": "assistant", "content": say()}],
             "rejected": [{"role": "assistant", "content": say()}]} for i in range(n)]


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """preferences.jsonl of 32 `varied_pairs`, and 8 others as its dev and test files."""
    folder = tmp_path_factory.mktemp("varied")
    write_preferences(folder / "preferences.jsonl", varied_pairs(32, 0))
    for name in ("preferences_dev.jsonl", "preferences_test.jsonl"):
        write_preferences(folder / name, varied_pairs(8, 1))
    return folder / "preferences.jsonl"


PREF_VARIANTS = {  # name: (accum_steps of 8 pairs, stage options); "padded" is today's path
    "padded": (4, {}),
    "padding_free": (4, {"padding_free": True}),
    "padding_free, 1 micro-batch": (1, {"padding_free": True}),  # 16 sides in 14 rows
    "padding_free+tokens": (1, {"padding_free": True, "micro_batch_tokens": 160}),  # both sides' tokens
    "padded+tokens": (1, {"micro_batch_tokens": 300}),  # 2 × pairs × the longest side
}


def preference_step(stage_cls, make_model, sp, pairs, accum, options, *args):
    loader = PreferenceLoader(pairs, sp, batch_size=8, seq_len=64, seed=0)
    stage = stage_cls(None, loader, loader, accum, *args, **options)
    model = make_model()
    model.train()
    batches = stage.next_micro_batches(0)
    return accumulate(stage, model, batches), len(batches)


@pytest.mark.parametrize("loss_type", ["sigmoid", ["ipo", "sft"]])
def test_dpo_padding_free_and_token_budget_equal_the_padded_step(loss_type, sp, base, varied):
    ref, _ = load_model(base)
    results = {name: preference_step(DPOStage, lambda: load_model(base)[0], sp, varied, accum, options,
                                     DPOLossConfig(loss_type=loss_type), ref)
               for name, (accum, options) in PREF_VARIANTS.items()}
    counts = {name: r[1] for name, r in results.items()}
    # the budgets made cuts of their own, still accumulating over several micro-batches
    assert counts["padded"] == 4 and counts["padding_free+tokens"] not in (1, 4) and counts["padded+tokens"] > 1
    diffs = {name: max_diff(results["padded"][0], r[0]) for name, r in results.items() if name != "padded"}
    report(f"dpo {loss_type}", diffs)
    assert max(diffs.values()) < TOL


@pytest.mark.parametrize("score", ["head", "logprob"])
def test_reward_padding_free_and_token_budget_equal_the_padded_step(score, sp, base, varied):
    arch = "reward" if score == "head" else "lm"
    results = {name: preference_step(RewardStage, lambda: init_from_lm(base, arch, seed=0)[0], sp, varied, accum,
                                     options, RewardLossConfig(score=score))
               for name, (accum, options) in PREF_VARIANTS.items()}
    diffs = {name: max_diff(results["padded"][0], r[0]) for name, r in results.items() if name != "padded"}
    report(f"reward {score}", diffs)
    assert max(diffs.values()) < TOL


def test_positions_and_segments_matter(sp, base, varied):
    """The equality above can fail: packed sides whose attention crosses into the side before them
    give other log-probs. (Positions running on over a row would not show here: rotary attention
    sees only relative positions within a segment; they are reset so no row passes the model's
    rotary tables and each side's tokens take exactly the padded path's positions.)"""
    model, _ = load_model(base)
    batch = PreferenceLoader(varied, sp, batch_size=4, seq_len=64, shuffle=False).collate(np.arange(4))
    with torch.no_grad():
        padded = sequence_logps(model(batch["input_ids"], segment_ids=batch["segment_ids"],
                                      position_ids=batch["position_ids"]), batch["targets"], batch["loss_mask"])[0]
        rows = PackedRows(batch["attention_mask"])
        assert rows.rows < 8  # sides share rows

        def logps(segment_ids, position_ids):
            logits = model(rows.pack(batch["input_ids"]), segment_ids=segment_ids, position_ids=position_ids)
            R, W, V = logits.shape
            per_token, _ = sequence_logps(logits.view(R * W, 1, V), rows.pack(batch["targets"]).view(-1, 1),
                                          rows.pack(batch["loss_mask"]).view(-1, 1))
            return rows.unpack(per_token.view(R, W)).sum(-1)

        assert (logps(rows.segment_ids, rows.position_ids) - padded).abs().max() < TOL
        crossing = (logps((rows.segment_ids > 0).long(), rows.position_ids) - padded).abs()
        print(f"attention across packed sides: max |log-prob difference| {float(crossing.max()):.3g}")
        assert crossing.max() > 1e-2


# ---- the RL stages ---------------------------------------------------------------------------------------------
def uneven(buffer: dict, seed: int = 0) -> dict:
    """The buffer with completions cut to random lengths and prompts shortened at the left (still a
    left-padded prompt then a right-padded completion), so packing has padding to drop."""
    out = copy.deepcopy(buffer)
    g = torch.Generator().manual_seed(seed)
    n, L = out["completion_mask"].shape
    keep = torch.randint(1, L + 1, (n,), generator=g)
    out["completion_mask"] = out["completion_mask"] * (torch.arange(L)[None, :] < keep[:, None])
    cut = torch.randint(0, 4, (n,), generator=g)
    first = out["prompt_mask"].int().argmax(1)
    out["prompt_mask"] = out["prompt_mask"] * (torch.arange(out["prompt_mask"].shape[1])[None, :]
                                               >= (first + cut)[:, None])
    return out


def rl_step(stage, model, buffer):
    stage.buffer, stage.served = copy.deepcopy(buffer), 0
    batches = stage.next_micro_batches(0)
    return accumulate(stage, model, batches), len(batches)


RL_VARIANTS = {  # name: (micro_completions, batch options)
    "padded": (2, {}),
    "padding_free": (2, {"padding_free": True}),
    "padding_free+tokens": (8, {"padding_free": True, "micro_batch_tokens": 64}),
    "padded+tokens": (8, {"micro_batch_tokens": 90}),
}


def grpo_stage(sp, base, data, micro, options, **grpo):
    model, _ = load_model(base)
    acc = Accelerator(cpu=True)
    batch = PromptBatchConfig(global_prompts=2, num_generations=4, micro_completions=micro, **options)
    rollout = RolloutConfig(max_completion_length=12)
    loader = PromptLoader(data, sp, 24, batch.global_prompts, seed=0)
    val = PromptLoader(data.with_name("prompts_dev.jsonl"), sp, 24, 1, shuffle=False)
    stage = GRPOStage(acc, sp, loader, val, batch, rollout,
                      build_rewards(RewardsConfig(reward_funcs=["grpo_fixtures:digit_share"]), 12),
                      grpo=GRPOLossConfig(**grpo), ref_model=load_model(base)[0], seed=0)
    stage.setup(SimpleNamespace(generation_model=model, sharded=False, prepare_frozen=lambda m: m))
    return stage, model


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_padding_free_and_token_budget_equal_the_padded_step(loss_type, sp, base, prompts):
    """μ = 2 with a KL (old and reference log-probs from no-grad passes, which pack too)."""
    grpo = {"loss_type": loss_type, "num_iterations": 2, "beta": 0.1}
    stages = {name: grpo_stage(sp, base, prompts, micro, options, **grpo)
              for name, (micro, options) in RL_VARIANTS.items()}
    first, _ = stages["padded"]
    buffer = uneven(first.serve_buffer(0))
    ref_logps = {name: s.logps_of(s.ref_model, buffer) for name, (s, _) in stages.items()}
    assert max(float((ref_logps["padded"] - v).abs().max()) for v in ref_logps.values()) < TOL
    results = {name: rl_step(s, model, buffer) for name, (s, model) in stages.items()}
    assert results["padded"][1] == 4 and results["padding_free+tokens"][1] not in (1, 4)
    diffs = {name: max_diff(results["padded"][0], r[0]) for name, r in results.items() if name != "padded"}
    report(f"grpo {loss_type}", diffs)
    assert max(diffs.values()) < TOL


def ppo_stage(sp, base, data, micro, options):
    policy, _ = init_from_lm(base, "lm+value", seed=0)
    batch = PPOBatchConfig(global_prompts=4, num_generations=2, micro_completions=micro, **options)
    rollout = RolloutConfig(max_completion_length=12)
    loader = PromptLoader(data, sp, 24, batch.global_prompts, seed=0)
    val = PromptLoader(data.with_name("prompts_dev.jsonl"), sp, 24, 1, shuffle=False)
    stage = PPOStage(Accelerator(cpu=True), sp, loader, val, batch, rollout,
                     build_rewards(RewardsConfig(reward_funcs=["grpo_fixtures:digit_share"]), 12),
                     ppo=PPOLossConfig(num_ppo_epochs=1, kl_in="loss"), ref_model=load_model(base)[0])
    stage.setup(SimpleNamespace(generation_model=policy, sharded=False, prepare_frozen=lambda m: m))
    return stage, policy


def test_ppo_padding_free_and_token_budget_equal_the_padded_step(sp, base, prompts):
    """Policy, value and KL terms: the values read back per token from the packed rows."""
    stages = {name: ppo_stage(sp, base, prompts, micro, options) for name, (micro, options) in RL_VARIANTS.items()}
    first, _ = stages["padded"]
    buffer = uneven(first.serve_buffer(0))
    olds = {name: s.old_logps_and_values(buffer) for name, (s, _) in stages.items()}
    assert max(float((olds["padded"][k] - v[k]).abs().max()) for v in olds.values() for k in (0, 1)) < TOL
    results = {name: rl_step(s, model, buffer) for name, (s, model) in stages.items()}
    assert results["padded"][1] == 4
    diffs = {name: max_diff(results["padded"][0], r[0]) for name, r in results.items() if name != "padded"}
    report("ppo", diffs)
    assert max(diffs.values()) < TOL


# ---- configs ------------------------------------------------------------------------------------------------------
def test_the_options_leave_a_default_config_hash_as_it_was():
    """padding_free changes no result (resume-free, as gradient_checkpointing); micro_batch_tokens
    enters the resume config only once set."""
    for cls in (DPOConfig, RewardConfig, GRPOConfig):
        assert sorted(resume_config(cls())["batch"]) in (["global_pairs", "micro_pairs"],
                                                         ["global_prompts", "micro_completions", "num_generations"])
    cfg = from_dict(DPOConfig, {"batch": {"padding_free": True, "micro_batch_tokens": 256}})
    assert resume_config(cfg)["batch"] == {"global_pairs": 64, "micro_pairs": 8, "micro_batch_tokens": 256}


def test_bad_values_are_refused_in_one_line(sp, base, pairs, prompts, tmp_path):
    with pytest.raises(SproutError, match=r"batch\.micro_batch_tokens: got -1; expected an integer in \[0, inf\)"):
        from_dict(DPOConfig, {"batch": {"micro_batch_tokens": -1}})
    with pytest.raises(SproutError, match=r"batch\.padding_free"):
        from_dict(GRPOConfig, {"batch": {"padding_free": "maybe"}})
    out = tmp_path / "dpo"
    with pytest.raises(SproutError, match=r"^batch\.micro_batch_tokens: got 100; expected 0 or at least "
                                          r"2 × data\.seq_len = 128 \(both sides") as exc:
        run_dpo(tiny_cfg(DPOConfig, pairs, base, out, micro_batch_tokens=100, seq_len=64))
    assert "\n" not in str(exc.value) and not out.exists()
    out = tmp_path / "grpo"
    with pytest.raises(SproutError, match=r"^batch\.micro_batch_tokens: got 30; expected 0 or at least "
                                          r"data\.max_prompt_length \+ rollout\.max_completion_length = 36") as exc:
        cfg = config_dict(prompts, base, out)
        run_grpo(from_dict(GRPOConfig, {**cfg, "batch": {**cfg["batch"], "micro_batch_tokens": 30}}))
    assert "\n" not in str(exc.value) and not out.exists()


# ---- 2 processes ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_gloo_processes_with_a_token_budget_match_one_padded(sp, varied, base, tmp_path):
    """2 processes, padding-free, 8 pairs each cut by a 160-token budget (each rank its own cut,
    then the count both agree on) against 1 process × 2 padded micro-batches of 8: the same
    losses, step by step, and held-out figures."""
    ranks = [PreferenceLoader(varied, sp, 8, 64, seed=1337, rank=r, world_size=2) for r in (0, 1)]
    cuts = [[len(budget_slices(8, 8, 160, packed_cost(ld.side_lengths(ld.next_batch()["pair_index"].numpy()))))
             for ld in ranks] for _ in range(4)]
    assert any(a != b for a, b in cuts)  # some step's ranks cut differently and must agree
    one = tmp_path / "one"
    run_dpo(tiny_cfg(DPOConfig, varied, base, one, lr=1e-3, max_steps=4, eval_every=2, ckpt_every=4))
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "train_dpo.py"),
           *cli_flags(varied, base, out, lr=1e-3, max_steps=4, eval_every=2, ckpt_every=4),
           "--batch.padding_free", "true", "--batch.micro_batch_tokens", "160"]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = {r["step"]: r for r in read_metrics(one / "metrics.jsonl") if "loss" in r}
    b = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
    print(f"dpo, 1 process padded vs 2 processes padding-free by tokens: max |loss diff| {diff:.3g}")
    assert diff < 1e-5
    va = [r["val_loss"] for r in read_metrics(one / "metrics.jsonl") if "val_loss" in r]
    vb = [r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert va == pytest.approx(vb, abs=1e-5)


def test_the_benchmark_runs_both_paths_and_checks_them(tmp_path):
    """benchmarks/padding_free.py --tiny: both forwards timed, fewer tokens packed, the values equal."""
    import subprocess

    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "padding_free.py"), "--tiny", "--device", "cpu",
                           "--steps", "1", "--warmup", "0", "--seq", "64", "--rows", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = json.loads(out.read_text())
    for name in ("dpo", "rl"):
        t = table[name]
        assert t["real_tokens"] <= t["tokens_packed"] < t["tokens_padded"] and t["max_rel_diff"] < 1e-5


def test_grpo_runs_padding_free_by_tokens_as_padded(base, prompts, tmp_path):
    """run_grpo end to end: 2 steps (μ 2, a KL) padding-free, at most 8 completions cut by a
    64-token budget, give the losses and KL of the padded run's micro-batches of 2 (the same
    rollouts: generation does not depend on the batching)."""
    records = {}
    for name, batch in (("padded", {}), ("packed", {"padding_free": True, "micro_batch_tokens": 64,
                                                     "micro_completions": 8})):
        cfg = config_dict(prompts, base, tmp_path / name, micro_completions=2, max_steps=2, num_iterations=2,
                          beta=0.1)
        run_grpo(from_dict(GRPOConfig, {**cfg, "batch": {**cfg["batch"], **batch}}))
        records[name] = {r["step"]: r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r}
    a, b = records["padded"], records["packed"]
    assert sorted(a) == sorted(b) == [1, 2]
    for s in a:
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], abs=1e-6) and b[s]["targets"] == a[s]["targets"]
        assert b[s]["kl"] == pytest.approx(a[s]["kl"], rel=1e-5)
