"""benchmarks/gpu_check.py's `trl_compare` stage (benchmarks/gpu_check_trl.py) on the CPU: under
--tiny it imports a tiny exported model and runs benchmarks/trl_compare.py with --device cpu,
recording its JSON table; without the 'bench' extra it is skipped with the reason, not failed;
a check beyond its tolerance fails it with the table kept; its GPU command is one trl_compare
takes (--device cuda, --json), and a missing SmolLM2 GGUF fails it naming the path."""

import functools
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_trl  # noqa: E402
from test_gpu_check import in_this_process  # noqa: E402


def stage(check: gpu_check.Check, gpu: bool = False) -> None:
    """The stage as gpu_check.main runs it."""
    check.stage("trl_compare", functools.partial(gpu_check_trl.trl_compare_stage, check, gpu, gpu_check.StageFailed))


def test_the_tiny_stage_imports_runs_trl_compare_and_records_its_table(tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[bench]')")
    deadline = time.monotonic() + 600
    monkeypatch.setattr(gpu_check.Check, "execute", lambda check, cmd, log: in_this_process(check, cmd, log, deadline))
    check = gpu_check.Check(tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}, {}, ["trl_compare"])
    stage(check)
    assert check.failed == {}, check.failed
    figures = check.results["trl_compare"]
    assert figures["dtype"] == "fp32" and figures["device"] == "CPU" and figures["wall_s"] > 0
    assert [r["name"] for r in figures["rows"]] == ["GRPO step", "DPO step", "SFT step", "generate"]
    assert all(r["check"] and not r["check_failures"] for r in figures["rows"]), figures["rows"]
    assert figures == {**json.loads((tmp_path / "trl_compare.json").read_text()), "wall_s": figures["wall_s"]}
    assert json.loads((tmp_path / "gpu_check.json").read_text())["trl_compare"] == figures
    # the imported model is the tiny export of SmolLM2's kind, with the check's SentencePiece tokenizer
    meta = json.loads(next((tmp_path / "trl_compare_model" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["model_config"]["n_kv_heads"] == 2 and meta["model_config"]["tie_embeddings"]
    check.results["device"], check.results["peak_tflops"] = "CPU", 1.0
    gpu_check.print_table(check.results, ["trl_compare"])
    assert "SFT step" in capsys.readouterr().out
    assert gpu_check.with_needs(["trl_compare"]) == ["trl_compare"]


def test_without_trl_the_stage_is_skipped_not_failed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check_trl.importlib.util, "find_spec", lambda name: None if name == "trl" else object())
    monkeypatch.setattr(gpu_check.Check, "execute", lambda *_: pytest.fail("nothing runs without trl"))
    check = gpu_check.Check(tmp_path, dict(os.environ), {"device": "CPU", "peak_tflops": 1.0}, ["trl_compare"])
    stage(check)
    assert check.failed == {}
    assert check.results["trl_compare"] == {"skipped": "trl not installed (pip install -e '.[bench]')"}
    gpu_check.print_table(check.results, ["trl_compare"])
    assert "trl_compare      skipped: trl not installed" in capsys.readouterr().out


def test_a_check_beyond_its_tolerance_fails_the_stage_and_keeps_the_table(tmp_path, monkeypatch):
    table = {"device": "CPU", "dtype": "fp32", "precision": "fp32 on CPU", "versions": {},
             "rows": [{"name": "SFT step", "speedup": 1.2, "target": 1.1, "check": {"loss": 0.3},
                       "check_failures": ["loss 3.0e-01 > 0.0001"]}]}

    def execute(check, cmd, log):
        if "benchmarks/trl_compare.py" in cmd:
            (tmp_path / "trl_compare.json").write_text(json.dumps(table))
            log.write_text("trl_compare: first-batch check beyond its tolerance: SFT step: loss 3.0e-01 > 0.0001\n")
            return 1
        log.write_text("imported\n")
        return 0

    monkeypatch.setattr(gpu_check.Check, "execute", execute)
    monkeypatch.setattr(gpu_check_trl, "missing_bench_extra", lambda: None)  # no trl run: execute stands in
    monkeypatch.setattr(gpu_check_trl.inputs, "train_tokenizer", lambda folder: None)
    monkeypatch.setattr(gpu_check_trl.inputs, "tiny_export", lambda folder, tok: folder)
    check = gpu_check.Check(tmp_path, dict(os.environ), {}, ["trl_compare"])
    stage(check)
    assert check.failed["trl_compare"].startswith("trl_compare: exit status 1")
    assert check.results["trl_compare"]["rows"] == table["rows"]
    assert "FAILED: loss 3.0e-01 > 0.0001" in gpu_check_trl.summary(check.results["trl_compare"])


def test_the_gpu_command_is_trl_compares_on_cuda_and_needs_the_mirrors_gguf(tmp_path, monkeypatch):
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[bench]')")
    import trl_compare

    cmd = gpu_check_trl.trl_compare_command(tmp_path, tmp_path / "trl_compare_model", gpu=True)
    assert cmd[:2] == [sys.executable, "benchmarks/trl_compare.py"]
    args = trl_compare.parse_args(cmd[2:])
    assert (args.device, args.dtype, args.only) == ("cuda", None, trl_compare.DEFAULT_ROWS)  # bf16 by default on cuda
    assert args.json == str(tmp_path / "trl_compare.json") and args.run == str(tmp_path / "trl_compare_model")
    assert (args.steps, args.warmup) == (5, 2)
    monkeypatch.setenv("SPROUT_MIRROR", str(tmp_path / "mirror"))
    with pytest.raises(gpu_check.StageFailed, match=f"trl_compare: no SmolLM2 GGUF at {tmp_path}/mirror/models/"):
        gpu_check_trl.model_source(tmp_path, True, gpu_check.StageFailed)
    gguf = tmp_path / "mirror" / gpu_check_trl.SMOLLM2_GGUF
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    assert gpu_check_trl.model_source(tmp_path, True, gpu_check.StageFailed) == gguf
