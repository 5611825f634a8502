"""The GRPO stage: every loss_type's normaliser is exact under accumulation (and 2 processes, slow),
old log-probs equal a recompute, dynamic sampling refills, beta = 0 builds no reference, exact
resume at a rollout boundary and inside a buffer, and the mean reward rises under RL."""

import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from grpo_fixtures import config_dict, data, run_per_prompt, tiny_cfg, write_sft_lm  # noqa: F401
from preference_train_fixtures import base, resume_folder, write_lm  # noqa: F401 (base, data: fixtures)
from proc import free_port, run_group
from safetensors.torch import load_file

from sprout.checkpoint import read_meta
from sprout.config import from_dict, load_config
from sprout.config_help import config_help
from sprout.errors import SproutError
from sprout.model.load import load_model
from sprout.rl.advantages import batch_normalize, group_advantages, normalize_then_sum
from sprout.stages.grpo import GRPOConfig, GRPOLossConfig, GRPOStage, run_grpo
from sprout.engine.trainer import Trainer
from sprout.engine.metrics import read_metrics
from data_loader.prompt_batches import PromptLoader
from sprout.stages.rl_rewards import RewardsConfig, build_rewards
from sprout.stages.rl_stage import PromptBatchConfig, RolloutConfig, completion_logps

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sft_base(sp, tmp_path_factory):
    """The tiny LM briefly taught to answer `<answer>N</answer>` (~15 s): some completions stop,
    some are truncated, about half the answers are single digits."""
    return write_sft_lm(tmp_path_factory.mktemp("sft") / "ckpt", sp, steps=40)


def train_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(read_meta(out / "checkpoints")["path"] + "/model.safetensors"))


def make_stage(sp, base, data, *, rollout=None, batch=None, rewards=("grpo_fixtures:digit_share",), **grpo):
    """A GRPOStage on one process with the init model as its policy (no Trainer)."""
    model, _ = load_model(base)
    acc = Accelerator(cpu=True)
    batch = batch or PromptBatchConfig(global_prompts=2, num_generations=4, micro_completions=4)
    rollout = rollout or RolloutConfig(max_completion_length=12)
    loader = PromptLoader(data, sp, 24, batch.global_prompts, seed=0)
    val = PromptLoader(data.with_name("prompts_dev.jsonl"), sp, 24, 1, shuffle=False)
    stage = GRPOStage(acc, sp, loader, val, batch, rollout,
                      build_rewards(RewardsConfig(reward_funcs=list(rewards)), rollout.max_completion_length),
                      grpo=GRPOLossConfig(**grpo), seed=0)
    stage.setup(SimpleNamespace(generation_model=model, sharded=False, prepare_frozen=lambda m: m))
    return stage, model


# ---- normalisers ----------------------------------------------------------------------------------------------
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
LOSS_OPTIONS = {"cispo": {"epsilon_high": 1.1}}  # cispo's cap on the weight, low enough to bind at step 2
TWO_REWARDS = {"reward_funcs": ["grpo_fixtures:digit_share", "grpo_fixtures:single_digit"],
               "reward_weights": [1.0, 0.5]}
# batch-wide advantage normalisers (over the gathered global batch): TRL's RLOO (summed sequence ratio,
# loss per sequence) with normalize_advantages, and normalize_then_sum over two reward functions
OPTIONS = {"": {}, "rloo_normalized": {"advantage": "rloo", "normalize_advantages": True},
           "normalize_then_sum": {"multi_objective_aggregation": "normalize_then_sum", **TWO_REWARDS}}
# (loss_type, num_iterations, options): with 1 the loss's own log-probs are the old ones (no old-logprob
# forward); beta 0.1 with the default use_bias_correction_kl: the KL × the importance ratio in every case
CASES = [(t, 2, "") for t in LOSS_TYPES] + [("dapo", 1, ""), ("grpo", 2, "rloo_normalized"),
                                             ("dapo", 2, "normalize_then_sum")]


def case_cfg(data, init, out, loss_type, mu, options, micro_completions):
    return config_dict(data, init, out, loss_type=loss_type, micro_completions=micro_completions, max_steps=2,
                       num_iterations=mu, beta=0.1, mask_truncated_completions=True,
                       **LOSS_OPTIONS.get(loss_type, {}), **OPTIONS[options])


@pytest.fixture(scope="module")
def one_by_one(sft_base, data, tmp_path_factory):
    """Per case: 2 steps of 1 process × 1 micro-batch of 8 completions (per-prompt sampling)."""
    outs = {}
    for case in CASES:
        out = tmp_path_factory.mktemp("one_" + "_".join(map(str, case)).strip("_"))
        run_per_prompt(from_dict(GRPOConfig, case_cfg(data, sft_base, out, *case, micro_completions=8)))
        outs[case] = out
    return outs


@pytest.mark.parametrize("loss_type, mu, options", CASES)
def test_normaliser_is_exact_under_accumulation(loss_type, mu, options, one_by_one, sft_base, data, tmp_path):
    """1 process × 4 micro-batches of 2 completions == 1 process × 1 of 8: losses and weights."""
    out = tmp_path / "four"
    run_per_prompt(from_dict(GRPOConfig, case_cfg(data, sft_base, out, loss_type, mu, options, micro_completions=2)))
    a, b = train_records(one_by_one[loss_type, mu, options]), train_records(out)
    assert a[1]["targets"] == b[1]["targets"]
    for s in (1, 2):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], abs=1e-5)
        assert b[s]["kl"] == pytest.approx(a[s]["kl"], rel=1e-5)  # fp32 log-probs of 2-row vs 8-row forwards
        assert b[s]["sampling/logp_diff_mean"] == pytest.approx(a[s]["sampling/logp_diff_mean"], abs=1e-6)
        assert b[s]["sampling/logp_diff_max"] == pytest.approx(a[s]["sampling/logp_diff_max"], abs=1e-5)
    assert a[2]["kl"] > 0 and a[2]["loss"] != 0  # the second step trains on moved weights
    wa, wb = final_weights(one_by_one[loss_type, mu, options]), final_weights(out)
    # 1 % of one AdamW step (lr 3e-3): Adam divides by sqrt(v), so the summation order's rounding
    # of a near-zero gradient can move a weight by ~1e-5; a wrong normaliser reweights whole
    # micro-batches and moves weights by a sizeable part of a step
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 3e-5


def test_denominators_follow_the_loss_type(sp, sft_base, data):
    """count_targets: grpo/sapo sequences, bnpo/dapo/cispo completion tokens (truncated ones left
    out), dr_grpo sequences × max_completion_length."""
    counts = {}
    for loss_type in LOSS_TYPES:
        stage, _ = make_stage(sp, sft_base, data, loss_type=loss_type, mask_truncated_completions=True,
                              **LOSS_OPTIONS.get(loss_type, {}))
        batches = stage.next_micro_batches(0)
        counts[loss_type] = sum(int(stage.count_targets(b)) for b in batches)
        kept = sum(int((b["completion_mask"] * ~b["truncated"][:, None]).sum()) for b in batches)
        every = sum(int(b["completion_mask"].sum()) for b in batches)
    assert counts["grpo"] == counts["sapo"] == 8 and counts["dr_grpo"] == 8 * 12
    assert 0 < counts["bnpo"] == counts["dapo"] == counts["cispo"] == kept < every  # truncated completions left out


@pytest.fixture(scope="module")
def two_by_two(sft_base, data, tmp_path_factory):
    """Per case: 2 steps of 2 gloo processes × 2 micro-batches of 2 completions, every case a run
    of its own, in turn, in one `accelerate launch` (the launch and imports paid once); returns
    ({case: run folder}, the launch's stdout). A case that fails stops the ones after it, and every
    case's test then shows this fixture's error."""
    root = tmp_path_factory.mktemp("two_by_two")
    outs, cfgs = {}, []
    for case in CASES:
        name = "_".join(map(str, case)).strip("_")
        outs[case] = root / name
        cfgs.append(root / f"{name}.json")
        cfgs[-1].write_text(json.dumps(case_cfg(data, sft_base, outs[case], *case, micro_completions=2)))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "tests" / "grpo_fixtures.py"), *map(str, cfgs)]
    proc = run_group(cmd, timeout=600, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return outs, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, mu, options", CASES)
def test_two_processes_match_one(loss_type, mu, options, one_by_one, two_by_two):
    """2 gloo processes × 2 micro-batches of 2 completions == 1 process × 1 of 8."""
    outs, stdout = two_by_two
    out = outs[loss_type, mu, options]
    assert stdout.count("2 process(es) × 2 micro-steps") == len(CASES)
    assert "- 2 process(es);" in (out / "report.md").read_text()  # this run's own report
    a, b = train_records(one_by_one[loss_type, mu, options]), train_records(out)
    for s in (1, 2):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], abs=1e-5)
        assert b[s]["reward"] == pytest.approx(a[s]["reward"], abs=1e-9)
        assert b[s]["sampling/logp_diff_max"] == pytest.approx(a[s]["sampling/logp_diff_max"], abs=1e-5)
    wa, wb = final_weights(one_by_one[loss_type, mu, options]), final_weights(out)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 3e-5  # as under accumulation above


# ---- the buffer -----------------------------------------------------------------------------------------------
def test_old_logps_equal_a_recompute_at_temperature_1(sp, base, data):
    stage, model = make_stage(sp, base, data, num_iterations=2)  # a buffer of 2 steps: old log-probs stored
    batches = stage.next_micro_batches(0)
    buf = stage.buffer
    mask = buf["completion_mask"].bool()
    assert (buf["old_logps"] - buf["sampler_logps"]).abs()[mask].max() < 1e-5  # the sampler's distribution
    with torch.no_grad():
        again, _ = completion_logps(model, buf)  # the whole buffer at once, untrimmed
    assert (again - buf["old_logps"]).abs()[mask].max() < 1e-5
    logged = dict(zip(buf["stat_names"], buf["stats"].tolist()))
    assert logged["sampling/logp_diff_max"][0] < 1e-5
    assert len(batches) == 2 and stage.generated_tokens == int(mask.sum())


def test_top_k_sampling_recomputes_the_policy_logps(sp, base, data):
    """With top-k the sampler's log-probs are those of the truncated distribution: the old
    log-probs are the policy's (the recompute), and the difference is logged."""
    stage, model = make_stage(sp, base, data, rollout=RolloutConfig(max_completion_length=12, top_k=5),
                              num_iterations=2)
    stage.next_micro_batches(0)
    buf = stage.buffer
    mask = buf["completion_mask"].bool()
    with torch.no_grad():
        again, _ = completion_logps(model, buf)
    assert (again - buf["old_logps"]).abs()[mask].max() < 1e-5
    assert (buf["old_logps"] - buf["sampler_logps"])[mask].max() < -1e-3  # top-k renormalised: sampler's higher
    logged = dict(zip(buf["stat_names"], buf["stats"].tolist()))
    assert logged["sampling/logp_diff_mean"][0] / logged["sampling/logp_diff_mean"][1] > 1e-3


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_one_step_per_buffer_takes_old_logps_from_the_loss_with_the_same_gradient(loss_type, sp, base, data):
    """num_iterations 1: no old-logprob forward; the loss's detached log-probs stand in (ratio 1),
    and loss, gradient and sampling/logp_diff_mean equal those with the recomputed old log-probs."""
    stage, model = make_stage(sp, base, data, loss_type=loss_type)
    assert stage.old_from_loss
    batches = stage.next_micro_batches(0)
    assert "old_logps" not in stage.buffer and "sampling/logp_diff_mean" not in stage.buffer["stat_names"]
    runs = []
    for recompute in (False, True):
        model.zero_grad()
        total, metrics = 0.0, []
        for b in batches:
            if recompute:
                with torch.no_grad():
                    b = {**b, "old_logps": completion_logps(model, b)[0] * b["completion_mask"]}
            loss_sum, n, m = stage.loss(model, b)
            loss_sum.backward()
            total, metrics = total + float(loss_sum.detach()), metrics + [m]
        runs.append((total, [p.grad.clone() for p in model.parameters() if p.grad is not None], metrics))
    (a, ga, ma), (b, gb, mb) = runs
    assert a == pytest.approx(b, abs=1e-6) and len(ga) == len(gb) > 0
    assert max((x - y).abs().max().item() for x, y in zip(ga, gb)) < 1e-6
    assert all("sampling/logp_diff_mean" in m for m in ma) and not any("sampling/logp_diff_mean" in m for m in mb)
    total, count = (sum(float(m["sampling/logp_diff_mean"][i]) for m in ma) for i in (0, 1))
    assert count == int(stage.buffer["completion_mask"].sum()) and total / count < 1e-5  # temperature 1
    assert 0 <= stage.derived_metrics({})["sampling/logp_diff_max"] < 1e-5
    assert stage.step_logp_diff_max == 0.0  # reset for the next step


def test_dynamic_sampling_refills_with_informative_groups(sp, base, data):
    stage, _ = make_stage(sp, base, data, rewards=("grpo_fixtures:parity",), dynamic_sampling=True,
                          max_generation_rounds=8)
    stage.next_micro_batches(0)
    buf = stage.buffer
    rewards_std = buf["advantages"].view(-1, 4).abs().sum(1)
    assert (rewards_std > 0).all()  # every kept group has rewards that differ
    logged = {k: s / c for k, (s, c) in zip(buf["stat_names"], buf["stats"].tolist())}
    assert logged["dynamic_sampling/rounds"] >= 2 and logged["dynamic_sampling/short_batches"] == 0
    assert 0 < logged["frac_reward_zero_std"] < 1
    assert stage.loader.step == logged["dynamic_sampling/rounds"]  # one global batch of prompts per round


def test_dynamic_sampling_counts_a_short_batch(sp, base, data):
    stage, _ = make_stage(sp, base, data, rewards=("grpo_fixtures:constant",), dynamic_sampling=True,
                          max_generation_rounds=2)
    batches = stage.next_micro_batches(0)
    logged = {k: s / c for k, (s, c) in zip(stage.buffer["stat_names"], stage.buffer["stats"].tolist())}
    assert logged["dynamic_sampling/rounds"] == 2 and logged["dynamic_sampling/short_batches"] == 1
    assert logged["frac_reward_zero_std"] == 1.0
    assert sum(b["completion_ids"].shape[0] for b in batches) == 8 and (stage.buffer["advantages"] == 0).all()


# ---- the reference --------------------------------------------------------------------------------------------
def test_bias_correction_kl_keeps_the_loss_and_changes_the_gradient_on_policy(sp, base, data):
    """beta > 0, num_iterations 1: the ratio is 1, so the loss and the logged kl are the same with
    and without use_bias_correction_kl, but the ratio's gradient adds KL × grad log pi."""
    stage, model = make_stage(sp, base, data, beta=0.5)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a reference away from the policy: KL > 0
    stage.ref_model = ref
    batch = stage.next_micro_batches(0)[0]
    assert stage.old_from_loss and "ref_logps" in batch
    runs = []
    for corrected in (True, False):  # TRL's default first
        stage.cfg.use_bias_correction_kl = corrected
        model.zero_grad()
        loss_sum, _, metrics = stage.loss(model, batch)
        loss_sum.backward()
        runs.append((loss_sum.item(), float(metrics["kl"][0]), model.lm_head.weight.grad.clone()))
    (a, kl_a, ga), (b, kl_b, gb) = runs
    assert a == pytest.approx(b, rel=1e-6) and kl_a == pytest.approx(kl_b, rel=1e-6) and kl_a > 0
    assert (ga - gb).abs().max() > 1e-4 * ga.abs().max()

def test_beta_zero_builds_no_reference(base, data, tmp_path, monkeypatch):
    calls = []
    original = Trainer.prepare_frozen
    monkeypatch.setattr(Trainer, "prepare_frozen", lambda self, m: calls.append(m) or original(self, m))
    result = run_grpo(tiny_cfg(data, base, tmp_path / "b0", beta=0.0, max_steps=1))
    assert {"val_pass@1", "val_pass@4", "val_greedy/accuracy", "val_accuracy", "val_format",
            "val_mean_length"} <= set(result["last_eval"])
    assert calls == [] and "reference" not in read_meta(tmp_path / "b0" / "checkpoints")["frozen_models"]
    rec = train_records(tmp_path / "b0")[1]
    assert "kl" not in rec and "entropy" in rec and "rewards/digit_share/mean" in rec
    run_grpo(tiny_cfg(data, base, tmp_path / "b1", beta=0.1, max_steps=1))
    assert len(calls) == 1 and "reference" in read_meta(tmp_path / "b1" / "checkpoints")["frozen_models"]


# ---- resume ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_a(base, data, tmp_path_factory):
    """6 steps, μ = 2 (a new buffer at steps 1, 3, 5), a checkpoint after every step, KL in the reward."""
    out = tmp_path_factory.mktemp("grpo_a")
    run_grpo(tiny_cfg(data, base, out, max_steps=6, num_iterations=2, ckpt_every=1, keep_checkpoints=10,
                      beta=0.05, kl_in="reward", eval_every=3))
    return out


@pytest.mark.parametrize("step", [3, 4], ids=["mid_buffer", "rollout_boundary"])
def test_resume_matches_an_uninterrupted_run_bit_for_bit(step, run_a, base, data, tmp_path):
    out_b = resume_folder(run_a, step, tmp_path / "grpo_b")
    run_grpo(tiny_cfg(data, base, out_b, max_steps=6, num_iterations=2, ckpt_every=1, keep_checkpoints=10,
                      beta=0.05, kl_in="reward", eval_every=3), resume="latest")
    a, b = train_records(run_a), train_records(out_b)
    assert sorted(b) == list(range(step + 1, 7))
    keys = ("loss", "reward", "kl", "grad_norm", "completions/mean_length")
    assert [[b[s][k] for k in keys] for s in b] == [[a[s][k] for k in keys] for s in b]


def test_a_resume_against_another_reference_is_refused(run_a, base, data, sp, tmp_path):
    """With beta > 0 the reference (the init checkpoint, a path a resume may change) is recorded by
    its weights' sha256; a resume whose init is now another model is refused in one line."""
    assert read_meta(run_a / "checkpoints")["frozen_models"] == {
        "reference": {"path": read_meta(base)["path"], "weights_sha256": read_meta(base)["files"]["model.safetensors"]}}
    out_b = resume_folder(run_a, 3, tmp_path / "grpo_b")
    other = write_lm(tmp_path / "other" / "ckpt", sp, seed=5)
    with pytest.raises(SproutError, match=r"the run's reference was .*, now .*other/ckpt \(weights_sha256 .*"
                                          r"refusing to resume against another model"):
        run_grpo(tiny_cfg(data, other, out_b, max_steps=6, num_iterations=2, ckpt_every=1, keep_checkpoints=10,
                          beta=0.05, kl_in="reward", eval_every=3), resume="latest")


# ---- learning -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_mean_reward_rises_under_rl(sft_base, data, tmp_path):
    """The briefly taught model answers with a single digit about half the time; rewarding that
    (and nothing else) for 30 steps of RL (15 buffers, μ = 2) makes it the rule."""
    out = tmp_path / "learn"
    run_grpo(tiny_cfg(data, sft_base, out, reward_funcs=["grpo_fixtures:single_digit"], max_steps=30,
                      global_prompts=4, num_generations=8, micro_completions=32, num_iterations=2, loss_type="grpo",
                      lr=2e-3))
    rec = train_records(out)
    start = np.mean([rec[s]["reward"] for s in (1, 3, 5)])  # one step per buffer: 3 buffers each
    end = np.mean([rec[s]["reward"] for s in (26, 28, 30)])
    print(f"single-digit answers: {start:.3f} -> {end:.3f}")
    assert start < 0.7 and end > start + 0.2


# ---- refused options ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, pattern", [
    ({"micro_completions": 3}, r"not a multiple of batch.micro_completions 3"),
    ({"max_prompt_length": 60}, r"data.max_prompt_length 60 \+ rollout.max_completion_length 12 exceeds max_seq_len"),
    ({"reward_funcs": ["grpo_fixtures:nothing"]}, r"rewards.reward_funcs: cannot import 'grpo_fixtures:nothing'"),
    ({"loss_type": "cispo"}, r"grpo.epsilon_high: got None; expected a number with loss_type cispo"),
    ({"loss_type": "sapo", "delta": 2.0}, r"grpo.delta: got 2.0; expected null with loss_type sapo"),
])
def test_bad_options_are_refused_in_one_line(values, pattern, base, data, tmp_path):
    with pytest.raises(SproutError, match=pattern):
        run_grpo(tiny_cfg(data, base, tmp_path / "out", **values))


def test_scale_rewards_takes_trls_booleans(tmp_path):
    """TRL's scale_rewards true/false are group/none, in the config file and on the command line."""
    path = tmp_path / "grpo.yaml"
    path.write_text("grpo:\n  scale_rewards: true\n")
    assert load_config(GRPOConfig, path).grpo.scale_rewards == "group"
    assert load_config(GRPOConfig, path, ["--grpo.scale_rewards", "false"]).grpo.scale_rewards == "none"
    assert load_config(GRPOConfig, path, ["--grpo.scale_rewards", "batch"]).grpo.scale_rewards == "batch"
    with pytest.raises(SproutError, match=r"^command line: --grpo.scale_rewards: got 'global'; expected group, "
                                          r"batch, none, true or false or null$"):
        load_config(GRPOConfig, path, ["--grpo.scale_rewards", "global"])
    with pytest.raises(SproutError, match=r"grpo.yaml: grpo.scale_rewards: got True; expected none, false or null "
                                          r"with advantage dr_grpo"):
        load_config(GRPOConfig, path, ["--grpo.advantage", "dr_grpo"])


def test_rloo_takes_trls_summed_sequence_ratio_unless_told():
    assert GRPOLossConfig(advantage="rloo").importance_sampling_level == "sequence_sum"
    assert GRPOLossConfig().importance_sampling_level == "token"
    assert GRPOLossConfig(advantage="rloo", importance_sampling_level="token").importance_sampling_level == "token"
    assert GRPOLossConfig(importance_sampling_level="sequence").importance_sampling_level == "sequence"


@pytest.mark.parametrize("values, pattern", [
    ({"multi_objective_aggregation": "normalize_then_sum", "advantage": "rloo"},
     r"grpo.multi_objective_aggregation: got 'normalize_then_sum'; expected sum_then_normalize with advantage rloo"),
    ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "batch"},
     r"grpo.scale_rewards: got 'batch'; expected null with normalize_then_sum"),
    ({"multi_objective_aggregation": "normalize_then_sum", "beta": 0.1, "kl_in": "reward"},
     r"grpo.kl_in: got 'reward'; expected loss with normalize_then_sum"),
    ({"normalize_advantages": True, "advantage": "dr_grpo"},
     r"grpo.normalize_advantages: got True; expected false with advantage dr_grpo"),
])
def test_advantage_options_that_do_not_combine_are_refused(values, pattern, tmp_path):
    with pytest.raises(SproutError, match=pattern):
        from_dict(GRPOConfig, {"grpo": values}, "grpo.yaml")


def test_help_lists_the_advantage_options_by_trls_names():
    text = config_help(GRPOConfig)
    for line in ("--grpo.multi_objective_aggregation {sum_then_normalize, normalize_then_sum} = sum_then_normalize",
                 "--grpo.normalize_advantages        bool = false",
                 "--grpo.scale_rewards               {group, batch, none} | bool | null = null",
                 "--grpo.importance_sampling_level   {token, sequence, sequence_sum} | null"):
        assert line in text
    assert "TRL's true: group, false: none" in text


# ---- prompts --------------------------------------------------------------------------------------------------
def test_prompt_batches_are_seeded_disjoint_over_ranks_and_filtered(sp, data, tmp_path):
    """Two ranks' slices of a global batch are disjoint and together the 1-process batch; a resumed
    loader continues the order; long prompts and other sources are left out and counted."""
    one = PromptLoader(data, sp, 24, 4, seed=3)
    ranks = [PromptLoader(data, sp, 24, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(20):  # past an epoch (16 batches of 4)
        whole, parts = one.next_prompts(), [r.next_prompts() for r in ranks]
        assert list(whole) == list(parts[0]) + list(parts[1]) and not set(parts[0]) & set(parts[1])
    again = PromptLoader(data, sp, 24, 4, seed=3)
    again.load_state_dict(one.state_dict())
    assert list(again.next_prompts()) == list(one.next_prompts())
    assert one.epoch == 1 and list(one.order(0)) != list(one.order(1))
    with pytest.raises(SproutError, match="cannot resume: saved loader global_prompts=8 but this run has 4"):
        again.load_state_dict({**one.state_dict(), "global_prompts": 8})
    records = [json.loads(line) for line in data.read_text().splitlines()]
    mixed = tmp_path / "prompts.jsonl"
    mixed.write_text("".join(json.dumps({**r, "source": "other" if i % 4 == 0 else r["source"]}) + "\n"
                             for i, r in enumerate(records)))
    kept = PromptLoader(mixed, sp, 24, 1, sources=["arithmetic"])
    assert (kept.num_prompts, kept.other_sources) == (48, 16)
    short = PromptLoader(data, sp, 12, 1)
    assert short.dropped > 0 and short.num_prompts + short.dropped == 64


@pytest.mark.parametrize("advantage, scale", [("grpo", "batch"), ("rloo", None), ("dr_grpo", None)])
def test_buffer_advantages_are_the_group_advantages_of_its_rewards(advantage, scale, sp, sft_base, data):
    stage, _ = make_stage(sp, sft_base, data, advantage=advantage, scale_rewards=scale)
    seen = []
    score = stage.score
    stage.score = lambda rollout, idx: seen.append(score(rollout, idx)) or seen[-1]
    stage.next_micro_batches(0)
    totals = seen[0][0]
    want = group_advantages(totals, 4, advantage, scale).advantages.float()
    assert torch.allclose(stage.buffer["advantages"], want, atol=1e-6)
    assert totals.std() > 0  # not a trivial batch


@pytest.mark.parametrize("options", ["normalize_then_sum", "rloo_normalized"])
def test_buffer_advantages_of_the_batch_normalisers(options, sp, sft_base, data):
    """normalize_then_sum: each function normalised in its group, summed, normalised over the batch;
    rloo with normalize_advantages: the leave-one-out advantages normalised over the batch."""
    grpo = {k: v for k, v in OPTIONS[options].items() if k not in TWO_REWARDS}
    stage, _ = make_stage(sp, sft_base, data, rewards=TWO_REWARDS["reward_funcs"], **grpo)
    seen = []
    score = stage.score
    stage.score = lambda rollout, idx: seen.append(score(rollout, idx)) or seen[-1]
    stage.next_micro_batches(0)
    totals, per_fn = seen[0]
    if options == "normalize_then_sum":
        before = normalize_then_sum(per_fn, [1.0, 1.0], 4)
    else:
        before = group_advantages(totals, 4, "rloo").advantages
    want = batch_normalize(before, before).float()
    got = stage.buffer["advantages"]
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, before.float(), atol=1e-3)
    assert abs(got.mean().item()) < 1e-6 and got.std().item() == pytest.approx(1.0, abs=1e-3)


def test_entropy_bonus_lowers_the_loss_by_its_weighted_entropy(sp, sft_base, data):
    """loss(entropy_coef c) = loss(0) - c × the entropy aggregated like the loss (dapo: per token)."""
    stage, model = make_stage(sp, sft_base, data)
    batch = stage.next_micro_batches(0)[0]
    plain, n, metrics = stage.loss(model, batch)
    stage.cfg.entropy_coef = 0.1
    bonus, n2, _ = stage.loss(model, batch)
    bonus_value = bonus.detach().item()
    entropy_sum = metrics["entropy"][0]
    assert int(n) == int(n2) == int(batch["completion_mask"].sum())
    assert bonus_value == pytest.approx(plain.detach().item() - 0.1 * float(entropy_sum), abs=1e-4)
    bonus.backward()
    assert model.lm_head.weight.grad is not None
