"""Sweeps and --set (sprout.pipeline.sweep, run_pipeline.py --sweep/--set) on the fake preset of
test_pipeline_seeds: sft -> grpo, each evaluated on test and dev. Its fake trainer here also
takes --optim.lr, and its skill (what the fake evaluator scores) grows with it.

Checked: a swept stage becomes one stage per setting, each with its option, each evaluated right
after it on dev only (a test command is dropped), and what else reads it is left out; bad
options and what cannot be swept are refused in one line; the runs never write a test file; the
table chooses the best dev figure, pairs every change on the same problems, and tells how to run
the choice with --set; --set changes the stage's inputs, so it runs again.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from sprout.errors import SproutError
from sprout.pipeline.runner import read_state, run_pipeline
from sprout.pipeline.preset import command_args, load_preset, select
from sprout.pipeline.sweep import parse_option, parse_select, reads_dev_only
from sprout.pipeline.sweep_table import write_sweep_table
from tests.test_pipeline_seeds import FAKE_TRAIN, ROOT, fake_preset, write_yaml

# the fake trainer with --optim.lr: skill = the config's + round(lr * 10)
LR_TRAIN = FAKE_TRAIN.replace(
    'p.add_argument("--train.seed", dest="seed", type=int, default=1337)',
    'p.add_argument("--train.seed", dest="seed", type=int, default=1337)\n'
    'p.add_argument("--optim.lr", dest="lr", type=float, default=0.0)').replace(
    'json.loads(Path(args.config).read_text())["skill"]}',
    'json.loads(Path(args.config).read_text())["skill"] + round(args.lr * 10)}')
LR_TRAIN = LR_TRAIN.replace(  # three training records; the median step time is 3.0 s
    'json.dumps({"step": 1, "loss": 1.0 / (1 + run["skill"])}) + "\\n")',
    '"".join(json.dumps({"step": i, "loss": 1.0, "step_time_s": t}) + "\\n" for i, t in ((1, 2.0), (2, 9.0), (3, 3.0))))')
LR_TRAIN = LR_TRAIN.replace("sys.exit(1)", 'sys.exit(int(os.environ.get("FAKE_FAIL_CODE", "1")))')  # 143: SIGTERM
assert LR_TRAIN.count("args.lr") == 1 and LR_TRAIN.count("step_time_s") == 1 and "FAKE_FAIL_CODE" in LR_TRAIN


@pytest.fixture
def sweep_preset(tmp_path):
    path = fake_preset(tmp_path)
    (tmp_path / "fake_train.py").write_text(LR_TRAIN)
    (tmp_path / "grpo.json").write_text(json.dumps({"skill": 0}))
    return path


def sweeps(*texts):
    return [parse_option(t, many=True) for t in texts]


def test_a_swept_stage_runs_once_per_setting_each_evaluated_on_dev_right_after_it(sweep_preset):
    data = yaml.safe_load(sweep_preset.read_text())
    data["stages"] += [{"name": "export", "kind": "prep", "script": "x.py", "inputs": ["grpo"], "out": "export",
                        "args": ["{grpo}"]},
                       {"name": "eval_export", "kind": "eval", "script": "x.py", "inputs": ["export"],
                        "out": "eval/export", "args": ["{export}", "--split", "dev"]}]
    preset = load_preset(write_yaml(sweep_preset, data), sweeps=sweeps("grpo:optim.lr=0.1,0.2", "grpo:train.seed=7"))
    root = preset.out
    assert [s.name for s in preset.stages] == ["sft", "grpo_lr0_1_seed7", "eval_grpo_lr0_1_seed7", "grpo_lr0_2_seed7",
                                               "eval_grpo_lr0_2_seed7", "eval_sft"]  # export and its eval: left out
    grpo = preset.stage("grpo_lr0_2_seed7")
    assert (grpo.out, grpo.sweep_of, grpo.setting) == ("grpo_model_lr0.2_seed7", "grpo",
                                                       {"optim.lr": "0.2", "train.seed": "7"})
    assert command_args(preset, grpo) == [["--config", str(sweep_preset.parent / "grpo.json"), "--init",
                                           str(root / "sft_model"), "--optim.lr", "0.2", "--train.seed", "7",
                                           "--out", str(root / "grpo_model_lr0.2_seed7")]]
    ev = preset.stage("eval_grpo_lr0_2_seed7")
    assert (ev.inputs, ev.out, ev.sweep_of) == (["grpo_lr0_2_seed7"], "eval/grpo_lr0.2_seed7", "eval_grpo")
    assert command_args(preset, ev) == [[str(root / "grpo_model_lr0.2_seed7"), "--split", "dev", "--out",
                                         str(root / "eval" / "grpo_lr0.2_seed7" / "arith_dev.json")]]
    assert command_args(preset, preset.stage("eval_sft"))[0][2] == "test"  # not swept: both splits
    before, chosen = select(preset, "grpo", "eval_grpo_lr0_2_seed7")  # the swept name: its first setting
    assert [s.name for s in before] == ["sft"] and chosen[-1].name == "eval_grpo_lr0_2_seed7"
    with pytest.raises(SproutError, match="eval_grpo: a swept stage's evaluation runs right after each setting; "
                                          "name one setting's .eval_grpo_lr0_1_seed7."):
        select(preset, "eval_grpo", None)  # it would train the later settings again


def test_a_tag_names_each_option_by_its_last_part_unless_two_share_it():
    from sprout.pipeline.sweep import tag_of

    assert tag_of({"optim.lr": "2e-5", "train.seed": "1"}) == "lr2e-5_seed1"
    assert tag_of({"optim.lr": "1e-4", "ppo.lr": "1e-3"}) == "optim_lr1e-4_ppo_lr1e-3"


def test_only_commands_shown_to_read_dev_are_kept():
    assert reads_dev_only(["ckpt", "--split", "dev"]) and reads_dev_only(["ckpt", "--split=dev"])
    assert reads_dev_only(["ckpt", "--task", "arith"])  # evaluate.py's default split is dev
    assert reads_dev_only(["ckpt", "--prompts", "rl/prompts_dev.jsonl"])
    assert not reads_dev_only(["ckpt", "--split", "test"]) and not reads_dev_only(["ckpt", "--split=test"])
    assert not reads_dev_only(["ckpt", "--task", "arith", "--out", "x/arith_test.json"])
    assert not reads_dev_only(["ckpt", "--prompts", "heldout.jsonl"])  # not shown to be dev: dropped


def test_a_stage_reading_a_swept_evaluation_is_left_out_and_a_file_out_keeps_its_suffix(sweep_preset):
    data = yaml.safe_load(sweep_preset.read_text())
    data["stages"][3]["out"] = "eval/grpo.json"
    data["stages"][3]["args"] = [["{grpo}", "--split", "dev", "--out", "{out}"]]
    data["stages"].append({"name": "summary", "kind": "prep", "script": "x.py", "inputs": ["eval_grpo"],
                           "out": "summary.md", "args": ["{eval_grpo}"]})
    preset = load_preset(write_yaml(sweep_preset, data), sweeps=sweeps("grpo:optim.lr=0.1,0.2"))
    assert [s.name for s in preset.stages] == ["sft", "grpo_lr0_1", "eval_grpo_lr0_1", "grpo_lr0_2", "eval_grpo_lr0_2",
                                               "eval_sft"]
    assert preset.stage("eval_grpo_lr0_2").out == "eval/grpo_lr0.2.json"


@pytest.mark.parametrize("option, many, message", [
    ("grpo", True, "--sweep grpo: expected STAGE:KEY=VALUE,VALUE"),
    ("grpo:optim.lr", True, "expected STAGE:KEY=VALUE"),
    ("grpo:optim..lr=1", True, "'optim..lr' is not an option name"),
    ("grpo:optim.lr=1,", True, "each value must be letters, digits"),
    ("grpo:optim.lr=a/b", True, "each value must be"),
    ("grpo:optim.lr=1,1", True, "a value is listed twice"),
    ("grpo:optim.lr=1e-5,1E-5", True, "a value is listed twice"),  # the same number
    ("grpo:optim.lr=1,2", False, "--set grpo:optim.lr=1,2: one value only"),
])
def test_a_malformed_option_is_refused_in_one_line(option, many, message):
    with pytest.raises(SproutError, match=message):
        parse_option(option, many=many)


@pytest.mark.parametrize("kw, message", [
    ({"sweeps": sweeps("eval_grpo:x=1")}, "--sweep eval_grpo: not a train stage"),
    ({"sweeps": sweeps("grpo:x=1", "sft:y=2")}, "one stage at a time"),
    ({"sweeps": sweeps("grpo:x=1", "grpo:x=2")}, "an option is swept twice"),
    ({"sweeps": sweeps("grpo:x=1"), "sweep_tasks": ["gsm8k"]}, "no eval stage .* reads grpo with a dev command for gsm8k"),
    ({"sweeps": sweeps("grpo:x=1"), "seeds": [1, 2], "seed_stages": ["grpo"]}, "--sweep grpo with --seeds"),
    ({"sets": [parse_option("ppo:x=1", many=False)]}, "--set ppo:x: .* has no stage 'ppo'"),
    ({"sets": [parse_option("grpo:x=1", many=False)] * 2}, "--set grpo:x: set twice"),
    ({"sets": [parse_option("grpo:optim.lr=9", many=False)], "sweeps": sweeps("grpo:optim.lr=0.1,0.2")},
     "--set grpo:optim.lr: optim.lr is also swept"),
    ({"sets": [parse_option("grpo:train.seed=9", many=False)], "seeds": [1], "seed_stages": ["grpo"]},
     "--set grpo:train.seed: grpo is seeded"),
])
def test_what_cannot_be_swept_or_set_is_refused_in_one_line(sweep_preset, kw, message):
    with pytest.raises(SproutError, match=message):
        load_preset(sweep_preset, **kw)


def test_no_test_split_is_read_and_the_table_chooses_the_best_dev_figure(sweep_preset):
    preset = load_preset(sweep_preset, sweeps=sweeps("grpo:optim.lr=0.1,0.3,0.2", "grpo:train.seed=5"))
    root = preset.out
    state = run_pipeline(preset, log=lambda *_: None)
    assert all(rec["status"] == "done" for rec in state["stages"].values())
    written = sorted(p.relative_to(root).as_posix() for p in (root / "eval").rglob("*.json"))
    assert written == ["eval/grpo_lr0.1_seed5/arith_dev.json", "eval/grpo_lr0.2_seed5/arith_dev.json",
                       "eval/grpo_lr0.3_seed5/arith_dev.json", "eval/sft/arith_dev.json", "eval/sft/arith_test.json"]
    chose = []
    md = write_sweep_table(preset, state, log=chose.append)
    table = json.loads((root / "sweep_grpo.json").read_text())
    assert {s["setting"]["train.seed"] for s in table["settings"]} == {"5"}
    assert {s["step_time_s"] for s in table["settings"]} == {3.0}
    dev = {s["setting"]["optim.lr"]: s["dev"]["arith"]["pass@1"]["value"] for s in table["settings"]}
    best = max(dev, key=dev.get)
    assert dev["0.3"] > dev["0.1"] and best == "0.3"  # skill grows with lr in the fake trainer
    assert table["chosen"] == {"optim.lr": "0.3", "train.seed": "5"} and table["select"] == ["arith", "pass@1"]
    assert chose == ["sweep: chosen on dev optim.lr=0.3, train.seed=5 (of 3 settings)"]
    text = md.read_text()
    assert "Settings tried: 3 (optim.lr = 0.1, 0.3, 0.2; train.seed = 5)" in text
    assert "no setting's test split was read" in text
    assert "Run it with `--set grpo:optim.lr=0.3` and the seeds to report (`--seeds N,N,...`), and the options the " \
        "first setting's command shows." in text
    first = f"--optim.lr 0.1 --train.seed 5 --out {root / 'grpo_model_lr0.1_seed5'}`"
    assert "First setting's training command: `python " in text and first in text
    assert "| sft (start) | done | 23.8" in text and "| optim.lr=0.3, train.seed=5 (chosen) | done |" in text
    # every change is paired on the same dev problems: recompute one from the files
    sft = json.loads((root / "eval" / "sft" / "arith_dev.json").read_text())["problems"]
    low = json.loads((root / "eval" / "grpo_lr0.1_seed5" / "arith_dev.json").read_text())["problems"]
    vs_sft = next(s for s in table["settings"] if s["setting"]["optim.lr"] == "0.1")["changes"]["arith/pass@1 vs sft"]
    expected = sum(b["correct"] / b["n"] - a["correct"] / a["n"] for a, b in zip(sft, low)) / len(sft)
    assert vs_sft["diff"] == pytest.approx(expected) and vs_sft["problems"] == len(sft)
    chosen_row = next(s for s in table["settings"] if s["setting"]["optim.lr"] == "0.3")
    assert chosen_row["changes"]["arith/pass@1 vs chosen"] is None  # not against itself
    with pytest.raises(SproutError, match=r"--sweep-select arith:pass@2: no setting's dev evaluation has it "
                                          r"\(they have arith: flexible/pass@1, pass@1, prompts\)"):
        write_sweep_table(preset, state, ("arith", "pass@2"))
    # selecting by another figure (flexible pass@1) is honoured
    assert parse_select("arith:flexible/pass@1") == ("arith", "flexible/pass@1")
    write_sweep_table(preset, state, ("arith", "flexible/pass@1"), log=lambda *_: None)
    assert json.loads((root / "sweep_grpo.json").read_text())["select"] == ["arith", "flexible/pass@1"]


def test_the_start_row_is_the_start_stage_own_evaluation_even_when_a_setting_evaluation_reads_it_too(sweep_preset):
    data = yaml.safe_load(sweep_preset.read_text())
    stages = {s["name"]: s for s in data["stages"]}
    stages["eval_grpo"]["inputs"] = ["sft", "grpo"]  # a setting's evaluation reads the start stage as well
    data["stages"] = [stages[n] for n in ("sft", "eval_sft", "grpo", "eval_grpo")]
    preset = load_preset(write_yaml(sweep_preset, data), sweeps=sweeps("grpo:optim.lr=0.3"))
    state = run_pipeline(preset, log=lambda *_: None)
    write_sweep_table(preset, state, log=lambda *_: None)
    table = json.loads((preset.out / "sweep_grpo.json").read_text())
    sft = json.loads((preset.out / "eval" / "sft" / "arith_dev.json").read_text())["metrics"]["pass@1"]
    change = table["settings"][0]["changes"]["arith/pass@1 vs sft"]
    assert change["diff"] == pytest.approx(table["settings"][0]["dev"]["arith"]["pass@1"]["value"] - sft)


def test_a_failed_setting_is_passed_over_and_the_others_go_on(sweep_preset, monkeypatch):
    from sprout.pipeline.runner import StageFailed

    preset = load_preset(sweep_preset, sweeps=sweeps("grpo:train.seed=1,2,3"))
    monkeypatch.setenv("FAKE_FAIL_SEED", "2")  # the fake trainer exits after its first checkpoint
    monkeypatch.setenv("FAKE_FAIL_CODE", "143")  # as a trainer stopped by SIGTERM: the sweep stops there
    stopping = load_preset(sweep_preset, out=sweep_preset.parent / "stopped", sweeps=sweeps("grpo:train.seed=1,2,3"))
    with pytest.raises(StageFailed, match="stage grpo_seed2 was interrupted") as stopped:
        run_pipeline(stopping, log=lambda *_: None)
    assert stopped.value.interrupted and "grpo_seed3" not in read_state(stopping.out)["stages"]
    monkeypatch.delenv("FAKE_FAIL_CODE")  # exit 1: a failure of its own
    log: list[str] = []
    with pytest.raises(StageFailed, match=r"1 setting\(s\) failed: grpo_seed2 "):
        run_pipeline(preset, log=log.append)
    assert "==> grpo_seed2: failed; the other settings go on" in log
    assert "==> eval_grpo_seed2: passed over (it reads a failed setting)" in log
    stages = read_state(preset.out)["stages"]
    assert stages["eval_grpo_seed3"]["status"] == "done" and stages["eval_sft"]["status"] == "done"
    assert "eval_grpo_seed2" not in stages
    monkeypatch.delenv("FAKE_FAIL_SEED")
    log = []
    run_pipeline(preset, log=log.append)  # the same command resumes the failed setting alone
    assert f"==> grpo_seed2: resuming from its latest checkpoint ({preset.out / 'grpo_model_seed2'})" in log
    assert [line.split(":")[0] for line in log if line.startswith("==> ") and "skipped" not in line] == \
        ["==> grpo_seed2", "==> eval_grpo_seed2"]


def test_set_gives_a_stage_its_option_and_runs_it_again(sweep_preset):
    preset = load_preset(sweep_preset)
    run_pipeline(preset, log=lambda *_: None)
    chosen = load_preset(sweep_preset, sets=[parse_option("grpo:optim.lr=0.3", many=False)])
    assert command_args(chosen, chosen.stage("grpo"))[0][-4:-2] == ["--optim.lr", "0.3"]
    log: list[str] = []
    run_pipeline(chosen, log=log.append)
    assert "==> grpo: inputs changed, running it again" in log
    assert json.loads((chosen.out / "grpo_model" / "run.json").read_text())["skill"] == 3


def test_run_pipeline_sweeps_from_its_command_line_and_keeps_the_sweep_out_of_the_report_card(sweep_preset):
    cmd = [sys.executable, str(ROOT / "scripts" / "run_pipeline.py"), "--preset", str(sweep_preset)]
    proc = subprocess.run(cmd + ["--sweep", "grpo:optim.lr=0.1,0.2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    root = sweep_preset.parent / "runs"
    assert "sweep: chosen on dev optim.lr=0.2 (of 2 settings)" in proc.stdout
    assert not (root / "report.md").exists()  # a sweep leaves the root's report card as it is
    assert f"Sweep: `python scripts/run_pipeline.py --preset {sweep_preset} --sweep grpo:optim.lr=0.1,0.2`" \
        in (root / "sweep_grpo.md").read_text()
    assert (root / "sweep_grpo.md").is_file() and not (root / "sweep_grpo.png").exists()  # no curves logged
    state = read_state(root)
    assert list(state["stages"]) == ["sft", "grpo_lr0_1", "eval_grpo_lr0_1", "grpo_lr0_2", "eval_grpo_lr0_2",
                                     "eval_sft"]
    (root / "sweep_grpo.md").unlink()
    again = subprocess.run(cmd + ["--sweep", "grpo:optim.lr=0.1,0.2", "--report-only"], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "==> grpo_lr0_1" not in again.stdout  # runs nothing, writes the table
    assert (root / "sweep_grpo.md").is_file() and not (root / "report.md").exists()
    bad = subprocess.run(cmd + ["--sweep", "grpo:optim.lr"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "error: --sweep grpo:optim.lr: expected STAGE:KEY=VALUE" in bad.stderr
    assert bad.stderr.count("\n") == 1  # one line, no traceback
