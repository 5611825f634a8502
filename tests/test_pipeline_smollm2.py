"""The smollm2 preset (configs/pipelines/smollm2.yaml) end to end, every stage of it, on a tiny model.

The preset is read from the repository and kept as it is: its stage list, scripts, inputs and
args. Only what makes it slow changes: `--model` is the `tiny_llama` fixture (a random tiny
Llama folder with a ChatML byte-level BPE tokenizer) in place of the 135M GGUF; each stage's
config is a copy of the repository's under tmp_path with 2 training steps, tiny batches and
data counts, and its eval and checkpoint cadence capped at 2 steps; each evaluate.py command
has tiny --max-examples, --n, --max-new-tokens and --batch-size. GSM8K comes from the data
mirror (`${SPROUT_MIRROR}`, the `mirror` fixture). A change of the preset's wiring (a stage
renamed, an input dropped, a flag a script no longer takes) fails here.

Checked: every stage runs; the report card's figures are the stages' own (each train stage's
metrics.jsonl, each eval stage's JSON files); every stage has its peak RSS recorded and shown;
the cross-stage tables list each policy; a second run skips every stage.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from sprout.engine.metrics import read_metrics
from sprout.pipeline.runner import read_state
from test_pipeline import notes, run, write_yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "pipelines" / "smollm2.yaml"
STEPS = 2
EVAL_FLAGS = {"--max-examples": "4", "--max-new-tokens": "8", "--batch-size": "4"}  # and --n: see tiny_eval
POLICIES = ("sft", "dpo", "ppo", "grpo")  # the train stages a policy comes out of, in order
ROLLOUTS = {"data": {"eval_prompts": 2, "eval_batch": 2}, "rollout": {"max_completion_length": 8}}
COUNTS = {"sft_data": 16, "preferences": 16, "rl_prompts": 8}  # problems each generated source makes (`count`)
CHANGES = {  # stage: what its config copy changes (merged into the repository's config)
    "sft_data": {"seq_len": 512, "val_fraction": 0.25, "max_examples": 16},  # records read per source
    "sft": {"batch": {"global_tokens": 1024, "micro_tokens": 512}},
    "preferences": {"test_fraction": 0.25},
    "reward": {"batch": {"global_pairs": 2, "micro_pairs": 1}},
    "dpo": {"batch": {"global_pairs": 2, "micro_pairs": 1}},
    "rl_prompts": {},
    "ppo": {**ROLLOUTS, "batch": {"global_prompts": 2, "num_generations": 2, "micro_completions": 1,
                                  "num_mini_batches": 2}},  # 2 steps: one generation batch, 2 mini-batches
    "grpo": {**ROLLOUTS, "data": {**ROLLOUTS["data"], "eval_num_generations": 2},
             "batch": {"global_prompts": 2, "num_generations": 2, "micro_completions": 2}},
}


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(base.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def tiny_config(stage: dict, folder: Path) -> str:
    """A copy of the stage's config under `folder`: CHANGES[stage], COUNTS[stage] problems from each
    generated source, and for a trainer 2 steps with every nonzero eval and checkpoint cadence
    capped at 2 (0 stays 0: before and after training)."""
    data = yaml.safe_load((ROOT / stage["config"]).read_text())
    data = merged(data, CHANGES[stage["name"]])
    for source in data.get("sources", []):
        if "count" in source:
            source["count"] = COUNTS[stage["name"]]
    if stage["kind"] == "train":
        train = data["train"]
        train.update(max_steps=STEPS, log_every=1, keep_checkpoints=1, peak_tflops=-1)
        for key in ("eval_every", "ckpt_every"):
            train[key] = min(train[key], STEPS)
        data["optim"]["warmup_steps"] = min(data["optim"]["warmup_steps"], STEPS - 1)
    path = folder / f"{stage['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def tiny_eval(args: list[str]) -> list[str]:
    """An evaluate.py command with EVAL_FLAGS' values, and --n the largest --k (pass@k needs k <=
    n; 0, greedy only, stays 0); every flag must be in the preset's command."""
    args = list(args)
    for flag in (*EVAL_FLAGS, "--n"):
        assert flag in args, f"the preset's evaluate.py command has no {flag}: {args}"
        i = args.index(flag) + 1
        ks = args[args.index("--k") + 1] if "--k" in args else "1"
        args[i] = EVAL_FLAGS.get(flag) or ("0" if args[i] == "0" else str(max(int(k) for k in ks.split(","))))
    return args


def tiny_preset(folder: Path) -> tuple[Path, dict]:
    """The repository's smollm2 preset with tiny configs and evaluations, written under `folder`;
    returns its path and the preset as written."""
    folder.mkdir(parents=True, exist_ok=True)
    preset = yaml.safe_load(PRESET.read_text())
    assert set(CHANGES) == {s["name"] for s in preset["stages"] if s.get("config")}, "a stage config is new or gone"
    for stage in preset["stages"]:
        if stage.get("config"):
            stage["config"] = tiny_config(stage, folder)
        if stage["kind"] == "eval":
            stage["args"] = [tiny_eval(args) for args in stage["args"]]
    preset["out"] = str(folder / "runs")
    return write_yaml(folder / "smollm2.yaml", preset), preset


@pytest.fixture(scope="module")
def smol(tiny_llama, mirror, tmp_path_factory):
    """One run of the tiny smollm2 preset: (preset path, the preset as written, output root)."""
    folder = tmp_path_factory.mktemp("smollm2")
    path, preset = tiny_preset(folder)
    proc = run(path, "--model", str(tiny_llama), "--mirror", str(mirror), timeout=3600)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return path, preset, folder / "runs"


def train_stages(preset: dict) -> list[str]:
    return [s["name"] for s in preset["stages"] if s["kind"] == "train"]


def eval_jsons(preset: dict, out: Path, stage: str) -> dict[str, dict[str, dict]]:
    """{task: {split: evaluate.py's JSON}} of the eval stage whose input is `stage`."""
    (evaluation,) = [s for s in preset["stages"] if s["kind"] == "eval" and s["inputs"] == [stage]]
    found: dict[str, dict[str, dict]] = {}
    for rel in read_state(out)["stages"][evaluation["name"]]["outputs"]:
        data = json.loads((out / rel).read_text())
        found.setdefault(data["task"], {})[data["split"]] = data
    return found


def last(out: Path, run: str, key: str):
    """The last record of `key` in a train stage's metrics.jsonl (its last eval, for a val_ key)."""
    return [r for r in read_metrics(out / run / "metrics.jsonl") if key in r and "event" not in r][-1][key]


def cell(value, decimals: int) -> str:
    return "–" if value is None else f"{value:.{decimals}f}"


def test_every_stage_of_the_preset_runs(smol, tiny_llama):
    _, preset, out = smol
    state = read_state(out)["stages"]
    assert list(state) == [s["name"] for s in preset["stages"]]
    assert all(rec["status"] == "done" for rec in state.values())
    assert state["import"]["inputs"]["commands"][0][0] == str(tiny_llama)  # --model, not the preset's GGUF
    assert {name: state[name]["outputs"]["step"] for name in train_stages(preset)} == \
        {"sft": STEPS, "reward": STEPS, "dpo": STEPS, "ppo": STEPS, "grpo": STEPS}
    for evaluation in (s for s in preset["stages"] if s["kind"] == "eval"):
        settings = [json.loads((out / rel).read_text())["settings"] for rel in state[evaluation["name"]]["outputs"]]
        assert [(d["max_examples"], d["max_new_tokens"], d["batch_size"], d["n"]) for d in settings] == \
            [(4, 8, 4, 8), (4, 8, 4, 8), (4, 8, 4, 0), (4, 8, 4, 0)], evaluation["name"]  # arith, GSM8K: dev, test
    assert (out / "export" / "model.safetensors").is_file() and (out / "sft" / "loss_mask.html").is_file()


def test_report_card_figures_are_the_stages_own_metrics(smol):
    from sprout.evaluation.statistics import wilson_interval
    _, preset, out = smol
    state = read_state(out)["stages"]
    rows = {r["stage"]: r for r in json.loads((out / "report" / "report_card.json").read_text())["rows"]}
    assert list(rows) == train_stages(preset)
    report = (out / "report.md").read_text()
    runs = {s["name"]: s["out"] for s in preset["stages"]}
    for stage, row in rows.items():
        assert (row["step"], row["weights_sha256"]) == (STEPS, state[stage]["outputs"]["weights_sha256"])
        speeds = [r["tokens_per_s"] for r in read_metrics(out / runs[stage] / "metrics.jsonl") if "tokens_per_s" in r]
        assert row["tokens_per_s"] == pytest.approx(sum(speeds) / len(speeds))
        # the held-out task columns: the figures of the JSON files of the eval stage that read this stage
        tasks = eval_jsons(preset, out, stage) if stage in POLICIES else {}
        arith, gsm8k = (tasks.get(t, {}).get("test", {}).get("metrics", {}) for t in ("arith", "gsm8k"))
        assert (row["arith_pass@1"], row["arith_pass@8"], row["mean_length"], row["gsm8k_pass@1"]) == \
            (arith.get("pass@1"), arith.get("pass@8"), arith.get("completions/mean_length"), gsm8k.get("pass@1"))
        assert (row["arith_greedy"], row["gsm8k_greedy"]) == (arith.get("greedy/accuracy"), gsm8k.get("greedy/accuracy"))
        assert (row["arith_pass@1"] is not None) == (stage in POLICIES)
        # the stage's own last eval: SFT's masked val loss, the reward model's and DPO's accuracy
        want = {"sft_val_loss": last(out, runs[stage], "val_loss") if stage == "sft" else None,
                "rm_val_accuracy": last(out, runs[stage], "val_accuracy") if stage == "reward" else None,
                "dpo_val_accuracy": last(out, runs[stage], "val_rewards/accuracies") if stage == "dpo" else None}
        assert {k: row[k] for k in want} == want and row["val_bpb"] is None
        assert row["gsm8k_pass@1"] is None  # GSM8K is greedy only (--n 0): no pass@1, so no column of dashes
        line = (f"| {stage} | {STEPS} | {cell(want['sft_val_loss'], 4)} | {cell(want['rm_val_accuracy'], 3)} | "
                f"{cell(want['dpo_val_accuracy'], 3)} | {cell(row['arith_pass@1'], 3)} | {cell(row['arith_pass@8'], 3)} "
                f"| {cell(row['arith_greedy'], 3)} | {cell(row['gsm8k_greedy'], 3)} | {cell(row['mean_length'], 1)} |")
        assert line in report.splitlines(), line
    header = ("| stage | step | SFT val masked loss | RM val accuracy | DPO val reward accuracy | arith pass@1 | "
              "arith pass@8 | arith greedy accuracy | GSM8K greedy accuracy | mean completion length |")
    assert header in report.splitlines()
    for stage, key, col in (("reward", "val_accuracy", "rm_val_accuracy"),
                            ("dpo", "val_rewards/accuracies", "dpo_val_accuracy")):
        pairs = last(out, runs[stage], "val_pairs")
        lo, hi = wilson_interval(round(last(out, runs[stage], key) * pairs), pairs)
        assert rows[stage][f"{col}_ci"] == [lo, hi]
        evals = [r for r in read_metrics(out / runs[stage] / "metrics.jsonl") if key in r]
        assert f"{stage} (held-out pairs, step {evals[0]['step']} -> {evals[-1]['step']}):" in report
        assert f"  {key:28s} {evals[0][key]:8.3f} -> {evals[-1][key]:8.3f}   (of {pairs:,.0f} pairs)   " \
               f"95 % [{lo:.3f}, {hi:.3f}]" in report


def test_held_out_tables_list_the_import_and_each_policy_with_its_eval_files(smol):
    _, preset, out = smol
    held_out = json.loads((out / "report" / "report_card.json").read_text())["held_out"]
    report = (out / "report.md").read_text()
    evaluated = ("import", *POLICIES)
    jsons = {stage: eval_jsons(preset, out, stage) for stage in evaluated}
    assert set(held_out) == {"arith", "gsm8k"}
    def cell(metrics: dict, f: str) -> str:
        if metrics.get(f) is None:
            return "–"
        ci = metrics.get(f"{f}_ci")
        return f"{100 * metrics[f]:.1f}" + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")

    for task, section in held_out.items():
        assert list(section["figures"]) == list(evaluated)
        splits = [sp for sp in ("test", "dev") if any(sp in jsons[stage][task] for stage in evaluated)]
        named = list(section["figures"]["sft"]["test"])
        for stage, by_split in section["figures"].items():
            for split, figures in by_split.items():  # each split's file, strict and flexible figures
                metrics = jsons[stage][task][split]["metrics"]
                assert figures == {f: {"value": metrics.get(f), "ci": metrics.get(f"{f}_ci")} for f in figures}
            strict = [f for f in named if not f.startswith("flexible/")]  # test with dev beside it
            cells = [cell(jsons[stage][task][sp]["metrics"], f) for f in strict for sp in splits]
            assert f"| {stage} | strict | " + " | ".join(cells) + " |" in report.splitlines(), (task, stage)
        changed = [f for f in named if f.removeprefix("flexible/").startswith("pass@")
                   or f.removeprefix("flexible/") == "greedy/accuracy"]
        got = {(c["stage"], c["figure"], c["vs"]): c["against"] for c in section["changes"]}
        assert got == {(stage, f, vs): against for previous, stage in zip(evaluated, evaluated[1:]) for f in changed
                       for vs, against in (("previous", previous), ("first", "import"))}, task
    assert set(held_out["arith"]["figures"]["sft"]["test"]) >= {"pass@1", "pass@8", "greedy/accuracy"}
    answers = json.loads((out / "report" / "answers.json").read_text())
    assert set(answers) == set(POLICIES) and all(len(a["answers"]) == 3 for a in answers.values())
    for png in ("loss_curves.png", "reward_model.png", "dpo.png", "rl.png", "pass_at_1.png"):
        assert (out / "report" / png).read_bytes()[:4] == b"\x89PNG"


def test_every_stage_has_its_peak_rss_recorded_and_shown(smol):
    _, preset, out = smol
    state = read_state(out)["stages"]
    report = (out / "report.md").read_text()
    for stage in preset["stages"]:
        rss = state[stage["name"]]["peak_rss_mb"]
        with_torch = stage["kind"] != "prep" or stage["name"] in ("import", "export")
        assert (100 if with_torch else 10) < rss < 24 * 1024, (stage["name"], rss)
        assert re.search(rf"\| {stage['name']} \| {stage['kind']} \| [^|]+ \| {rss / 1024:.2f} GiB \|", report), \
            stage["name"]


def test_a_second_run_skips_every_stage(smol, tiny_llama, mirror):
    path, preset, out = smol
    before = (out / "pipeline_state.json").read_text()
    proc = run(path, "--model", str(tiny_llama), "--mirror", str(mirror), "--no-report")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = notes(proc)
    assert list(said) == [s["name"] for s in preset["stages"]]
    assert all(v.startswith("done, skipped") for v in said.values()), said
    assert (out / "pipeline_state.json").read_text() == before
