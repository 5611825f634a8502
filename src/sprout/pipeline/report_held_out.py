"""The report card's held-out evaluations with 95 % intervals, and each policy's change on the same problems.

    evaluated = evaluated_stages(preset, state)   # {stage: {task: {split: evaluate.py's JSON}}}, preset order
    lines, data = held_out_section(evaluated, seed_groups(preset))   # markdown lines, report_card.json's part

Which files are read: `eval_files` and `evaluated_stages`. Figures: each stage's pass@k, greedy
accuracy and format rates in percent, test with dev beside it, strict and (where the file has
`flexible/` figures) flexible, each with the 95 % interval scripts/evaluate.py wrote beside it
(`<figure>_ci`); a seeded stage adds the mean over its seeds (`seeds_figure`). Changes, on the
same test problems, from the second evaluated stage on, against the previous and the first:
`change`, `seeds_change` and `paired_scores` (which files pair; sprout.evaluation.compare).
`rate_interval`: the Wilson interval of the reward model's and DPO's held-out accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

from sprout.errors import SproutError
from sprout.evaluation.compare import change, paired_scores, seeds_change
from sprout.evaluation.evaluate import FLEXIBLE
from sprout.evaluation.statistics import seeds_mean_interval, wilson_interval

FIGURE_TITLES = {"greedy/accuracy": "greedy accuracy", "greedy/format_rate": "greedy format rate",
                 "format/rate": "format rate"}  # after every pass@k, in this order
CHANGED = ("greedy/accuracy",)  # with every pass@k: the figures whose change is shown
SPLITS = ("test", "dev")  # the split reported, then the split tuned on beside it
REAL, NOT_REAL = "✓", "not significant"


def eval_files(preset, stage_name: str, state: dict) -> dict[str, dict[str, dict]]:
    """{task: {split: the evaluate.py JSON}} for every done eval stage that reads `stage_name`:
    its JSON outputs with a `task` (`<task>_test.json`, `<task>_dev.json`, by their `task` and
    `split`). A prompt file's evaluation (`task` null) of `x_dev.jsonl` or `x_test.jsonl` is task
    x's dev or test; of any other file it is named by the JSON's stem, under test. A preference ranking (`task` "preferences") is not read; a task's file without a
    split (an earlier sprout's) is refused."""
    found: dict[str, dict[str, dict]] = {}
    for s in preset.stages:
        if s.kind != "eval" or stage_name not in s.inputs or state["stages"].get(s.name, {}).get("status") != "done":
            continue
        for rel in state["stages"][s.name].get("outputs", {}):
            path = preset.out / rel
            if path.suffix != ".json":
                continue
            data = json.loads(path.read_text())
            if "task" not in data or data["task"] == "preferences":
                continue
            if data["task"] is None:  # --prompts FILE: `x_dev.jsonl` / `x_test.jsonl` are task x's splits
                stem = Path(data.get("prompts_file") or "").stem
                split = next((sp for sp in SPLITS if stem.endswith(f"_{sp}")), None)
                found.setdefault(stem[:-len(split) - 1] if split else path.stem, {})[split or "test"] = data
            elif data.get("split") not in SPLITS:
                raise SproutError(f"{path}: split {data.get('split')!r} is not one of {', '.join(SPLITS)} (an "
                                  f"evaluation written by an earlier version of sprout); evaluate it again")
            else:
                found.setdefault(data["task"], {})[data["split"]] = data
    return found


def seed_groups(preset) -> dict[str, str]:
    """{seeded stage: the preset stage it runs one seed of}."""
    return {s.name: s.seed_of for s in preset.stages if s.seed_of}


def _holds_checkpoint(folder: Path | None, data: dict) -> bool:
    path = (data.get("checkpoint") or {}).get("path")
    return folder is not None and path is not None and Path(path).resolve().is_relative_to(Path(folder).resolve())


def evaluated_stages(preset, state: dict) -> dict[str, dict[str, dict[str, dict]]]:
    """{stage: {task: {split: evaluate.py's JSON}}}, in preset order, for every stage an eval stage
    evaluated: a train stage, or another (a model import) whose out folder holds the checkpoint."""
    out = {}
    for s in preset.stages:
        if s.kind == "eval":
            continue
        files = eval_files(preset, s.name, state)
        if s.kind != "train":
            files = {task: kept for task, splits in files.items()
                     if (kept := {split: d for split, d in splits.items() if _holds_checkpoint(preset.out_of(s), d)})}
        if files:
            out[s.name] = files
    return out


def rate_interval(rate: float, n: float) -> list[float]:
    """The Wilson interval of round(rate × n) of n (reward model and DPO accuracy of `val_pairs` n)."""
    return list(wilson_interval(round(rate * n), round(n)))


# ---- one task's figures and changes -------------------------------------------------------------

def task_figures(files: list[dict]) -> list[str]:
    """The strict figures any of `files` holds: every pass@k by k, then those of FIGURE_TITLES."""
    names = {k for data in files for k in data.get("metrics", {})}
    passes = sorted((k for k in names if k.startswith("pass@") and k[5:].isdigit()), key=lambda k: int(k[5:]))
    return passes + [k for k in FIGURE_TITLES if k in names]


def title(figure: str) -> str:
    """'flexible greedy accuracy' of flexible/greedy/accuracy; 'pass@1' of pass@1."""
    if figure.startswith(FLEXIBLE):
        return "flexible " + title(figure[len(FLEXIBLE):])
    return FIGURE_TITLES.get(figure, figure)


def figure_cell(metrics: dict, figure: str) -> str:
    """'25.0 [18.0, 33.0]': the figure and its interval in percent ('25.0' without one, '–' without it)."""
    if metrics.get(figure) is None:
        return "–"
    return interval_cell(metrics[figure], metrics.get(f"{figure}_ci"))


def interval_cell(value: float, ci) -> str:
    text = f"{100 * value:.1f}"
    return text + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def seeds_figure(files: list[dict], figure: str) -> dict:
    """{value, ci}: the mean over the seeds' files of `figure` and its two-level interval over
    seeds and problems (ci None, with `why`, where the files do not give per-problem scores on
    the same problems); value None where a seed's file lacks the figure."""
    values = [d.get("metrics", {}).get(figure) for d in files]
    if any(v is None for v in values):
        return {"value": None, "ci": None}
    result = {"value": sum(values) / len(values), "ci": None}
    scores = [paired_scores(files[0], d, figure) for d in files]
    if why := next((s for s in scores if isinstance(s, str)), None):
        return {**result, "why": why}
    _, lo, hi = seeds_mean_interval([s[1] for s in scores])
    return {**result, "ci": [lo, hi]}


def change_cell(result: dict) -> str:
    """'+12.5 [+6.2, +18.8] ✓' in percentage points ('… not significant'), or why not paired."""
    if "not_paired" in result:
        return result["not_paired"]
    lo, hi = result["ci"]
    return f"{100 * result['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] {REAL if result['real'] else NOT_REAL}"


def units(stages: list[str], seed_of: dict[str, str]) -> list[tuple[str, list[str]]]:
    """[(name, its stages)]: a stage alone, or a seeded stage's name and its seeds' stages, in order."""
    out: dict[str, list[str]] = {}
    for stage in stages:
        out.setdefault(seed_of.get(stage, stage), []).append(stage)
    return [(name, members) for name, members in out.items()]


def mean_label(name: str, seeds: int) -> str:
    return f"{name}: mean of {seeds} seeds"


def task_section(task: str, files: dict[str, dict[str, dict]], seed_of: dict[str, str]) -> tuple[list[str], dict]:
    """The markdown of one task ({stage: {split: its eval file}}, preset order) and its JSON."""
    every = [d for splits in files.values() for d in splits.values()]
    strict = task_figures(every)
    flexible = [FLEXIBLE + f for f in strict if any(FLEXIBLE + f in d.get("metrics", {}) for d in every)]
    splits = [sp for sp in SPLITS if any(sp in f for f in files.values())]
    sizes = {sp: sorted({f[sp].get("metrics", {}).get("prompts") for f in files.values() if sp in f} - {None})
             for sp in splits}
    size = "; ".join(f"{sp}: {' / '.join(f'{n:.0f}' for n in sizes[sp])} problems" for sp in splits if sizes[sp])
    lines = [f"### {task}" + (f" ({size})" if size else ""), "",
             "| stage | reading | " + " | ".join(f"{title(f)} {sp}" for f in strict for sp in splits) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in strict for _ in splits) + " |"]
    data: dict = {"figures": {}, "seeds": {}, "changes": []}
    readings = [("strict", "")] + ([("flexible", FLEXIBLE)] if flexible else [])

    def row(label: str, cell) -> None:
        """A table row per reading; cell(figure, split) is its text, None for a dash."""
        for reading, prefix in readings:
            if prefix and not any(cell(prefix + f, sp) is not None for f in strict for sp in splits):
                continue  # this stage's files have no flexible figures
            shown = [cell(prefix + f, sp) if not prefix or prefix + f in flexible else None
                     for f in strict for sp in splits]
            lines.append(f"| {label} | {reading} | " + " | ".join("–" if x is None else x for x in shown) + " |")

    for name, members in units(list(files), seed_of):
        for stage in members:
            got = files[stage]
            row(stage, lambda f, sp: figure_cell(got[sp].get("metrics", {}), f)
                if sp in got and got[sp].get("metrics", {}).get(f) is not None else None)
            data["figures"][stage] = {sp: {f: {"value": d.get("metrics", {}).get(f),
                                               "ci": d.get("metrics", {}).get(f"{f}_ci")} for f in strict + flexible}
                                      for sp, d in got.items()}
        if name in seed_of.values():
            means = {sp: {f: seeds_figure([files[m][sp] for m in members], f) for f in strict + flexible}
                     for sp in splits if all(sp in files[m] for m in members)}
            row(mean_label(name, len(members)), lambda f, sp: interval_cell(means[sp][f]["value"], means[sp][f]["ci"])
                if sp in means and means[sp][f]["value"] is not None else None)
            data["seeds"][name] = {"stages": members, "figures": means}

    changed = [f for f in strict if f.startswith("pass@") or f in CHANGED]
    changed += [FLEXIBLE + f for f in changed if FLEXIBLE + f in flexible]
    changes = changes_rows(files, units([s for s, f in files.items() if "test" in f], seed_of), changed, data)
    if changes:
        lines += ["", f"Changes on the same test problems, percentage points ({REAL}: the 95 % interval excludes 0):",
                  "", "| stage | figure | vs previous | change | vs first | change |",
                  "| --- | --- | --- | ---: | --- | ---: |"] + changes
    return lines, data


def changes_rows(files: dict, order: list[tuple[str, list[str]]], changed: list[str], data: dict) -> list[str]:
    """The changes table's rows (test files): each stage, and each seeded stage's seeds and their
    mean, against the previous and the first evaluated stage; each appended to data["changes"]."""
    def test(stages: list[str]) -> list[dict]:
        return [files[s]["test"] for s in stages]

    def against(others: list[str], stages: list[str], mean: bool, f: str) -> dict:
        before, after = test(others), test(stages)
        if before[0].get("metrics", {}).get(f) is None:
            return {"not_paired": f"no {f}"}
        if len(before) > 1:
            return {"not_paired": f"against {len(before)} seeds"}
        return seeds_change(before[0], after, f) if mean else change(before[0], after[0], f)

    lines = []
    for i, (name, members) in enumerate(order[1:], start=1):
        (previous, before), (first, firsts) = order[i - 1], order[0]
        rows = [(stage, [stage], False) for stage in members]
        if members != [name]:  # a seeded stage: its seeds, then their mean
            rows.append((mean_label(name, len(members)), members, True))
        for label, stages, mean in rows:
            for f in changed:
                if any(d.get("metrics", {}).get(f) is None for d in test(stages)):
                    continue
                cells, done = [], {}
                for vs, other, others in (("previous", previous, before), ("first", first, firsts)):
                    if other not in done:  # the second stage's previous is the first: one bootstrap
                        done[other] = against(others, stages, mean, f)
                    data["changes"].append({"stage": label, "figure": f, "vs": vs, "against": other, **done[other]})
                    cells += [other, change_cell(done[other])]
                lines.append(f"| {label} | {title(f)} | " + " | ".join(cells) + " |")
    return lines


def held_out_section(evaluated: dict[str, dict[str, dict[str, dict]]],
                     seed_of: dict[str, str] | None = None) -> tuple[list[str], dict]:
    """(markdown lines, {task: its figures, seeds and changes}) over every task of `evaluated`
    ({stage: {task: {split: file}}}); `seed_of` ({seeded stage: the stage it is one seed of})
    groups seeds; no lines when no stage was evaluated."""
    tasks = list(dict.fromkeys(task for files in evaluated.values() for task in files))
    if not tasks:
        return [], {}
    lines = ["## Held-out evaluation with 95 % intervals", "",
             "Percent, test with dev beside it, [lo, hi] the 95 % interval over problems (Wilson when every "
             "problem scores 0 or 1, else a percentile bootstrap over problems); strict reads the <answer> tag "
             "only, flexible also the last number of an answer without one. A seeded stage's mean over its seeds "
             "has the two-level bootstrap interval (seeds, then problems). A change is this stage's mean over the "
             "same test problems minus the other's, with the paired bootstrap interval over problems (and seeds) "
             f"(10,000 resamples, seed 0); {REAL} marks a change whose interval excludes 0."]
    data = {}
    for task in tasks:
        section, data[task] = task_section(task, {s: f[task] for s, f in evaluated.items() if task in f}, seed_of or {})
        lines += [""] + section
    return lines, data
