"""The report card's held-out evaluations with 95 % intervals, and each policy's change on the same problems.

    evaluated = evaluated_stages(preset, state)   # {stage: {task: evaluate.py's JSON}}, preset order
    lines, data = held_out_section(evaluated)     # markdown lines, and what report_card.json keeps

The stages read are those an eval stage evaluated (`eval_files`): train stages, and any stage (a
model import) whose out folder holds the checkpoint the JSON names. Figures: each stage's pass@k,
greedy accuracy and greedy and sampled format rate in percent, with the 95 % interval
scripts/evaluate.py wrote beside each (`<figure>_ci`), or alone when the file has none. Changes,
from the second evaluated stage on: each correctness figure (pass@k, greedy accuracy) against the
previous evaluated stage and against the first, in percentage points: the mean over problems of
this stage's score minus the other's (the files' `problems` records), with the paired bootstrap
interval (`sprout.evaluation.statistics.paired_difference_interval`); ✓ only when it excludes 0,
else "not significant". Files pair only with the same problem ids and max_new_tokens (and, for
pass@k, temperature); otherwise the cell says why. `rate_interval`: the Wilson interval of the
reward model's and DPO's held-out accuracy, round(accuracy × pairs) right of `val_pairs` pairs.
"""

from __future__ import annotations

import json
from pathlib import Path

from sprout.evaluation.evaluate import problem_scores
from sprout.evaluation.statistics import excludes_zero, paired_difference_interval, wilson_interval

FIGURE_TITLES = {"greedy/accuracy": "greedy accuracy", "greedy/format_rate": "greedy format rate",
                 "format/rate": "format rate"}  # after every pass@k, in this order
CHANGED = ("greedy/accuracy",)  # with every pass@k: the figures whose change is shown
REAL, NOT_REAL = "✓", "not significant"


def eval_files(preset, stage_name: str, state: dict) -> dict[str, dict]:
    """{task: the evaluate.py JSON} for every done eval stage that reads `stage_name`."""
    found = {}
    for s in preset.stages:
        if s.kind != "eval" or stage_name not in s.inputs or state["stages"].get(s.name, {}).get("status") != "done":
            continue
        for rel in state["stages"][s.name].get("outputs", {}):
            path = preset.out / rel
            if path.suffix == ".json":
                data = json.loads(path.read_text())
                found[data.get("task") or path.stem] = data
    return found


def _holds_checkpoint(folder: Path | None, data: dict) -> bool:
    path = (data.get("checkpoint") or {}).get("path")
    return folder is not None and path is not None and Path(path).resolve().is_relative_to(Path(folder).resolve())


def evaluated_stages(preset, state: dict) -> dict[str, dict[str, dict]]:
    """{stage: {task: evaluate.py's JSON}}, in preset order, for every stage an eval stage
    evaluated: a train stage, or another (a model import) whose out folder holds the checkpoint."""
    out = {}
    for s in preset.stages:
        if s.kind == "eval":
            continue
        files = eval_files(preset, s.name, state)
        if s.kind != "train":
            files = {task: data for task, data in files.items() if _holds_checkpoint(preset.out_of(s), data)}
        if files:
            out[s.name] = files
    return out


def rate_interval(rate: float, n: float) -> list[float]:
    """The Wilson interval of a rate logged as a fraction of n: round(rate × n) of n."""
    return list(wilson_interval(round(rate * n), round(n)))


# ---- one task's figures and changes -------------------------------------------------------------

def task_figures(files: list[dict]) -> list[str]:
    """The figures any of `files` holds: every pass@k by k, then those of FIGURE_TITLES."""
    names = {k for data in files for k in data.get("metrics", {})}
    passes = sorted((k for k in names if k.startswith("pass@") and k[5:].isdigit()), key=lambda k: int(k[5:]))
    return passes + [k for k in FIGURE_TITLES if k in names]


def figure_cell(metrics: dict, figure: str) -> str:
    """'25.0 [18.0, 33.0]': the figure and its interval in percent ('25.0' without one, '–' without it)."""
    if metrics.get(figure) is None:
        return "–"
    ci = metrics.get(f"{figure}_ci")
    text = f"{100 * metrics[figure]:.1f}"
    return text + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def paired_scores(a: dict, b: dict, figure: str) -> tuple[dict, dict] | str:
    """({problem id: score} of eval file `a`, of `b`) for `figure`, or why they do not pair."""
    pa, pb = a.get("problems"), b.get("problems")
    if not pa or not pb:
        return "no per-problem outcomes"
    settings = ("max_new_tokens", "temperature") if figure.startswith("pass@") else ("max_new_tokens",)
    for key in settings:
        x, y = (a.get("settings") or {}).get(key), (b.get("settings") or {}).get(key)
        if x != y:
            return f"different {key} ({x} vs {y})"
    ids_a, ids_b = [p["id"] for p in pa], [p["id"] for p in pb]
    if len(set(ids_a)) < len(ids_a) or len(set(ids_b)) < len(ids_b):
        return "repeated problem ids"
    if set(ids_a) != set(ids_b):
        return f"different problems ({len(ids_a)} vs {len(ids_b)}, {len(set(ids_a) & set(ids_b))} shared)"
    sa, sb = problem_scores(pa, figure), problem_scores(pb, figure)
    if sa is None or sb is None:
        return f"no per-problem {figure}"
    return dict(zip(ids_a, sa)), dict(zip(ids_b, sb))


def change(before: dict, after: dict, figure: str) -> dict:
    """The change of `figure` from eval file `before` to `after` on the same problems:
    {diff, ci, real} (fractions), or {not_paired: why}."""
    scores = paired_scores(before, after, figure)
    if isinstance(scores, str):
        return {"not_paired": scores}
    diff, lo, hi = paired_difference_interval(*scores)
    return {"diff": diff, "ci": [lo, hi], "real": excludes_zero(lo, hi), "problems": len(scores[0])}


def change_cell(result: dict) -> str:
    """'+12.5 [+6.2, +18.8] ✓' in percentage points ('… not significant'), or why not paired."""
    if "not_paired" in result:
        return result["not_paired"]
    lo, hi = result["ci"]
    return f"{100 * result['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] {REAL if result['real'] else NOT_REAL}"


def task_section(task: str, files: dict[str, dict]) -> tuple[list[str], dict]:
    """The markdown of one task ({stage: its eval file}, preset order) and its JSON."""
    stages = list(files)
    figures = task_figures(list(files.values()))
    sizes = sorted({d.get("metrics", {}).get("prompts") for d in files.values()} - {None})
    size = f" ({' / '.join(f'{n:.0f}' for n in sizes)} problems)" if sizes else ""
    lines = [f"### {task}{size}", "", "| stage | " + " | ".join(FIGURE_TITLES.get(f, f) for f in figures) + " |",
             "| --- | " + " | ".join("---:" for _ in figures) + " |"]
    data: dict = {"figures": {}, "changes": []}
    for stage, d in files.items():
        metrics = d.get("metrics", {})
        lines.append(f"| {stage} | " + " | ".join(figure_cell(metrics, f) for f in figures) + " |")
        data["figures"][stage] = {f: {"value": metrics.get(f), "ci": metrics.get(f"{f}_ci")} for f in figures}
    changed = [f for f in figures if f.startswith("pass@") or f in CHANGED]
    if len(stages) > 1 and changed:
        lines += ["", f"Changes on the same problems, percentage points ({REAL}: the 95 % interval excludes 0):", "",
                  "| stage | figure | vs previous | change | vs first | change |",
                  "| --- | --- | --- | ---: | --- | ---: |"]
    for i, stage in enumerate(stages[1:], start=1):
        previous, first = stages[i - 1], stages[0]
        for f in changed:
            if files[stage].get("metrics", {}).get(f) is None:
                continue
            cells, done = [], {}
            for vs, other in (("previous", previous), ("first", first)):
                has = files[other].get("metrics", {}).get(f) is not None
                if other not in done:  # the second stage's previous is the first: one bootstrap
                    done[other] = change(files[other], files[stage], f) if has else {"not_paired": f"no {f}"}
                result = done[other]
                data["changes"].append({"stage": stage, "figure": f, "vs": vs, "against": other, **result})
                cells += [other, change_cell(result)]
            lines.append(f"| {stage} | {FIGURE_TITLES.get(f, f)} | " + " | ".join(cells) + " |")
    return lines, data


def held_out_section(evaluated: dict[str, dict[str, dict]]) -> tuple[list[str], dict]:
    """(markdown lines, {task: its figures and changes}) over every task of `evaluated`;
    no lines when no stage was evaluated."""
    tasks = list(dict.fromkeys(task for files in evaluated.values() for task in files))
    if not tasks:
        return [], {}
    lines = ["## Held-out evaluation with 95 % intervals", "",
             "Percent, [lo, hi] the 95 % interval over problems (Wilson when every problem scores 0 or 1, "
             "else a percentile bootstrap over problems). A change is this stage's mean over the same problems "
             "minus the other's, with the paired bootstrap interval over problems (10,000 resamples, seed 0); "
             f"{REAL} marks a change whose interval excludes 0."]
    data = {}
    for task in tasks:
        section, data[task] = task_section(task, {s: f[task] for s, f in evaluated.items() if task in f})
        lines += [""] + section
    return lines, data
