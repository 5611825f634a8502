"""benchmarks/gpu_check.py is the one short check to run when a GPU is at hand: its CPU dry
run (--tiny) must keep working, so a GPU run never fails on the script itself, and a stage
that fails or logs a non-finite loss must fail the check by name."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
from proc import run_group

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

TRAINERS = ("base", "sft", "reward", "dpo", "dpo_precomputed", "ppo", "grpo")


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    proc = run_group([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--steps", "4",
                      "--out", str(tmp_path)], timeout=420, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["failed"] == {}
    assert set(gpu_check.STAGES) <= set(result)
    for name in ("eager", "compiled", "fsdp") + TRAINERS:
        assert result[name]["tokens_per_s"] > 0 and math.isfinite(result[name]["loss"]), name
    assert result["fsdp"]["sharded"] and result["fsdp"]["resume_max_abs_diff"] == 0.0
    assert result["ppo"]["generation_tokens_per_s"] > 0 and result["grpo"]["generation_tokens_per_s"] > 0
    # the cached reference log-probs are the live reference's: the same DPO losses
    assert result["dpo_precomputed"]["loss"] == pytest.approx(result["dpo"]["loss"], abs=1e-4)
    assert "precomputed" in (tmp_path / "dpo_precomputed.log").read_text()
    assert result["evaluate"]["prompts"] == gpu_check.TINY.eval_prompts
    # every post-training run starts from the tokenizer the base run recorded
    base_meta = json.loads(next((tmp_path / "base" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert base_meta["tokenizer"].startswith("sentencepiece:") and base_meta["model_config"]["vocab_size"] == 512


def test_a_failed_command_names_its_stage(tmp_path):
    check = gpu_check.Check(tmp_path, dict(os.environ), {})
    check.stage("base", lambda: check.train("base", [sys.executable, "-c", "import sys; sys.exit(3)"]))
    assert "base" not in check.results
    assert check.failed["base"].startswith("base: exit status 3")
    check.stage("sft", lambda: {"wall_s": 0.0})  # starts from base: not run
    assert check.failed["sft"] == "sft: not run (base failed)" and "sft" not in check.results


def test_a_non_finite_loss_fails_its_stage(tmp_path):
    records = [{"event": "start"}, {"step": 1, "loss": 0.7, "tokens_per_s": 10.0},
               {"step": 2, "loss": 0.6, "tokens_per_s": 12.0, "mfu": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert gpu_check.train_figures("dpo", tmp_path) == {"tokens_per_s": 12.0, "mfu": 0.3, "loss": 0.6,
                                                        "generation_tokens_per_s": None}
    for bad in ({"step": 2, "val_loss": float("nan")}, {"step": 3, "loss/value": float("inf"), "tokens_per_s": 1.0}):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records + [bad]))
        with pytest.raises(gpu_check.StageFailed, match=r"^dpo: (val_loss nan|loss/value inf)"):
            gpu_check.train_figures("dpo", tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(gpu_check.StageFailed, match="dpo: no training record"):
        gpu_check.train_figures("dpo", tmp_path)
