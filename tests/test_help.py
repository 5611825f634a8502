"""Every script's --help: exit 0, quickly, every flag with its help, a prep's options listed
once (a flag that sets a config field is listed as that field), and without importing torch.

Each script runs in a fresh interpreter under a small wrapper that executes it as __main__ with
--help and, once argparse has exited, reports the exit status and whether `torch` is in
`sys.modules` on its last stderr line. The bound on the time is generous (a loaded machine);
on an idle one a torch-free --help takes well under a second.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
SECONDS = 10.0  # generous: a torch-free --help takes well under a second on an idle machine
WRAPPER = """
import json, runpy, sys
script = sys.argv[1]
sys.argv = [script, "--help"]
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def run_help(script: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, str(ROOT / "scripts" / script)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "SPROUT_MIRROR": ""})
    seconds = time.perf_counter() - t0
    return proc, json.loads(proc.stderr.strip().splitlines()[-1]), seconds


def options_section(help_text: str) -> str:
    """argparse's "options:" block of a --help (up to the next unindented paragraph)."""
    block = help_text.split("\noptions:\n", 1)[1]
    return re.split(r"\n\n(?=\S)", block, maxsplit=1)[0]


def flag_entries(help_text: str) -> dict[str, bool]:
    """{option name (- = _): whether it has help text} for every flag in argparse's block."""
    entries = {}
    for chunk in re.split(r"\n(?=  -)", "\n" + options_section(help_text)):
        lines = chunk.strip("\n").splitlines()
        if not lines:
            continue
        first = re.match(r"\s*(\S.*?)(?:\s{2,}(\S.*))?$", lines[0])
        for opt in re.findall(r"--[\w-]+", first.group(1)):
            entries[opt[2:].replace("-", "_")] = bool(first.group(2)) or len(lines) > 1
    entries.pop("help", None)
    return entries


def field_options(help_text: str) -> list[str]:
    """The options of the config fields listed after argparse's (- = _)."""
    fields = help_text.partition("\nconfig fields (")[2]
    return [o[2:].replace("-", "_") for o in re.findall(r"^\s{4}(--[\w.-]+)", fields, re.M)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_0_quickly_explains_each_flag_once_and_imports_no_torch(script):
    proc, report, seconds = run_help(script)
    assert report["exit"] in (0, None), proc.stderr
    assert "usage:" in proc.stdout and "Traceback" not in proc.stderr
    assert seconds < SECONDS, seconds
    assert not report["torch"], (script, report)
    flags, fields = flag_entries(proc.stdout), field_options(proc.stdout)
    assert all(flags.values()), (script, [f for f, helped in flags.items() if not helped])  # no bare flag
    assert len(fields) == len(set(fields))
    if script.startswith("prepare_") or script == "train_tokenizer.py":  # a flag that sets a field is the field
        assert not set(flags) & set(fields), (script, set(flags) & set(fields))


def test_help_states_the_defaults_and_meanings_a_user_asked_for():
    sample = run_help("sample.py")[0].stdout
    assert "--temperature 0.8 \\\n        --top-k 50" in sample  # the example's two lines, as written
    for script in ("sample.py", "chat.py"):
        text = " ".join(run_help(script)[0].stdout.split())
        assert "(default 100)" in text or "(default 256)" in text
        assert "k likeliest tokens (default: all)" in text
        assert "(default: cuda when available, else cpu)" in text
    sft = " ".join(run_help("prepare_sft_data.py")[0].stdout.split())
    assert "--source-format FORMAT, --format FORMAT" in sft and "the input, not the output" in sft
    pretrain_data = " ".join(run_help("prepare_pretrain_data.py")[0].stdout.split())
    assert "output format: .bin shards, one HDF5 file, or both" in pretrain_data
    for script, source_cls in (("prepare_preference_data.py", "PreferenceSourceConfig"),
                               ("prepare_rl_prompts.py", "PromptSourceConfig")):
        text = run_help(script)[0].stdout
        assert f"source fields ({source_cls})" in text
        assert re.search(r"^\s+format\s+\{[a-z_0-9, ]+\} \(required\)", text, re.M), text


def test_dpo_help_lists_every_loss_type():
    from sprout.losses.loss_types import PREFERENCE_LOSS_TYPES

    text = " ".join(run_help("train_dpo.py")[0].stdout.split())
    listed = re.search(r"--dpo\.loss_type str \| list = sigmoid a name or a list of: ([a-z_, ]+)", text)
    assert listed, text
    assert listed.group(1).strip().split(", ") == list(PREFERENCE_LOSS_TYPES)
    assert {"sigmoid_norm", "aot", "aot_unpaired"} <= set(PREFERENCE_LOSS_TYPES)
