"""scripts/demo.sh, the thin wrapper over `run_pipeline.py --preset demo`: which Python it runs,
which mirror it passes and that extra arguments reach the runner.

The script is copied into a scratch repository whose Python is a stub that prints its
working directory and arguments, so nothing of the pipeline runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB = '#!/bin/sh\necho "{name} cwd=$(pwd)"\nfor a in "$@"; do echo "$a"; done\n'


def stub(path: Path, name: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STUB.format(name=name))
    path.chmod(0o755)


def scratch_repo(tmp_path: Path, with_venv: bool) -> Path:
    repo = tmp_path / "work" / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "demo.sh", repo / "scripts" / "demo.sh")
    if with_venv:
        stub(repo / ".venv" / "bin" / "python", "venv-python")
    stub(tmp_path / "bin" / "python3", "system-python3")
    return repo


def run_demo(tmp_path: Path, repo: Path, *args: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("SPROUT_MIRROR", "PY", "DEMO")}
    clean["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{clean.get('PATH', '')}"
    proc = subprocess.run(["bash", str(repo / "scripts" / "demo.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, env={**clean, **env}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_defaults_to_the_venv_python_and_the_mirror_beside_the_repository(tmp_path):
    repo = scratch_repo(tmp_path, with_venv=True)
    lines = run_demo(tmp_path, repo, "--from", "grpo")
    assert lines[0] == f"venv-python cwd={repo}"  # run from the repository root, wherever called from
    mirror = str(tmp_path / "work" / "shared" / "data")
    assert lines[1:] == ["scripts/run_pipeline.py", "--preset", "demo", "--out", "runs/demo", "--mirror", mirror,
                         "--from", "grpo"]


def test_without_a_venv_runs_python3_and_takes_the_mirror_and_out_from_the_environment(tmp_path):
    repo = scratch_repo(tmp_path, with_venv=False)
    lines = run_demo(tmp_path, repo, SPROUT_MIRROR="/data/mirror", DEMO="runs/other")
    assert lines[0] == f"system-python3 cwd={repo}"
    assert lines[1:] == ["scripts/run_pipeline.py", "--preset", "demo", "--out", "runs/other", "--mirror",
                         "/data/mirror"]
