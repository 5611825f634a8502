"""The LoRA benchmarks' own checks, at toy size and without timing: benchmarks/rl_throughput.py's
LoRA model decodes the tokens of its merged plain model and its random lora_B changes them (and
both decode step by step in turns), and
benchmarks/lora_memory.py runs end to end (--tiny) with its full fine-tuning estimate as its
module doc states it, and its GRPO part's three runs sample alike and LoRA's gradient is the same
with gradient checkpointing."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sprout.model.generate import generate_tokens, pad_prompts
from sprout.model.lora import adapters_disabled
from sprout.model.transformer import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import lora_memory  # noqa: E402
import rl_throughput  # noqa: E402


def test_lora_rollout_models_decode_the_merged_models_tokens():
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=48)
    adapted, merged, scale = rl_throughput.lora_models(cfg, 4)
    assert scale == 2.0
    ids, mask = pad_prompts([[5, 6, 7, 8], [9, 10]])
    greedy = [generate_tokens(m, ids, mask, max_new_tokens=24, greedy=True).completion_ids for m in (adapted, merged)]
    assert torch.equal(greedy[0], greedy[1])
    with adapters_disabled(adapted):
        off = generate_tokens(adapted, ids, mask, max_new_tokens=24, greedy=True).completion_ids
    assert not torch.equal(off, greedy[0])
    steps = rl_throughput.interleaved_steps({"plain": merged, "lora": adapted}, ids, mask, 2, 5)
    assert {k: len(v) for k, v in steps.items()} == {"plain": 5, "lora": 5}


def test_full_fine_tuning_estimate_per_phase():
    """Resident + 12 B/param where the phase has gradients, 8 where not, + 4 B/param for a reference
    copy, + the phase's working memory; the largest phase."""
    n = 1000
    run = {"params": n, "stage": "grpo", "resident_kib": 100,
           "phase_peak_kib": {"rollout": 110, "reference log-probs": 101, "update": 102}}
    rollout, update = 100 * 1024 + 8 * n + 4 * n + 10 * 1024, 100 * 1024 + 12 * n + 4 * n + 2 * 1024
    assert lora_memory.full_estimate(run) == (max(rollout, update), "rollout")
    sft = {**run, "stage": "sft", "phase_peak_kib": {"step": 103}}
    assert lora_memory.full_estimate(sft) == (100 * 1024 + 12 * n + 3 * 1024, "step")


@pytest.mark.slow
def test_lora_memory_runs_at_toy_size():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_memory.py"), "--tiny", "--warmup", "0",
                           "--steps", "1", "--a-seq", "16", "--a-pairs", "2", "--b-seq", "24", "--b-prompt-length",
                           "8", "--parts", "a,b,c", "--c-prompts", "4", "--c-prompt-length", "8", "--c-new-tokens", "8",
                           "--c-micro", "16"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ab, c = proc.stdout.split("\n## c. ")
    rows = {line.split("|")[1].strip(): line for line in ab.splitlines() if line.startswith("| ")}
    assert {"full", "LoRA r 16", "LoRA / full", "SFT", "DPO", "GRPO"} <= set(rows)
    trained = {k: int(rows[k].split("|")[3].strip().replace(",", "")) for k in ("full", "LoRA r 16")}
    assert 0 < trained["LoRA r 16"] < trained["full"]
    # LoRA's DPO starts with its reference equal to the policy: the first loss is ln 2
    assert rows["LoRA r 16"].split("|")[7].strip().startswith("0.6931")
    # part c: GRPO full, LoRA and LoRA with gradient checkpointing. LoRA starts as the full model (lora_B = 0), so
    # the first rollout samples the same tokens; checkpointing recomputes the same forward, so LoRA's gradient norm
    # is the same with it and without
    assert {"full", "LoRA r 16", "LoRA r 16, gradient checkpointing"} == {
        line.split("|")[1].strip() for line in c.splitlines() if line.startswith("| ") and "---" not in line} - {"GRPO"}
    checks = dict(line.strip().split(": ") for line in c.split("gradient norms per step")[1].splitlines()[1:4])
    digest = {k: v.split("; ")[0] for k, v in checks.items()}
    norms = {k: float(v.split("; ")[1]) for k, v in checks.items()}
    assert digest["full"] == digest["LoRA r 16"] == digest["LoRA r 16, gradient checkpointing"], digest
    assert norms["LoRA r 16, gradient checkpointing"] == pytest.approx(norms["LoRA r 16"], rel=1e-5), norms
    assert norms["LoRA r 16"] != pytest.approx(norms["full"], rel=1e-3), norms  # adapters only: another gradient
