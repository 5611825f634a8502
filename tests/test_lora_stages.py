"""Each post-training stage learns with LoRA adapters (seeded toys): SFT lowers the held-out loss,
the reward model (its score head in full) and DPO learn the preference, PPO (its value head in
full) and GRPO train; stages chain LoRA and full runs in any order, each starting from the
merged weights of the one before."""

import dataclasses
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from grpo_fixtures import config_dict as grpo_dict
from grpo_fixtures import data as prompts  # noqa: F401 (a fixture)
from ppo_fixtures import config_dict as ppo_dict
from preference_train_fixtures import cli_flags, tiny_cfg, write_pairs
from proc import free_port, run_group, run_until
from safetensors.torch import load_file
from test_sft_train import base, sft_file  # noqa: F401 (fixtures)
from test_sft_train import tiny_cfg as sft_cfg

from sprout.checkpoint import read_meta
from sprout.config import from_dict
from sprout.engine.metrics import read_metrics
from sprout.engine.configs import LoraConfig
from sprout.model.heads import PolicyWithValue, RewardModel
from sprout.model.load import load_model
from sprout.lora_weights import merge_adapters
from sprout.stages.dpo import DPOConfig, run_dpo
from sprout.stages.grpo import GRPOConfig, run_grpo
from sprout.stages.ppo import PPOConfig, run_ppo
from sprout.stages.reward import RewardConfig, run_reward
from sprout.stages.sft import run_sft

ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 8, "alpha": 16.0}


def with_lora(cfg):
    return dataclasses.replace(cfg, lora=LoraConfig(**LORA))


def saved_names(out: Path) -> set[str]:
    return set(load_file(Path(read_meta(out / "checkpoints")["path"]) / "model.safetensors"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("prefs"))


@pytest.fixture(scope="module")
def sft_lora(sft_file, base, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_lora")
    return out, run_sft(with_lora(sft_cfg(sft_file, base, out, lr=1e-2)))


def test_sft_with_lora_lowers_the_held_out_loss(sft_lora):
    out, result = sft_lora
    first, last = result["first_eval"], result["last_eval"]
    print(f"SFT LoRA val loss {first['val_loss']:.3f} -> {last['val_loss']:.3f}")
    assert last["val_loss"] < first["val_loss"] - 0.5
    assert saved_names(out) and all(".lora_" in k for k in saved_names(out))
    assert type(load_model(out)[0]).__name__ == "Transformer"


def test_dpo_with_lora_from_a_lora_sft_run_learns_against_the_sft_policy(sft_lora, base, pairs, tmp_path):
    """The SFT run's adapters are merged into the weights DPO starts from, which are also its
    reference (the policy with its own adapters off): the first margins are exactly 0."""
    sft_out, _ = sft_lora
    result = run_dpo(with_lora(tiny_cfg(DPOConfig, pairs, sft_out, tmp_path / "dpo", lr=1e-2)))
    first, last = result["first_eval"], result["last_eval"]
    print(f"DPO LoRA val accuracy {first['val_rewards/accuracies']:.3f} -> {last['val_rewards/accuracies']:.3f}")
    assert first["val_rewards/margins"] == 0.0
    assert last["val_rewards/accuracies"] > 0.6 and last["val_rewards/margins"] > 0.1
    meta = read_meta(tmp_path / "dpo" / "checkpoints")
    assert meta["frozen_models"]["base"]["path"] == meta["init"]["path"] == read_meta(sft_out)["path"]
    # read back through both LoRA runs to the base of SFT: each run's adapters merged in turn
    weights = {k: v for k, v in load_file(Path(read_meta(base)["path"]) / "model.safetensors").items()}
    for run in (sft_out, tmp_path / "dpo"):
        weights = merge_adapters(weights, load_file(Path(read_meta(run)["path"]) / "model.safetensors"), 2.0)
    policy, _ = load_model(tmp_path / "dpo")
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in weights.items())
    # and a full run starts from it
    full = run_dpo(tiny_cfg(DPOConfig, pairs, tmp_path / "dpo", tmp_path / "full", max_steps=1, eval_every=0))
    assert full["first_eval"]["val_rewards/margins"] == 0.0 and "lora" not in read_meta(tmp_path / "full")


def test_reward_model_with_lora_learns_the_preference_with_its_head_in_full(base, pairs, tmp_path):
    result = run_reward(with_lora(tiny_cfg(RewardConfig, pairs, base, tmp_path / "rm", lr=1e-2)))
    first, last = result["first_eval"], result["last_eval"]
    print(f"reward LoRA val accuracy {first['val_accuracy']:.3f} -> {last['val_accuracy']:.3f}")
    assert last["val_accuracy"] >= 0.8 and last["val_accuracy"] > first["val_accuracy"]
    names = saved_names(tmp_path / "rm")
    assert "score_head.weight" in names and all(".lora_" in k for k in names - {"score_head.weight"})
    assert isinstance(load_model(tmp_path / "rm")[0], RewardModel)


def test_ppo_with_lora_trains_its_value_head_in_full_and_grpo_follows_it(base, prompts, tmp_path):
    cfg = ppo_dict(prompts, base, tmp_path / "ppo", max_steps=2)
    run_ppo(from_dict(PPOConfig, {**cfg, "lora": LORA}))
    names = saved_names(tmp_path / "ppo")
    assert "value_head.weight" in names and all(".lora_" in k for k in names - {"value_head.weight"})
    meta = read_meta(tmp_path / "ppo" / "checkpoints")
    assert meta["architecture"] == "lm+value" and set(meta["frozen_models"]) == {"reference", "base"}
    assert isinstance(load_model(tmp_path / "ppo")[0], PolicyWithValue)
    # GRPO with LoRA from the LoRA PPO policy: the value head is left out of the merged start
    run_grpo(from_dict(GRPOConfig, {**grpo_dict(prompts, tmp_path / "ppo", tmp_path / "grpo", max_steps=1,
                                                beta=0.1), "lora": LORA}))
    assert read_meta(tmp_path / "grpo" / "checkpoints")["frozen_models"]["base"]["path"] == meta["path"]
    assert type(load_model(tmp_path / "grpo")[0]).__name__ == "Transformer"


# ---- 2 processes ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("launch", ["cpu_ddp.yaml", "cpu_fsdp.yaml"])
def test_lora_on_two_processes_matches_one(launch, base, pairs, tmp_path):
    """DPO with LoRA and its live reference (the adapters off), 2 gloo processes × 1 micro-batch
    of 8 pairs against 1 process × 2 (DDP, and FSDP2 sharding base and adapters alike)."""
    one = tmp_path / "one"
    run_dpo(with_lora(tiny_cfg(DPOConfig, pairs, base, one, lr=1e-2, max_steps=4, eval_every=0, ckpt_every=0)))
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / launch), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "train_dpo.py"),
           *cli_flags(pairs, base, two, lr=1e-2, max_steps=4, eval_every=0, ckpt_every=0),
           "--lora.r", str(LORA["r"]), "--lora.alpha", str(LORA["alpha"])]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) × 1 micro-steps" in proc.stdout and "LoRA adapters off" in proc.stdout
    a, b = records(one), records(two)
    for s in range(1, 5):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], abs=1e-5)
    wa, wb = load_file(final(one)), load_file(final(two))
    assert set(wa) == set(wb) and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def final(out: Path) -> Path:
    return Path(read_meta(out / "checkpoints")["path"]) / "model.safetensors"


@pytest.mark.slow
def test_fsdp_bf16_with_the_reference_first_trains(base, pairs, tmp_path):
    """FSDP2 in bf16 whose first forward is the reference (DPO's precomputed log-probs): the
    adapters' gradient dtypes are fixed at that forward, so turning the adapters off must not
    change which parameters require gradients."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_fsdp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "train_dpo.py"),
           *cli_flags(pairs, base, out, lr=1e-2, max_steps=2, eval_every=0, ckpt_every=0),
           "--lora.r", "4", "--train.mixed_precision", "bf16", "--dpo.precompute_ref_logps", "true"]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(math.isfinite(r["loss"]) for r in records(out).values()) and sorted(records(out)) == [1, 2]


# ---- resume and the reference of another checkpoint --------------------------------------------------------------
def test_lora_resumes_bit_for_bit_in_dpo_and_in_ppo_with_its_value_head(base, pairs, prompts, tmp_path):
    """DPO (12 steps, checkpoint at 6) and PPO (4 steps, a checkpoint each, its value head in a
    parameter group of its own): resumed at the middle, every figure and tensor as uninterrupted."""
    from preference_train_fixtures import resume_folder

    dpo_a = tmp_path / "dpo_a"
    run_dpo(with_lora(tiny_cfg(DPOConfig, pairs, base, dpo_a, lr=1e-2)))
    dpo_b = resume_folder(dpo_a, 6, tmp_path / "dpo_b")
    run_dpo(with_lora(tiny_cfg(DPOConfig, pairs, base, dpo_b, lr=1e-2)), resume="latest")
    ppo = {**ppo_dict(prompts, base, tmp_path / "ppo_a", max_steps=4, ckpt_every=1, keep_checkpoints=10), "lora": LORA}
    run_ppo(from_dict(PPOConfig, ppo))
    ppo_b = resume_folder(tmp_path / "ppo_a", 2, tmp_path / "ppo_b")
    run_ppo(from_dict(PPOConfig, {**ppo, "out": str(ppo_b)}), resume="latest")
    for a, b, first in ((dpo_a, dpo_b, 7), (tmp_path / "ppo_a", ppo_b, 3)):
        ra, rb = records(a), records(b)
        assert sorted(rb)[0] == first and all(rb[s]["loss"] == ra[s]["loss"] for s in rb)
        wa, wb = load_file(final(a)), load_file(final(b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_sigterm_stops_a_lora_run_with_a_checkpoint_that_resumes_bit_for_bit(base, pairs, tmp_path):
    """DPO with adapters as its CLI runs it: SIGTERM after step 1 of 12 stops it with a checkpoint
    (exit 143), and `--resume` ends as a run never stopped: every loss and every saved tensor."""
    ref = tmp_path / "ref"
    run_dpo(with_lora(tiny_cfg(DPOConfig, pairs, base, ref, lr=1e-2)))
    out = tmp_path / "run"
    script = ROOT / "scripts" / "train_dpo.py"
    lora = [a for k, v in LORA.items() for a in (f"--lora.{k}", str(v))]
    proc, _ = run_until([sys.executable, script, *cli_flags(pairs, base, out, lr=1e-2), *lora], "step 1/12")
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "SIGTERM: stopping after this step with a checkpoint" in proc.stderr
    stopped = max(records(out))
    assert 1 <= stopped < 12 and (out / "checkpoints" / f"step_{stopped:08d}").is_dir()
    again = run_group([sys.executable, str(script), "--out", str(out), "--resume"], timeout=300, cwd=ROOT,
                      env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    ra, rb = records(ref), records(out)
    assert sorted(rb) == sorted(ra) and all(rb[s]["loss"] == ra[s]["loss"] for s in ra)
    wa, wb = load_file(final(ref)), load_file(final(out))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dpo_with_lora_and_another_reference_keeps_a_frozen_copy_of_it(base, pairs, sp, tmp_path):
    from preference_train_fixtures import write_lm

    other = write_lm(tmp_path / "other" / "ckpt", sp, seed=3)
    cfg = with_lora(tiny_cfg(DPOConfig, pairs, base, tmp_path / "dpo", lr=1e-2, max_steps=1, eval_every=0))
    result = run_dpo(dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, ref=str(other))))
    assert result["first_eval"]["val_rewards/margins"] != 0.0  # the reference is not the policy's base
    meta = read_meta(tmp_path / "dpo" / "checkpoints")
    assert meta["frozen_models"]["reference"]["path"] == read_meta(other)["path"] != meta["frozen_models"]["base"]["path"]


@pytest.mark.slow
def test_lora_under_torch_compile_matches_eager(base, pairs, tmp_path):
    """train.compile with peft's layers in the graph, the reference (adapters off) through the same
    compiled module: DPO's losses as eager."""
    runs = {}
    for compile_ in (False, True):
        cfg = with_lora(tiny_cfg(DPOConfig, pairs, base, tmp_path / str(compile_), lr=1e-2, max_steps=3, eval_every=0,
                                 ckpt_every=0))
        run_dpo(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=compile_)))
        runs[compile_] = records(tmp_path / str(compile_))
    assert sorted(runs[True]) == [1, 2, 3]
    assert max(abs(runs[True][s]["loss"] - runs[False][s]["loss"]) for s in runs[False]) < 1e-5
