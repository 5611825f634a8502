"""What an RL trainer refuses at start, through its script: a prompt file edited after prep
(against the prep's manifest.json), held-out prompts also in the train file (by id and by
prompt key), and a run folder another trainer holds. Each: exit 2, one line naming the file
or folder, nothing written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from grpo_fixtures import addition_prompts
from preference_train_fixtures import base  # noqa: F401 (a fixture)
from proc import run_group, run_here
from test_bad_inputs_train import one_error, tree

from sprout.engine.cli import RUN_LOCK, hold_run, release_run
from sprout.prep.rl_prompts import PromptDataConfig, prepare

ROOT = Path(__file__).resolve().parents[1]
TINY = {"data": {"max_prompt_length": 24, "eval_prompts": 4, "eval_batch": 4, "eval_num_generations": 0},
        "batch": {"global_prompts": 2, "num_generations": 2, "micro_completions": 4},
        "rollout": {"max_completion_length": 8},
        "train": {"max_steps": 1, "log_every": 1, "eval_every": 0, "ckpt_every": 0, "progress": "false",
                  "peak_tflops": -1}}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A folder scripts/prepare_rl_prompts.py's prep wrote: prompts.jsonl, prompts_dev.jsonl, manifest.json."""
    root = tmp_path_factory.mktemp("rl")
    src = root / "addition.jsonl"
    src.write_text("".join(json.dumps({"prompt": r["prompt"], "gold": r["gold"]}) + "\n"
                           for r in addition_prompts(100, 0)))
    cfg = PromptDataConfig(out=str(root / "prompts"), test_fraction=0.3, dev_fraction=0.3,
                           sources=[{"name": "addition", "format": "jsonl", "path": str(src)}])
    prepare(cfg, log=lambda s: None)
    return root / "prompts"


def train(script: str, data: Path, init: Path, out: Path, *extra, here: bool = True):
    """The trainer's run on tiny sizes: in this process (`proc.run_here`), or with `here=False` in
    a process of its own."""
    flags = [f"--{section}.{k}={v}" for section, fields in TINY.items() for k, v in fields.items()]
    if script == "train_ppo.py":
        flags.append("--ppo.num_ppo_epochs=1")
    cmd = [sys.executable, str(ROOT / "scripts" / script), "--data", str(data), "--init", str(init), "--out", str(out),
           *flags, *extra]
    env = {**os.environ, "SPROUT_MIRROR": ""}
    return run_here(cmd, cwd=ROOT, env=env) if here else run_group(cmd, timeout=300, cwd=ROOT, env=env)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture()
def copy(prepared, tmp_path):
    d = tmp_path / "prompts"
    d.mkdir()
    for f in prepared.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


@pytest.mark.parametrize("script, name", [("train_grpo.py", "prompts.jsonl"), ("train_ppo.py", "prompts_dev.jsonl")])
def test_an_edited_prompt_file_is_refused_before_training(script, name, copy, base, tmp_path):
    records = lines(copy / name)
    records[0]["gold"] = str(int(records[0]["gold"]) + 1)  # still a valid record: only the manifest tells
    write_lines(copy / name, records)
    before = tree(tmp_path)
    one_error(train(script, copy / "prompts.jsonl", base, tmp_path / "out"), str(copy / name), "sha256",
              "manifest.json")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("script, how", [("train_grpo.py", "id"), ("train_ppo.py", "prompt")])
def test_held_out_prompts_in_the_train_file_are_refused(script, how, copy, base, tmp_path):
    held_out = lines(copy / "prompts_dev.jsonl")[:3]
    if how == "prompt":  # the same questions under new ids
        held_out = [{**r, "id": f"copy-{i}"} for i, r in enumerate(held_out)]
    write_lines(copy / "prompts.jsonl", lines(copy / "prompts.jsonl") + held_out)
    before = tree(tmp_path)
    needle = "first: id" if how == "id" else "the prompt of train id"
    one_error(train(script, copy / "prompts.jsonl", base, tmp_path / "out", "--data-verify", "sizes"),
              str(copy / "prompts_dev.jsonl"), "3 held-out prompt(s) also in the train file", needle)
    assert tree(tmp_path) == before


def test_a_run_folder_another_trainer_holds_is_refused(prepared, base, tmp_path):
    out = tmp_path / "out"
    assert hold_run(out)  # this test's process stands for a trainer that is writing `out`
    try:  # the trainers that find it held: processes of their own
        before = tree(tmp_path)
        one_error(train("train_grpo.py", prepared / "prompts.jsonl", base, out, here=False), str(out),
                  f"pid {os.getpid()}", "another trainer")
        assert tree(tmp_path) == before
        (out / "metrics.jsonl").write_text('{"step": 1}\n')  # the holder's run so far
        before = tree(tmp_path)
        one_error(train("train_grpo.py", prepared / "prompts.jsonl", base, out, "--overwrite", here=False), str(out),
                  f"pid {os.getpid()}")  # --overwrite deletes nothing of a held run
        assert tree(tmp_path) == before
    finally:
        release_run(out)
    ok = train("train_grpo.py", prepared / "prompts.jsonl", base, out, "--overwrite")
    assert ok.returncode == 0, ok.stderr
    assert "data: verified 2 prompt files" in ok.stdout
    assert (out / RUN_LOCK).is_file() and (out / "checkpoints").is_dir()


def test_a_prompt_count_refusal_names_the_sources_filter(prepared, base, tmp_path):
    mine = tmp_path / "mine"  # hand-made files (no manifest): train prompts of one source, held-out of another
    mine.mkdir()
    write_lines(mine / "prompts.jsonl", [{**r, "source": "story"} for r in lines(prepared / "prompts.jsonl")])
    write_lines(mine / "prompts_dev.jsonl", [{**r, "source": "sum"} for r in lines(prepared / "prompts_dev.jsonl")])
    n_train = len(lines(mine / "prompts.jsonl"))
    before = tree(tmp_path)
    one_error(train("train_grpo.py", mine / "prompts.jsonl", base, tmp_path / "out", "--data.sources", "[sum]"),
              f"0 prompts (of {n_train}) cannot fill one global batch", f"{n_train} left out by data.sources ['sum']")
    one_error(train("train_grpo.py", mine / "prompts.jsonl", base, tmp_path / "out", "--data.sources", "[story]"),
              str(mine / "prompts_dev.jsonl"), "no held-out prompts to evaluate", "left out by data.sources ['story']")
    assert tree(tmp_path) == before
