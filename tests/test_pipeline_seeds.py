"""Seeds as an axis of the pipeline (sprout.pipeline.preset's seeds and seed_stages,
run_pipeline.py --seeds) and the report card's reading of them, on a preset of fake stages
written here: a "trainer" that writes a checkpoint whose weights are its init's and its seed's,
and an "evaluator" that writes evaluate.py's JSON (test and dev, strict and flexible) with
scores made up from the seed.

Checked: a seeded stage and its eval stage run once per seed, each into its own folder, from the
same earlier stage, with --train.seed; skip, resume and re-run hold per seed; --from/--to name a
seeded stage; what cannot be seeded is refused in one line; the report card shows each seed, their
mean with the two-level interval, test with dev beside it, strict and flexible.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sprout.errors import SproutError
from sprout.evaluation.statistics import seeds_mean_interval, seeds_paired_difference_interval
from sprout.pipeline.runner import StageFailed, read_state, run_pipeline
from sprout.pipeline.preset import command_args, load_preset, select

ROOT = Path(__file__).resolve().parents[1]
SEEDS = [1, 2, 3]
PROBLEMS = 20

FAKE_TRAIN = '''
import argparse, hashlib, json, os, sys
from pathlib import Path
from sprout.formats.checkpoint_meta import FORMAT, META, META_DIGEST, STATE, WEIGHTS, meta_digest, read_meta

p = argparse.ArgumentParser()
p.add_argument("--config")
p.add_argument("--init")
p.add_argument("--out", required=True)
p.add_argument("--resume", action="store_true")
p.add_argument("--overwrite", action="store_true")
p.add_argument("--train.seed", dest="seed", type=int, default=1337)
args = p.parse_args()
out = Path(args.out)
if args.resume:
    run = json.loads((out / "run.json").read_text())
else:
    init = read_meta(args.init)["files"][WEIGHTS] if args.init else "scratch"
    run = {"seed": args.seed, "init": init, "skill": json.loads(Path(args.config).read_text())["skill"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(run))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0 / (1 + run["skill"])}) + "\\n")


def checkpoint(step):
    folder = out / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WEIGHTS).write_text(json.dumps({**run, "step": step}))
    (folder / STATE).write_text("state")
    meta = {"format": FORMAT, "architecture": "lm", "step": step,
            "files": {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in (WEIGHTS, STATE)}}
    (folder / META).write_text(json.dumps({**meta, META_DIGEST: meta_digest(meta)}))
    (out / "checkpoints" / "latest").write_text(folder.name)


checkpoint(1)
if os.environ.get("FAKE_FAIL_SEED") == str(run["seed"]) and not args.resume:
    sys.exit(1)  # killed after its first checkpoint
checkpoint(2)
'''

FAKE_EVAL = '''
import argparse, json
from pathlib import Path
from sprout.evaluation.statistics import mean_interval
from sprout.formats.checkpoint_meta import read_meta

p = argparse.ArgumentParser()
p.add_argument("checkpoint")
p.add_argument("--split", required=True)
p.add_argument("--out", required=True)
args = p.parse_args()
meta = read_meta(args.checkpoint)
run = json.loads((Path(args.checkpoint) / "run.json").read_text())
shift = 1 if args.split == "dev" else 0
problems = []
for i in range(20):
    correct = max(0, min(4, run["skill"] + (i * 7 + run["seed"] + shift) % 3 - 1))
    problems.append({"id": f"{args.split}-{i:03d}", "n": 4, "correct": correct,
                     "flexible_correct": min(4, correct + (i % 2))})
metrics = {"prompts": len(problems)}
for name, key in (("pass@1", "correct"), ("flexible/pass@1", "flexible_correct")):
    scores = [p[key] / 4 for p in problems]
    metrics[name], metrics[name + "_ci"] = sum(scores) / len(scores), list(mean_interval(scores))
data = {"task": "arith", "split": args.split, "checkpoint": {"path": meta["path"], "step": meta["step"]},
        "settings": {"n": 4, "temperature": 1.0, "max_new_tokens": 64}, "metrics": metrics, "problems": problems}
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
Path(args.out).write_text(json.dumps(data))
'''


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def evaluation(name: str) -> dict:
    return {"name": f"eval_{name}", "kind": "eval", "script": "{fake}/fake_eval.py", "inputs": [name],
            "out": f"eval/{name}", "args": [[f"{{{name}}}", "--split", split, "--out", f"{{out}}/arith_{split}.json"]
                                           for split in ("test", "dev")]}


def fake_preset(folder: Path, **top) -> Path:
    """sft -> grpo (seeded by `top`), each evaluated on test and dev by the fake evaluator."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fake_train.py").write_text(FAKE_TRAIN)
    (folder / "fake_eval.py").write_text(FAKE_EVAL)
    for name, skill in (("sft", 1), ("grpo", 3)):
        (folder / f"{name}.json").write_text(json.dumps({"skill": skill}))
    stages = [{"name": "sft", "kind": "train", "script": "{fake}/fake_train.py", "config": "{fake}/sft.json",
               "out": "sft_model"},
              {"name": "grpo", "kind": "train", "script": "{fake}/fake_train.py", "config": "{fake}/grpo.json",
               "inputs": ["sft"], "out": "grpo_model", "args": ["--init", "{sft}"]},
              evaluation("sft"), evaluation("grpo")]
    text = json.dumps(stages).replace("{fake}", str(folder))
    return write_yaml(folder / "seeds.yaml", {"out": str(folder / "runs"), "launcher": "python",
                                              **top, "stages": json.loads(text)})


@pytest.fixture
def preset_file(tmp_path):
    return fake_preset(tmp_path, seeds=SEEDS, seed_stages=["grpo"])


def said(log: list[str]) -> dict[str, str]:
    return {line[4:].split(":")[0]: line.split(": ", 1)[1] for line in log if line.startswith("==> ")}


def run(preset, **kw) -> tuple[dict, list[str]]:
    log: list[str] = []
    state = run_pipeline(preset, log=log.append, **kw)
    return state, log


# ---- the preset ---------------------------------------------------------------------------------
def test_a_seeded_stage_and_its_evaluation_become_one_stage_per_seed(preset_file):
    preset = load_preset(preset_file)
    root = preset.out
    assert [s.name for s in preset.stages] == ["sft", "grpo_seed1", "grpo_seed2", "grpo_seed3", "eval_sft",
                                               "eval_grpo_seed1", "eval_grpo_seed2", "eval_grpo_seed3"]
    grpo2, eval2 = preset.stage("grpo_seed2"), preset.stage("eval_grpo_seed2")
    assert (grpo2.seed, grpo2.seed_of, grpo2.out, grpo2.inputs) == (2, "grpo", "grpo_model_seed2", ["sft"])
    assert command_args(preset, grpo2) == [["--config", str(preset_file.parent / "grpo.json"), "--init",
                                            str(root / "sft_model"), "--train.seed", "2", "--out",
                                            str(root / "grpo_model_seed2")]]
    assert (eval2.inputs, eval2.out) == (["grpo_seed2"], "eval/grpo_seed2")
    assert command_args(preset, eval2)[1] == [str(root / "grpo_model_seed2"), "--split", "dev", "--out",
                                              str(root / "eval" / "grpo_seed2" / "arith_dev.json")]
    assert "--train.seed" not in command_args(preset, preset.stage("sft"))[0]  # an unseeded stage: its config's seed
    # --seeds and --seed-stages override the preset's
    other = load_preset(preset_file, seeds=[7], seed_stages=["sft", "grpo"])
    assert [s.name for s in other.stages] == ["sft_seed7", "grpo_seed7", "eval_sft_seed7", "eval_grpo_seed7"]
    assert other.stage("grpo_seed7").inputs == ["sft_seed7"]  # a seeded stage reading one: the same seed's
    assert command_args(other, other.stage("grpo_seed7"))[0][3] == str(root / "sft_model_seed7")
    # --from/--to a seeded stage: its first/last seed
    before, chosen = select(preset, "grpo", "grpo")
    assert [s.name for s in before] == ["sft"]
    assert [s.name for s in chosen] == ["grpo_seed1", "grpo_seed2", "grpo_seed3"]
    assert [s.name for s in select(preset, "grpo_seed2", None)[1]][:2] == ["grpo_seed2", "grpo_seed3"]


def test_every_stage_reading_a_seeded_stage_runs_per_seed_too(tmp_path):
    path = fake_preset(tmp_path, seed_stages=["grpo"])
    assert [s.name for s in load_preset(path).stages][:2] == ["sft", "grpo"]  # seed_stages alone seeds nothing
    data = yaml.safe_load(path.read_text())
    data["stages"] += [{"name": "export", "kind": "prep", "script": "x.py", "inputs": ["grpo"], "out": "export",
                        "outputs": ["export/model.bin"], "args": ["{grpo}", "{out}"]},
                       {"name": "check", "kind": "prep", "script": "x.py", "inputs": ["export"], "args": ["{export}"]},
                       {"name": "after", "kind": "train", "script": "x.py", "inputs": ["sft", "export"],
                        "out": "after", "args": ["--init", "{sft}"]}]
    preset = load_preset(write_yaml(path, data), seeds=[1, 2], seed_stages=["grpo"])
    assert [s.name for s in preset.stages][6:] == ["export_seed1", "export_seed2", "check_seed1", "check_seed2",
                                                   "after_seed1", "after_seed2"]
    export2, after2 = preset.stage("export_seed2"), preset.stage("after_seed2")
    assert (export2.inputs, export2.out, export2.outputs) == (["grpo_seed2"], "export_seed2", ["export_seed2/model.bin"])
    assert command_args(preset, export2) == [[str(preset.out / "grpo_model_seed2"), str(preset.out / "export_seed2")]]
    assert (preset.stage("check_seed2").inputs, preset.stage("check_seed2").out) == (["export_seed2"], None)
    assert after2.inputs == ["sft", "export_seed2"] and command_args(preset, after2)[0][-4:] == \
        ["--train.seed", "2", "--out", str(preset.out / "after_seed2")]  # a trainer in the tail: the seed too


@pytest.mark.parametrize("top, cli, message", [
    ({"seeds": [1, 2]}, {}, r"seeds \[1, 2\] need the train stages run once per seed"),
    ({}, {"seed_stages": ["grpo"]}, "--seed-stages grpo: no seeds to run them with"),
    ({"seeds": [1, 1], "seed_stages": ["grpo"]}, {}, "seeds: expected distinct whole numbers >= 0"),
    ({"seed_stages": ["eval_grpo"]}, {}, "seed_stages: 'eval_grpo' is not a train stage"),
    ({"seeds": [1], "seed_stages": ["sft"], "loose": True}, {}, "stage loose: a seeded stage .* needs an out"),
])
def test_what_cannot_be_seeded_is_refused_in_one_line(tmp_path, top, cli, message):
    loose = top.pop("loose", False)
    path = fake_preset(tmp_path, **top)
    if loose:
        data = yaml.safe_load(path.read_text())
        data["stages"].append({"name": "loose", "kind": "prep", "script": "x.py", "inputs": ["sft"],
                               "outputs": ["a.txt"]})
        write_yaml(path, data)
    with pytest.raises(SproutError, match=message):
        load_preset(path, **cli)


# ---- running ------------------------------------------------------------------------------------
def test_each_seed_runs_from_the_same_earlier_stage_and_skips_resumes_reruns_by_itself(preset_file, monkeypatch):
    preset = load_preset(preset_file)
    root = preset.out
    monkeypatch.setenv("FAKE_FAIL_SEED", "2")
    with pytest.raises(StageFailed, match="stage grpo_seed2 failed"):
        run(preset)
    monkeypatch.delenv("FAKE_FAIL_SEED")
    state, log = run(preset)
    notes = said(log)
    assert notes["sft"].startswith("done, skipped") and notes["grpo_seed1"].startswith("done, skipped")
    assert notes["grpo_seed2"].startswith("resuming from its latest checkpoint")  # only the seed that was killed
    assert notes["grpo_seed3"] == "running"
    stages = state["stages"]
    assert all(rec["status"] == "done" for rec in stages.values()) and len(stages) == 8
    runs = {n: json.loads((root / f"grpo_model_seed{n}" / "run.json").read_text()) for n in SEEDS}
    assert [runs[n]["seed"] for n in SEEDS] == SEEDS
    assert {runs[n]["init"] for n in SEEDS} == {stages["sft"]["outputs"]["weights_sha256"]}  # the same SFT model
    assert {stages[f"grpo_seed{n}"]["inputs"]["upstream"]["sft"]["outputs"] for n in SEEDS} == \
        {stages["sft"]["output_hash"]}
    assert len({stages[f"grpo_seed{n}"]["outputs"]["weights_sha256"] for n in SEEDS}) == 3
    assert sorted(stages["eval_grpo_seed3"]["outputs"]) == ["eval/grpo_seed3/arith_dev.json",
                                                          "eval/grpo_seed3/arith_test.json"]
    # again: every stage skipped; one seed's evaluation lost: that one alone runs again
    assert all(v.startswith("done, skipped") for v in said(run(preset)[1]).values())
    (root / "eval" / "grpo_seed3" / "arith_dev.json").unlink()
    notes = said(run(preset)[1])
    assert [k for k, v in notes.items() if not v.startswith("done, skipped")] == ["eval_grpo_seed3"]
    # another seed added: it alone runs (with its evaluation)
    notes = said(run(load_preset(preset_file, seeds=[*SEEDS, 4]))[1])
    assert [k for k, v in notes.items() if not v.startswith("done, skipped")] == ["grpo_seed4", "eval_grpo_seed4"]


def test_run_pipeline_takes_seeds_on_its_command_line(tmp_path):
    path = fake_preset(tmp_path)  # no seeds in the preset
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_pipeline.py"), "--preset", str(path),
                           "--seeds", "5,6", "--seed-stages", "grpo", "--to", "grpo", "--no-report"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert list(read_state(tmp_path / "runs")["stages"]) == ["sft", "grpo_seed5", "grpo_seed6"]
    assert "--train.seed 6 --out" in proc.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_pipeline.py"), "--preset", str(path),
                          "--seeds", "5,x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--seeds: expected whole numbers separated by commas" in bad.stderr


# ---- the report card ----------------------------------------------------------------------------
def per_problem(root: Path, stage: str, split: str, key: str = "correct") -> dict[str, float]:
    data = json.loads((root / "eval" / stage / f"arith_{split}.json").read_text())
    return {p["id"]: p[key] / p["n"] for p in data["problems"]}


def test_the_report_card_shows_each_seed_their_mean_and_the_two_level_interval(preset_file):
    from sprout.pipeline.report_card import write_report_card
    preset = load_preset(preset_file)
    root = preset.out
    state, _ = run(preset)
    report = write_report_card(preset, state, answers=False).read_text()
    card = json.loads((root / "report" / "report_card.json").read_text())
    assert [r["stage"] for r in card["rows"]] == ["sft", "grpo_seed1", "grpo_seed2", "grpo_seed3"]
    held = card["held_out"]["arith"]
    assert f"### arith (test: {PROBLEMS} problems; dev: {PROBLEMS} problems)" in report
    assert "| stage | reading | pass@1 test | pass@1 dev |" in report
    # each seed's own figures, test with dev beside it, strict and flexible
    for n in SEEDS:
        for reading, figure in (("strict", "pass@1"), ("flexible", "flexible/pass@1")):
            cells = []
            for split in ("test", "dev"):
                metrics = json.loads((root / "eval" / f"grpo_seed{n}" / f"arith_{split}.json").read_text())["metrics"]
                lo, hi = metrics[f"{figure}_ci"]
                cells.append(f"{100 * metrics[figure]:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
                assert held["figures"][f"grpo_seed{n}"][split][figure] == {"value": metrics[figure], "ci": [lo, hi]}
            assert f"| grpo_seed{n} | {reading} | {cells[0]} | {cells[1]} |" in report
    # their mean, with the two-level interval over seeds and problems
    for reading, key, figure in (("strict", "correct", "pass@1"), ("flexible", "flexible_correct", "flexible/pass@1")):
        cells = []
        for split in ("test", "dev"):
            mean, lo, hi = seeds_mean_interval([per_problem(root, f"grpo_seed{n}", split, key) for n in SEEDS])
            assert held["seeds"]["grpo"]["figures"][split][figure]["value"] == pytest.approx(mean)
            assert held["seeds"]["grpo"]["figures"][split][figure]["ci"] == [lo, hi]
            cells.append(f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
        assert f"| grpo: mean of 3 seeds | {reading} | {cells[0]} | {cells[1]} |" in report
    assert held["seeds"]["grpo"]["stages"] == ["grpo_seed1", "grpo_seed2", "grpo_seed3"]
    # the change of the mean over seeds against SFT (one seed), on the test problems
    diff, lo, hi = seeds_paired_difference_interval(per_problem(root, "sft", "test"),
                                                    [per_problem(root, f"grpo_seed{n}", "test") for n in SEEDS])
    changes = {(c["stage"], c["figure"], c["vs"]): c for c in held["changes"]}
    mean_change = changes[("grpo: mean of 3 seeds", "pass@1", "previous")]
    assert (mean_change["diff"], mean_change["ci"], mean_change["seeds"]) == (pytest.approx(diff), [lo, hi], 3)
    assert diff > 0 and mean_change["real"] is (lo > 0)
    assert f"| grpo: mean of 3 seeds | pass@1 | sft | {100 * diff:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]" in report
    assert ("grpo_seed2", "flexible/pass@1", "first") in changes  # each seed's own change, each reading
    assert "| grpo_seed2 | flexible pass@1 | sft |" in report


def test_the_report_card_reads_prompt_file_evaluations_skips_rankings_and_refuses_a_task_without_split(preset_file):
    from sprout.pipeline.report_card import write_report_card
    from sprout.pipeline.report_held_out import evaluated_stages
    preset = load_preset(preset_file)
    state, _ = run(preset)
    folder = preset.out / "eval" / "sft"
    test = json.loads((folder / "arith_test.json").read_text())
    prompts = {**test, "task": None, "split": None, "prompts_file": "data/my_prompts.jsonl"}  # evaluate.py --prompts
    ranking = {"task": "preferences", "preferences_file": "prefs/preferences_test.jsonl", "metrics": {"accuracy": 0.5}}
    rl_dev = {**prompts, "prompts_file": "rl_prompts/prompts_dev.jsonl"}  # a dev prompt file: task prompts, dev
    for name, data in (("my_prompts.json", prompts), ("ranking.json", ranking), ("rl_dev.json", rl_dev)):
        (folder / name).write_text(json.dumps(data))
        state["stages"]["eval_sft"]["outputs"][f"eval/sft/{name}"] = "sha"
    evaluated = evaluated_stages(preset, state)
    assert sorted(evaluated["sft"]) == ["arith", "my_prompts", "prompts"]  # the ranking is not a held-out task's
    assert evaluated["sft"]["my_prompts"] == {"test": prompts}  # a prompt file: named by its stem, under test
    assert evaluated["sft"]["prompts"] == {"dev": rl_dev}
    report = write_report_card(preset, state, answers=False).read_text()
    assert f"### my_prompts (test: {PROBLEMS} problems)" in report and "| sft | strict |" in report
    del test["split"]  # a task's evaluation without a split: refused, naming the file
    (folder / "arith_test.json").write_text(json.dumps(test))
    with pytest.raises(SproutError, match=f"{folder / 'arith_test.json'}: split None is not one of test, dev"):
        evaluated_stages(preset, state)
