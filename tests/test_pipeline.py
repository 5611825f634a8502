"""The pipeline runner (sprout.pipeline.runner, scripts/run_pipeline.py) and its report card, on a tiny
preset written here: tokenizer -> pretrain data -> pretrain -> SFT data -> SFT -> preference
data -> reward model, DPO, each a few steps of a tiny model.

Skips what is done, resumes a killed stage from its checkpoint to the same weights, re-runs a
stage whose config changed and what follows it, and the report card's figures are the stages'
own metrics. The slow test kills the runner at ten seeded random moments.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from data_fixtures import make_docs
from sprout.errors import SproutError
from sprout.pipeline.runner import StageFailed, digest, read_state, run_pipeline
from sprout.pipeline.preset import command_args, load_preset, select
from sprout.engine.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ("pretrain", "sft", "reward", "dpo")
TRAIN_FLAGS = ["--train.progress", "false", "--train.peak_tflops", "-1"]


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def tiny_preset(folder: Path) -> Path:
    """A preset of the eight stages that exist, with configs for a 2-layer, 32-wide model."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n\n".join(make_docs(300, seed=1)) + "\n")
    model = {"vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 128}
    train = {"mixed_precision": "no", "seed": 0, "log_every": 1, "keep_checkpoints": 2}
    optim = {"lr": 3.0e-3, "warmup_steps": 1, "min_lr_ratio": 0.1}
    pairs = {"global_pairs": 8, "micro_pairs": 4}
    cfg = {
        "tokenizer": {"sources": [str(corpus)], "vocab_size": 320, "clean": False},
        "pretrain_data": {"name": "tiny", "sources": [str(corpus)], "val_frac": 0.1, "shard_tokens": 20000,
                          "run_tokens": 2000, "workers": 1, "format": "bin", "clean": {"min_chars": 10}},
        "pretrain": {"model": model, "data": {"seq_len": 64, "seq_len_start": 64, "eval_tokens": 2048},
                     "batch": {"global_tokens": 1024, "micro_tokens": 512}, "optim": optim,
                     "train": {**train, "max_steps": 8, "eval_every": 4, "ckpt_every": 2}},
        "sft_data": {"seq_len": 128, "val_fraction": 0.1, "sources": [
            {"name": "arithmetic", "format": "arithmetic", "count": 300, "levels": [1, 2]}]},
        "sft": {"batch": {"global_tokens": 1024, "micro_tokens": 512}, "optim": optim,
                "train": {**train, "max_steps": 6, "eval_every": 3, "ckpt_every": 2}},
        "preferences": {"test_fraction": 0.2, "sources": [
            {"name": "arithmetic", "format": "arithmetic", "count": 120, "levels": [1, 2], "split": "train"}]},
        "reward": {"batch": pairs, "optim": optim, "train": {**train, "max_steps": 4, "eval_every": 2, "ckpt_every": 2}},
        "dpo": {"batch": pairs, "optim": optim, "train": {**train, "max_steps": 4, "eval_every": 2, "ckpt_every": 2}},
    }
    paths = {name: str(write_yaml(folder / f"{name}.yaml", c)) for name, c in cfg.items()}
    stages = [
        {"name": "tokenizer", "kind": "prep", "script": "scripts/train_tokenizer.py", "config": paths["tokenizer"],
         "out": "tokenizer/sp", "outputs": ["tokenizer/sp.model", "tokenizer/sp.vocab"], "args": ["--out", "{out}"]},
        {"name": "pretrain_data", "kind": "prep", "script": "scripts/prepare_pretrain_data.py",
         "config": paths["pretrain_data"], "inputs": ["tokenizer"], "out": "data",
         "args": ["--tokenizer", "sentencepiece:{tokenizer}.model", "--out", "{out}", "--no-progress"]},
        {"name": "pretrain", "kind": "train", "script": "scripts/pretrain.py", "config": paths["pretrain"],
         "inputs": ["pretrain_data"], "out": "base", "args": ["--data", "{pretrain_data}", *TRAIN_FLAGS]},
        {"name": "sft_data", "kind": "prep", "script": "scripts/prepare_sft_data.py", "config": paths["sft_data"],
         "inputs": ["tokenizer"], "out": "sft/sft.h5", "outputs": ["sft/sft.h5", "sft/sft_val.h5"],
         "args": ["--tokenizer", "sentencepiece:{tokenizer}.model", "--out", "{out}"]},
        {"name": "sft", "kind": "train", "script": "scripts/train_sft.py", "config": paths["sft"],
         "inputs": ["pretrain", "sft_data"], "out": "sft_model",
         "args": ["--init", "{pretrain}", "--data", "{sft_data}", *TRAIN_FLAGS]},
        {"name": "preferences", "kind": "prep", "script": "scripts/prepare_preference_data.py",
         "config": paths["preferences"], "out": "prefs",
         "outputs": ["prefs/preferences.jsonl", "prefs/preferences_test.jsonl", "prefs/manifest.json"],
         "args": ["--out", "{out}"]},
        {"name": "reward", "kind": "train", "script": "scripts/train_reward.py", "config": paths["reward"],
         "inputs": ["sft", "preferences"], "out": "reward_model",
         "args": ["--init", "{sft}", "--data", "{preferences}/preferences.jsonl", *TRAIN_FLAGS]},
        {"name": "dpo", "kind": "train", "script": "scripts/train_dpo.py", "config": paths["dpo"],
         "inputs": ["sft", "preferences"], "out": "dpo_model",
         "args": ["--init", "{sft}", "--data", "{preferences}/preferences.jsonl", *TRAIN_FLAGS]},
    ]
    return write_yaml(folder / "tiny.yaml", {"out": str(folder / "runs"), "launcher": "python", "stages": stages})


def runner(preset: Path, *args: str, out: Path | None = None) -> list[str]:
    cmd = [sys.executable, str(ROOT / "scripts" / "run_pipeline.py"), "--preset", str(preset), *args]
    return cmd + (["--out", str(out)] if out else [])


def run(preset: Path, *args: str, out: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(runner(preset, *args, out=out), capture_output=True, text=True, timeout=timeout, env=env)
    return proc


def notes(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """{stage: what the runner said it did} from its `==> stage: ...` lines."""
    return {line[4:].split(":")[0]: line.split(": ", 1)[1] for line in proc.stdout.splitlines()
            if line.startswith("==> ")}


def weights(out: Path) -> dict[str, str]:
    state = read_state(out)
    return {name: state["stages"][name]["outputs"]["weights_sha256"] for name in TRAIN}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run of the tiny preset: (preset path, output root)."""
    folder = tmp_path_factory.mktemp("pipeline")
    preset = tiny_preset(folder)
    proc = run(preset)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return preset, folder / "runs"


# ---- the preset (the presets in the repository: tests/test_presets.py) ---------------------------
def test_model_fills_its_placeholder_and_is_overridden(tmp_path):
    stages = [{"name": "a", "kind": "prep", "script": "x.py", "out": "a", "args": ["{model}", "--out", "{out}"]}]
    path = write_yaml(tmp_path / "p.yaml", {"out": str(tmp_path / "runs"), "model": "org/base", "stages": stages})
    assert command_args(load_preset(path), load_preset(path).stages[0]) == [["org/base", "--out", str(tmp_path / "runs" / "a")]]
    other = load_preset(path, model="org/other")
    assert command_args(other, other.stages[0])[0][0] == "org/other"
    path = write_yaml(tmp_path / "q.yaml", {"out": str(tmp_path / "runs"), "stages": stages})
    with pytest.raises(SproutError, match=r"stage a: args: \{model\} but the preset has no model"):
        load_preset(path)
    assert command_args(load_preset(path, model="dir/m"), load_preset(path, model="dir/m").stages[0])[0][0] == "dir/m"


@pytest.mark.parametrize("change, message", [
    ({"kind": "build"}, "stage b: kind: 'build' is not one of prep, train, eval"),
    ({"inputs": ["c"]}, "stage b: inputs: 'c' is not an earlier stage"),
    ({"args": ["{c}"]}, "stage b: args: {c} names no stage in its inputs (a)"),
    ({"colour": 1}, "stage b: unknown key(s) colour"),
])
def test_a_bad_preset_is_refused_in_one_line_naming_the_stage(tmp_path, change, message):
    stages = [{"name": "a", "kind": "prep", "script": "x.py", "out": "a"},
              {"name": "b", "kind": "prep", "script": "x.py", "inputs": ["a"], "out": "b", **change}]
    path = write_yaml(tmp_path / "p.yaml", {"out": str(tmp_path / "runs"), "stages": stages})
    with pytest.raises(SproutError, match=message.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")):
        load_preset(path)


def test_from_and_to_select_a_range(tmp_path):
    preset = load_preset(tiny_preset(tmp_path))
    before, chosen = select(preset, "sft_data", "reward")
    assert [s.name for s in before] == ["tokenizer", "pretrain_data", "pretrain"]
    assert [s.name for s in chosen] == ["sft_data", "sft", "preferences", "reward"]
    with pytest.raises(SproutError, match="no stage named 'ppo'"):
        select(preset, None, "ppo")


def test_a_missing_script_fails_with_one_line_when_its_stage_is_reached(tmp_path):
    stages = [{"name": "a", "kind": "prep", "script": "scripts/verify_shards.py", "args": ["--help"]},
              {"name": "ppo", "kind": "train", "script": "scripts/train_not_yet.py", "inputs": ["a"], "out": "ppo"}]
    preset = write_yaml(tmp_path / "p.yaml", {"out": str(tmp_path / "runs"), "stages": stages})
    proc = run(preset, "--no-report")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {ROOT}/scripts/train_not_yet.py: stage ppo's script does not "
                                                f"exist (yet)"]
    assert "==> a: running" in proc.stdout and "==> ppo" not in proc.stdout  # the stage before it ran


# ---- skip, resume, re-run -----------------------------------------------------------------------
def test_a_second_run_skips_every_stage(reference):
    preset, out = reference
    before = (out / "pipeline_state.json").read_text()
    proc = run(preset, "--no-report")
    assert proc.returncode == 0, proc.stderr
    said = notes(proc)
    assert list(said) == ["tokenizer", "pretrain_data", "pretrain", "sft_data", "sft", "preferences", "reward", "dpo"]
    assert all(v.startswith("done, skipped") for v in said.values()), said
    assert (out / "pipeline_state.json").read_text() == before
    assert not any(p.name.startswith(".tmp-") for p in out.rglob("*"))


def test_a_stage_killed_mid_run_resumes_to_the_same_weights(reference, tmp_path):
    preset, ref_out = reference
    out = tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(runner(preset, "--to", "pretrain", "--no-report", out=out), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    latest = out / "base" / "checkpoints" / "latest"
    while not latest.is_file() and proc.poll() is None:  # the first checkpoint (step 2 of 8)
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children()
    assert children, "the pretraining process had already finished"
    children[0].kill()
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 137 and "stage pretrain was killed by SIGKILL; run the pipeline again to resume it" in text
    rerun = run(preset, "--to", "pretrain", "--no-report", out=out)
    assert rerun.returncode == 0, rerun.stderr
    assert notes(rerun)["pretrain"].startswith("resuming from its latest checkpoint")
    assert "--resume" in rerun.stdout
    state, ref_state = read_state(out), read_state(ref_out)
    assert state["stages"]["pretrain"]["outputs"] == ref_state["stages"]["pretrain"]["outputs"]


def test_a_changed_config_reruns_its_stage_and_everything_after_it(reference, tmp_path):
    preset_path, ref_out = reference
    # a copy of the finished run, then the SFT config changes: SFT, reward and DPO re-run
    import shutil
    out = tmp_path / "runs"
    shutil.copytree(ref_out, out)
    preset = load_preset(preset_path, out)
    sft_cfg = preset.stage("sft").config
    original = sft_cfg.read_text()
    try:
        data = yaml.safe_load(original)
        data["optim"]["lr"] = 1.0e-3
        sft_cfg.write_text(yaml.safe_dump(data))
        proc = run(preset_path, "--no-report", out=out)
    finally:
        sft_cfg.write_text(original)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = notes(proc)
    assert {k for k, v in said.items() if v.startswith("done, skipped")} == \
        {"tokenizer", "pretrain_data", "pretrain", "sft_data", "preferences"}
    assert {k for k, v in said.items() if v.startswith("inputs changed")} == {"sft", "reward", "dpo"}
    assert "--overwrite" in proc.stdout
    new, old = weights(out), weights(ref_out)
    assert new["pretrain"] == old["pretrain"] and all(new[s] != old[s] for s in ("sft", "reward", "dpo"))


def test_input_hashes_name_config_command_and_upstream(reference):
    preset_path, out = reference
    state = read_state(out)
    sft = state["stages"]["sft"]
    assert set(sft["inputs"]["upstream"]) == {"pretrain", "sft_data"}
    assert sft["inputs"]["upstream"]["pretrain"]["outputs"] == state["stages"]["pretrain"]["outputs"]["weights_sha256"]
    assert sft["input_hash"] == digest(sft["inputs"])
    preset = load_preset(preset_path)
    from sprout.atomic import sha256_file
    assert sft["inputs"]["config_sha256"] == sha256_file(preset.stage("sft").config)


# ---- the report card ----------------------------------------------------------------------------
QUALITY = ("step", "weights_sha256", "val_bpb", "sft_val_loss", "rm_val_accuracy", "dpo_val_accuracy",
           "arith_pass@1", "arith_pass@8", "gsm8k_pass@1", "mean_length")


def figures(out: Path) -> dict[str, dict]:
    rows = json.loads((out / "report" / "report_card.json").read_text())["rows"]
    return {r["stage"]: {k: r[k] for k in QUALITY} for r in rows}


def test_report_card_figures_are_the_stages_own_metrics(reference):
    from sprout.evaluation.statistics import wilson_interval
    _, out = reference
    card = json.loads((out / "report" / "report_card.json").read_text())["rows"]
    assert [r["stage"] for r in card] == list(TRAIN)

    def last(run: str, key: str):
        return [r for r in read_metrics(out / run / "metrics.jsonl") if key in r and "event" not in r][-1][key]

    rows = {r["stage"]: r for r in card}
    assert rows["pretrain"]["val_bpb"] == last("base", "val_bpb")
    assert rows["sft"]["sft_val_loss"] == last("sft_model", "val_loss")
    assert rows["reward"]["rm_val_accuracy"] == last("reward_model", "val_accuracy")
    assert rows["dpo"]["dpo_val_accuracy"] == last("dpo_model", "val_rewards/accuracies")
    assert rows["pretrain"]["sft_val_loss"] is None and rows["sft"]["rm_val_accuracy"] is None
    speeds = [r["tokens_per_s"] for r in read_metrics(out / "sft_model" / "metrics.jsonl") if "tokens_per_s" in r]
    assert rows["sft"]["tokens_per_s"] == pytest.approx(sum(speeds) / len(speeds))
    report = (out / "report.md").read_text()
    table = report.split("## Wall time")[0]  # no evaluation stage: no column of dashes for its figures
    assert "| val bpb | SFT val masked loss |" in table and "pass@1" not in table and "greedy" not in table
    assert f"| dpo | 4 | – | – | – | {rows['dpo']['dpo_val_accuracy']:.3f} |" in report
    for run, key, stage in (("reward_model", "val_accuracy", "reward"), ("dpo_model", "val_rewards/margins", "dpo")):
        evals = [r for r in read_metrics(out / run / "metrics.jsonl") if key in r]
        assert f"{stage} (held-out pairs, step {evals[0]['step']} -> {evals[-1]['step']}):" in report
        assert f"  {key:28s} {evals[0][key]:8.3f} -> {evals[-1][key]:8.3f}" in report  # first eval -> last
    assert "  val_accuracy/arithmetic " in report  # the reward model's accuracy per source
    for stage, run, key, col in (("reward", "reward_model", "val_accuracy", "rm_val_accuracy"),
                                 ("dpo", "dpo_model", "val_rewards/accuracies", "dpo_val_accuracy")):
        pairs = last(run, "val_pairs")  # DPO's eval counts its held-out pairs as the reward model's does
        lo, hi = wilson_interval(round(last(run, key) * pairs), pairs)
        assert rows[stage][f"{col}_ci"] == [lo, hi]
        assert f"{last(run, key):8.3f}   (of {pairs:,.0f} pairs)   95 % [{lo:.3f}, {hi:.3f}]" in report
    state = json.loads((out / "pipeline_state.json").read_text())["stages"]
    for stage, rec in state.items():  # each stage's largest process: a Python process is > 10 MiB, torch's > 100
        assert (100 if stage in TRAIN else 10) < rec["peak_rss_mb"] < 24 * 1024, (stage, rec)
        assert re.search(rf"\| {stage} \| \w+ \| [^|]+ \| {rec['peak_rss_mb'] / 1024:.2f} GiB \|", report), stage
    for png in ("loss_curves.png", "reward_model.png", "dpo.png"):
        assert (out / "report" / png).read_bytes()[:4] == b"\x89PNG"
    answers = json.loads((out / "report" / "answers.json").read_text())
    assert set(answers) == {"pretrain", "sft", "dpo"} and all(len(a["answers"]) == 3 for a in answers.values())


def test_eval_json_figures_fill_the_task_columns(reference, tmp_path):
    """An eval stage's evaluate.py JSON (written here in its format) fills pass@k and length."""
    from sprout.pipeline.report_card import stage_rows
    preset_path, ref_out = reference
    preset = load_preset(preset_path)
    state = read_state(ref_out)
    evals = ref_out / "eval" / "sft"
    evals.mkdir(parents=True, exist_ok=True)
    arith = {"task": "arith", "split": "test", "metrics": {"pass@1": 0.25, "pass@8": 0.5,
                                                           "completions/mean_length": 31.5, "greedy/accuracy": 0.375}}
    gsm8k = {"task": "gsm8k", "split": "test", "metrics": {"pass@1": 0.125, "greedy/accuracy": 0.0625}}
    dev = {"task": "arith", "split": "dev", "metrics": {"pass@1": 0.75}}  # the table shows test
    for name, data in (("arith_test", arith), ("gsm8k_test", gsm8k), ("arith_dev", dev)):
        (evals / f"{name}.json").write_text(json.dumps(data))
    preset.stages.append(load_preset(write_yaml(tmp_path / "e.yaml", {"out": str(ref_out), "stages": [
        {"name": "sft", "kind": "prep", "script": "x.py"},
        {"name": "eval_sft", "kind": "eval", "script": "x.py", "inputs": ["sft"], "out": "eval/sft"}]})).stages[1])
    state = {"stages": {**state["stages"], "eval_sft": {"status": "done", "outputs": {
        "eval/sft/arith_test.json": "-", "eval/sft/gsm8k_test.json": "-", "eval/sft/arith_dev.json": "-"}}}}
    row = {r["stage"]: r for r in stage_rows(preset, state)}["sft"]
    assert (row["arith_pass@1"], row["arith_pass@8"], row["gsm8k_pass@1"], row["mean_length"]) == (0.25, 0.5, 0.125, 31.5)
    assert (row["arith_greedy"], row["gsm8k_greedy"]) == (0.375, 0.0625)
    assert {r["stage"]: r for r in stage_rows(preset, state)}["dpo"]["arith_pass@1"] is None


def made_up_eval(out: Path, run: str, ids, correct, greedy, *, task="arith", n=4, max_new_tokens=64,
                 per_problem=True) -> dict:
    """An evaluate.py JSON of a checkpoint in `out/run`: `correct[i]` of n samples and greedy
    `greedy[i]` right on problem `ids[i]`, the figures and intervals computed as evaluate.py does
    (without `per_problem`: a file of before per-problem records and intervals)."""
    from sprout.evaluation.evaluate import figure_intervals
    problems = [{"id": i, "source": "arithmetic_test", "level": 1, "n": n, "correct": c, "formatted": n,
                 "greedy_correct": g, "greedy_formatted": 1} for i, c, g in zip(ids, correct, greedy)]
    metrics = {"prompts": len(ids), "pass@1": sum(correct) / (n * len(ids)), "greedy/accuracy": sum(greedy) / len(ids)}
    if per_problem:
        metrics.update(figure_intervals(problems, list(metrics)))
    data = {"task": task, "split": "test", "checkpoint": {"path": str(out / run / "checkpoints" / "step_00000002"), "step": 2},
            "settings": {"n": n, "temperature": 1.0, "max_new_tokens": max_new_tokens}, "metrics": metrics}
    return {**data, "problems": problems} if per_problem else data


def test_report_card_intervals_and_real_changes_on_made_up_evals(tmp_path):
    """Stages import -> sft -> dpo -> grpo, each evaluated (the import through its out folder;
    the prompt prep read by eval_sft is no evaluated stage): each figure with its interval,
    each change against the previous and the first stage paired by problem id, ✓ only when
    its interval excludes 0; different problems, settings or no per-problem records unpaired;
    DPO's held-out accuracy with its Wilson interval."""
    from sprout.pipeline.report_card import write_report_card
    from sprout.evaluation.statistics import wilson_interval
    out = tmp_path / "runs"
    train = {"name": "sft", "kind": "train", "script": "train_sft.py", "out": "sft_model"}
    stages = [{"name": "import_smol", "kind": "prep", "script": "import_model.py", "out": "smol"},
              {"name": "rl_prompts", "kind": "prep", "script": "prepare_rl_prompts.py", "out": "rl_prompts"},
              {**train, "inputs": ["import_smol"]},
              {**train, "name": "dpo", "script": "train_dpo.py", "out": "dpo_model", "inputs": ["sft"]},
              {**train, "name": "grpo", "script": "train_grpo.py", "out": "grpo_model", "inputs": ["dpo"]}]
    evaluated = {"import_smol": "smol", "sft": "sft_model", "dpo": "dpo_model", "grpo": "grpo_model"}
    for stage in evaluated:
        inputs = [stage, "rl_prompts"] if stage == "sft" else [stage]
        stages.append({"name": f"eval_{stage}", "kind": "eval", "script": "evaluate.py", "inputs": inputs,
                       "out": f"eval/{stage}"})
    preset = load_preset(write_yaml(tmp_path / "made_up.yaml", {"out": str(out), "stages": stages}))
    ids, other = [f"arithmetic_test-{i:016x}" for i in range(40)], [f"arithmetic_test-{i:016x}" for i in range(40, 60)]
    dpo_correct = [3 if i % 3 == 0 else 1 if i % 3 == 1 else 2 for i in range(40)]  # 14 up a quarter, 13 down one
    files = {"import_smol": [made_up_eval(out, "smol", ids, [0] * 40, [0] * 40),
                             made_up_eval(out, "smol", ids[:16], [0] * 16, [0] * 16, task="gsm8k", per_problem=False)],
             "sft": [made_up_eval(out, "sft_model", ids, [2] * 40, [1] * 40),
                     made_up_eval(out, "sft_model", ids[:16], [1] * 16, [0] * 16, task="gsm8k")],
             "dpo": [made_up_eval(out, "dpo_model", ids, dpo_correct, [1] * 40),
                     made_up_eval(out, "dpo_model", ids[:16], [1] * 16, [0] * 16, task="gsm8k", max_new_tokens=128)],
             "grpo": [made_up_eval(out, "grpo_model", other, [4] * 20, [1] * 20)]}
    state = {"stages": {name: {"status": "done", "outputs": {}} for name in ("import_smol", "rl_prompts")}}
    for stage, datas in files.items():
        folder = out / "eval" / stage
        folder.mkdir(parents=True)
        for data in datas:
            (folder / f"{data['task']}_test.json").write_text(json.dumps(data))
        state["stages"][f"eval_{stage}"] = {"status": "done", "outputs": {f"eval/{stage}/{d['task']}_test.json": "-"
                                                                          for d in datas}}
    for stage in ("sft", "dpo", "grpo"):
        run = out / evaluated[stage]
        run.mkdir(parents=True)
        records = [{"step": 1, "loss": 2.0, "tokens_per_s": 100.0}, {"step": 2, "val_loss": 1.5}]
        if stage == "dpo":
            records = [records[0], *({"step": step, "val_rewards/accuracies": acc, "val_rewards/margins": margin,
                                      "val_pairs": 40} for step, acc, margin in ((0, 0.0, 0.0), (2, 0.75, 0.3)))]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        state["stages"][stage] = {"status": "done", "outputs": {"step": 2, "weights_sha256": stage}}
    report = write_report_card(preset, state, answers=False).read_text()
    arith, gsm8k = report.split("### arith (test: 20 / 40 problems)")[1].split("### gsm8k (test: 16 problems)")

    assert f"Preset `{preset.path}`; one row per stage checkpoint" in report  # the file it was read from
    # every figure in percent with its interval; the import is evaluated, the prompt prep is not
    assert "| stage | reading | pass@1 test | greedy accuracy test |" in report
    assert "| import_smol | strict | 0.0 [0.0, 8.8] | 0.0 [0.0, 8.8] |" in report  # Wilson 0/40: hi = z² / (40 + z²)
    assert "| sft | strict | 50.0 [50.0, 50.0] | 100.0 [91.2, 100.0] |" in report  # every problem 2 of 4; Wilson 40/40
    card = json.loads((out / "report" / "report_card.json").read_text())
    assert list(card["held_out"]["arith"]["figures"]) == ["import_smol", "sft", "dpo", "grpo"]  # no rl_prompts
    # the changes: the same problems paired, ✓ only where the interval excludes 0
    assert "| sft | pass@1 | import_smol | +50.0 [+50.0, +50.0] ✓ | import_smol | +50.0 [+50.0, +50.0] ✓ |" in arith
    assert "| sft | greedy accuracy | import_smol | +100.0 [+100.0, +100.0] ✓ | import_smol | " \
           "+100.0 [+100.0, +100.0] ✓ |" in arith
    dpo = next(line for line in arith.splitlines() if line.startswith("| dpo | pass@1 |"))
    assert re.fullmatch(r"\| dpo \| pass@1 \| sft \| \+0\.6 \[-\d+\.\d, \+\d+\.\d\] not significant \| import_smol \| "
                        r"\+50\.6 \[\+\d+\.\d, \+\d+\.\d\] ✓ \|", dpo), dpo
    assert "| dpo | greedy accuracy | sft | +0.0 [+0.0, +0.0] not significant | import_smol | " \
           "+100.0 [+100.0, +100.0] ✓ |" in arith
    assert "| grpo | pass@1 | dpo | different problems (40 vs 20, 0 shared) | import_smol | " \
           "different problems (40 vs 20, 0 shared) |" in arith
    # GSM8K: the import's file predates per-problem records; DPO's was evaluated with longer answers
    assert "| import_smol | strict | 0.0 | 0.0 |" in gsm8k  # no intervals in that file either
    assert "| sft | pass@1 | import_smol | no per-problem outcomes | import_smol | no per-problem outcomes |" in gsm8k
    assert "| dpo | pass@1 | sft | different max_new_tokens (64 vs 128) | import_smol | no per-problem outcomes |" \
        in gsm8k
    changes = {(c["stage"], c["figure"], c["vs"]): c for c in card["held_out"]["arith"]["changes"]}
    assert changes[("sft", "pass@1", "first")] == {"stage": "sft", "figure": "pass@1", "vs": "first",
                                                   "against": "import_smol", "diff": 0.5, "ci": [0.5, 0.5],
                                                   "real": True, "problems": 40}
    assert changes[("dpo", "pass@1", "previous")]["real"] is False
    assert card["held_out"]["arith"]["figures"]["sft"]["test"]["greedy/accuracy"] == \
        {"value": 1.0, "ci": list(wilson_interval(40, 40))}
    # DPO's held-out accuracy: 30 of 40 pairs, its Wilson interval
    lo, hi = wilson_interval(30, 40)
    assert f"  {'val_rewards/accuracies':28s} {0.0:8.3f} -> {0.75:8.3f}   (of 40 pairs)   95 % [{lo:.3f}, {hi:.3f}]" \
        in report
    assert {r["stage"]: r for r in card["rows"]}["dpo"]["dpo_val_accuracy_ci"] == [lo, hi]
    assert (out / "report" / "pass_at_1.png").read_bytes()[:4] == b"\x89PNG"


# ---- killed at random moments -------------------------------------------------------------------
@pytest.mark.slow
def test_killed_at_ten_random_moments_ends_as_an_uninterrupted_run(reference, tmp_path):
    preset, ref_out = reference
    out = tmp_path / "runs"
    rng = random.Random(7)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for moment in sorted(rng.uniform(0.5, 25.0) for _ in range(10)):
        proc = subprocess.Popen(runner(preset, out=out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:  # where in the pipeline the kill lands; the assertions hold at any moment
            assert proc.wait(timeout=moment) == 0  # the pipeline ended before this moment: nothing to kill
            continue
        except subprocess.TimeoutExpired:
            pass
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children()]
        proc.kill()
        proc.wait()
        assert psutil.wait_procs(family, timeout=60)[1] == []  # children die with it
    final = run(preset, out=out)
    assert final.returncode == 0, final.stderr[-2000:]
    assert weights(out) == weights(ref_out)
    assert figures(out) == figures(ref_out)
    assert not [p for p in out.rglob("*") if p.name.startswith(".tmp-")]


# ---- another checkout ---------------------------------------------------------------------------
def written_out(state: dict, repo: str) -> None:
    """Turn a state's records into what an earlier sprout wrote: the repository's path written out
    in the command lines (and every upstream input hash following)."""
    renamed = {}
    for rec in state["stages"].values():  # upstream first: the state lists stages as they first ran
        old = rec["input_hash"]
        rec["inputs"]["commands"] = [[a.replace("{repo}", repo) for a in c] for c in rec["inputs"]["commands"]]
        for up in rec["inputs"]["upstream"].values():
            up["inputs"] = renamed[up["inputs"]]
        rec["input_hash"] = renamed[old] = digest(rec["inputs"])


def test_another_checkout_or_a_state_recorded_with_the_repository_written_out_skips_what_is_done(tmp_path, monkeypatch):
    import shutil

    from sprout.pipeline import runner
    from sprout.pipeline.runner import run_pipeline
    from tests.test_pipeline_seeds import fake_preset

    first = tmp_path / "checkout_a"
    monkeypatch.setattr(runner, "REPO_ROOT", first)
    path = fake_preset(first)
    preset, seeded = load_preset(path), load_preset(path, seeds=[1, 2], seed_stages=["grpo"])
    run_pipeline(preset, log=lambda *_: None)
    state = run_pipeline(seeded, log=lambda *_: None)  # the same root holds both runs' records
    recorded = json.dumps(state["stages"]["grpo_seed2"]["inputs"]["commands"])
    assert "{repo}/grpo.json" in recorded and str(first) not in recorded
    # a state an earlier sprout wrote (the repository written out) is still the same inputs, for
    # every record in it: the plain run upgrades the seeds' records too, so neither run retrains
    written_out(state, str(first))
    assert str(first) in json.dumps(state["stages"]["grpo_seed2"]["inputs"]["commands"])
    runner.write_state(preset.out, state)
    for which in (preset, seeded):
        log: list[str] = []
        run_pipeline(which, log=log.append)
        if which is preset:
            assert log[0] == "recorded the inputs of 8 stage(s) with the repository as {repo} (same inputs)"
        assert [line for line in log if line.startswith("==> ")] == \
            [f"==> {s.name}: done, skipped (inputs unchanged, outputs verified)" for s in which.stages]
    assert "{repo}/grpo.json" in json.dumps(read_state(preset.out)["stages"]["grpo_seed1"]["inputs"]["commands"])
    # the same preset and output root run from another checkout (its configs at their new place)
    second = tmp_path / "checkout_b"
    shutil.copytree(first, second, ignore=shutil.ignore_patterns("runs", "seeds.yaml"))
    monkeypatch.setattr(runner, "REPO_ROOT", second)
    moved = load_preset(fake_preset(second), out=preset.out)
    log = []
    run_pipeline(moved, log=log.append)
    assert [line for line in log if line.startswith("==> ")] == \
        [f"==> {s.name}: done, skipped (inputs unchanged, outputs verified)" for s in moved.stages]


def test_a_run_whose_runner_was_killed_outright_keeps_its_time_up_to_its_last_file(tmp_path, monkeypatch):
    """A SIGKILL of the runner (a lost machine) skips the wall time it adds when its child ends: the
    resume counts that run from its start to the last file the stage wrote."""
    from sprout.pipeline.runner import lost_run_s, write_state
    from tests.test_pipeline_seeds import fake_preset
    preset = load_preset(fake_preset(tmp_path))
    monkeypatch.setenv("FAKE_FAIL_SEED", "1337")  # sft stops after its first checkpoint
    with pytest.raises(StageFailed, match="stage sft failed"):
        run_pipeline(preset, log=lambda _: None)
    monkeypatch.delenv("FAKE_FAIL_SEED")
    state = read_state(preset.out)
    rec = state["stages"]["sft"]
    assert "started_at" not in rec and lost_run_s(preset.out / "sft_model", rec) == 0.0  # its time was counted
    # what a runner killed outright leaves: its run's start, not its time
    start = time.time() - 100
    rec.update(wall_s=5.0, started_at=start)
    for f in (preset.out / "sft_model").rglob("*"):
        os.utime(f, (start + 40, start + 40))
    write_state(preset.out, state)
    log: list[str] = []
    state = run_pipeline(preset, log=log.append)
    assert any("runner was killed: 40 s of it counted" in line for line in log), log
    rec = state["stages"]["sft"]
    assert rec["status"] == "done" and "started_at" not in rec
    assert 45.0 <= rec["wall_s"] < 45.0 + 60  # the lost run's 40 s, the earlier 5 and the resumed run's own
