"""benchmarks/gpu_check.py is the one short check to run when a GPU is at hand: its CPU dry
run (--tiny) must keep working, so a GPU run never fails on the script itself."""

import json
import os
import sys
from pathlib import Path

import pytest
from proc import run_group

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    proc = run_group([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--steps", "4",
                      "--out", str(tmp_path)], timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"eager", "compiled", "fsdp"} <= set(result)
    assert all(result[k]["tokens_per_s"] > 0 for k in ("eager", "compiled", "fsdp"))
    assert result["fsdp"]["sharded"] and result["fsdp"]["resume_max_abs_diff"] == 0.0
