"""The table of a sweep (sprout.pipeline.sweep): every setting tried, judged on the dev split.

`write_sweep_table` writes `<out>/sweep_<stage>.md`, `.json` and `.png` (the curves each run
logged while training): the sweep's command and the first setting's training command, then per
setting its dev figures with their 95 % intervals, its paired change (same dev problems) from
the stage the sweep starts from and from the chosen setting, its wall time, median step time
and peak memory.
Chosen: the highest dev mean of the selection figure (`choose`; ties: the first listed).
Every figure is read back from evaluate.py's JSON, never recomputed.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from sprout.atomic import atomic_write, write_json_atomic
from sprout.engine.metrics import METRICS, read_metrics
from sprout.errors import SproutError
from sprout.mirror import REPO_ROOT
from sprout.pipeline.preset import command_args
from sprout.pipeline.report_card import plot_metrics
from sprout.evaluation.compare import change
from sprout.pipeline.report_held_out import change_cell, eval_files, figure_cell, title
from sprout.pipeline.sweep import command_task, tag_of, without_sweep

DEFAULT_FIGURE, FALLBACK_FIGURE = "pass@1", "greedy/accuracy"
SEED_KEY = "train.seed"  # a sweep's own seed: not part of the setting it recommends
TABLE_FIGURES = ("pass@1", "pass@8", "greedy/accuracy", "format/rate", "flexible/pass@1", "flexible/greedy/accuracy")


def _done(rows: list[dict]) -> str:
    done = sum(r["status"] == "done" for r in rows)
    return f"{done} setting{'' if done == 1 else 's'}"


def _setting_text(setting: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items())


def sweep_rows(preset, state: dict) -> tuple[str, list[dict]] | None:
    """(swept stage, one row per setting: {stage, setting, status, wall_s, peak_rss_mb,
    step_time_s (the median of its training records' `step_time_s`), files: {task: dev eval
    JSON}, records: its metrics.jsonl}), or None when the preset sweeps nothing."""
    settings = [s for s in preset.stages if s.sweep_of and s.kind == "train"]
    if not settings:
        return None
    rows = []
    for s in settings:
        rec = state["stages"].get(s.name) or {}
        files = {task: splits["dev"] for task, splits in eval_files(preset, s.name, state).items() if "dev" in splits}
        records = read_metrics(preset.out_of(s) / METRICS)
        times = sorted(r["step_time_s"] for r in records if "step_time_s" in r)
        rows.append({"stage": s.name, "setting": s.setting, "status": rec.get("status", "not run"),
                     "wall_s": rec.get("wall_s"), "peak_rss_mb": rec.get("peak_rss_mb"),
                     "step_time_s": times[len(times) // 2] if times else None,
                     "out": str(preset.out_of(s)), "files": files, "records": records})
    return settings[0].sweep_of, rows


def choose(rows: list[dict], select: tuple[str, str] | None,
           tasks: list[str]) -> tuple[tuple[str, str] | None, dict | None]:
    """((task, figure) selected on, the row with its highest dev mean; the first on ties). The
    default: the first of `tasks` (the eval commands' order) that a setting has, by pass@1, or by
    greedy accuracy where it has no pass@1. A figure no done setting's file has is refused,
    naming those they have."""
    have = {t: sorted({f for r in rows if t in r["files"] for f in r["files"][t].get("metrics", {})
                       if not f.endswith("_ci")}) for t in tasks if any(t in r["files"] for r in rows)}
    if not have:
        return select, None
    if select is None:
        task = next(iter(have))
        select = (task, DEFAULT_FIGURE if DEFAULT_FIGURE in have[task] else FALLBACK_FIGURE)
    task, figure = select
    if figure not in have.get(task, []):
        raise SproutError(f"--sweep-select {task}:{figure}: no setting's dev evaluation has it (they have "
                          + "; ".join(f"{t}: {', '.join(fs)}" for t, fs in have.items()) + ")")
    scored = [(r["files"][task]["metrics"][figure], -i, r) for i, r in enumerate(rows)
              if task in r["files"] and r["files"][task].get("metrics", {}).get(figure) is not None]
    return select, max(scored, key=lambda t: t[:2])[2]


def write_sweep_table(preset, state: dict, select: tuple[str, str] | None = None, log=print,
                      command: str | None = None) -> Path | None:
    """`<out>/sweep_<stage>.md`, `.json` and `.png` (the in-training curves): the module
    docstring's table, with `command` (the sweep's) and the first setting's own command line;
    None when the preset sweeps nothing."""
    found = sweep_rows(preset, state)
    if found is None:
        return None
    name, rows = found
    swept = next(s for s in preset.stages if s.sweep_of == name and s.kind == "train")
    commanded = [command_task(c) for s in preset.stages if s.sweep_of and s.kind == "eval" for c in s.commands]
    tasks = list(dict.fromkeys([t for t in commanded if t] + sorted({t for r in rows for t in r["files"]})))
    tasks = [t for t in tasks if any(t in r["files"] for r in rows)]  # the eval commands' order
    select, chosen = choose(rows, select, tasks)
    start = {}  # task: the dev file of the stage the sweep starts from (its first input evaluated on dev)
    for inp in swept.inputs:
        for task, splits in eval_files(without_sweep(preset), inp, state).items():
            if "dev" in splits and task not in start:
                start[task] = (inp, splits["dev"])
    keys = list(swept.setting)
    values = {k: [] for k in keys}
    for r in rows:
        for k in keys:
            if r["setting"][k] not in values[k]:
                values[k].append(r["setting"][k])
    lines = [f"# Sweep of {name} on the dev split", "",
             f"Settings tried: {len(rows)} ({'; '.join(f'{k} = ' + ', '.join(v) for k, v in values.items())}), "
             f"each run once. Judged on dev only: no setting's test split was read. Output root: `{preset.out}`.", ""]
    if command:
        lines += [f"Sweep: `{command}`", ""]
    first = ["python", str(swept.script.relative_to(REPO_ROOT) if swept.script.is_relative_to(REPO_ROOT)
                           else swept.script), *command_args(preset, swept)[0]]
    lines += [f"First setting's training command: `{shlex.join(first)}`", ""]
    if chosen is not None:
        sets = " ".join(f"--set {name}:{k}={v}" for k, v in chosen["setting"].items() if k != SEED_KEY)
        seeds = " and the seeds to report (`--seeds N,N,...`)" if SEED_KEY in chosen["setting"] else ""
        lines += [f"Chosen: **{_setting_text(chosen['setting'])}**, the highest dev {select[0]} {title(select[1])} "
                  f"of the {_done(rows)} done. Its paired change against "
                  f"each other setting shows whether dev separates them."
                  + (f" Run it with `{sets}`{seeds}, and the options the first setting's command shows." if sets
                     else ""), ""]
    else:
        lines += ["Chosen: none yet (no setting has a dev evaluation).", ""]
    data = {"stage": name, "command": command, "first_command": first, "select": list(select) if select else None,
            "chosen": chosen["setting"] if chosen else None, "settings": []}
    for r in rows:
        data["settings"].append({k: r[k] for k in ("stage", "setting", "status", "wall_s", "peak_rss_mb", "step_time_s",
                                                   "out")}
                                | {"dev": {t: {f: {"value": d["metrics"].get(f), "ci": d["metrics"].get(f"{f}_ci")}
                                               for f in TABLE_FIGURES if f in d.get("metrics", {})}
                                           for t, d in r["files"].items()}, "changes": {}})
    for task in tasks:
        figures = [f for f in TABLE_FIGURES if any(f in r["files"].get(task, {}).get("metrics", {}) for r in rows)]
        sizes = sorted({r["files"][task]["metrics"].get("prompts") for r in rows if task in r["files"]} - {None})
        key = select[1] if select and select[0] == task else figures[0]
        base = start.get(task)
        head = [title(f) for f in figures] + ([f"{title(key)} vs {base[0]}"] if base else []) + \
            ([f"{title(key)} vs chosen"] if chosen and task in chosen["files"] else [])
        lines += [f"### {task} (dev, {' / '.join(f'{n:.0f}' for n in sizes)} problems)", "",
                  "| setting | status | " + " | ".join(head) + " | wall | step time | peak RSS |",
                  "| --- | --- | " + " | ".join("---:" for _ in head) + " | ---: | ---: | ---: |"]
        if base:
            cells = [figure_cell(base[1]["metrics"], f) for f in figures] + ["–"] * (len(head) - len(figures))
            lines.append(f"| {base[0]} (start) | done | " + " | ".join(cells) + " | – | – | – |")
        for r, rec in zip(rows, data["settings"]):
            d = r["files"].get(task)
            cells = [figure_cell(d["metrics"], f) if d else "–" for f in figures]
            if base:
                ch = change(base[1], d, key) if d else None
                cells.append(change_cell(ch) if ch else "–")
                rec["changes"][f"{task}/{key} vs {base[0]}"] = ch
            if chosen and task in chosen["files"]:
                ch = change(chosen["files"][task], d, key) if d and r is not chosen else None
                cells.append(change_cell(ch) if ch else "–")
                rec["changes"][f"{task}/{key} vs chosen"] = ch
            wall = f"{r['wall_s'] / 60:.0f} min" if r["wall_s"] else "–"
            rss = f"{r['peak_rss_mb'] / 1024:.2f} GiB" if r["peak_rss_mb"] else "–"
            step = f"{r['step_time_s']:.1f} s" if r["step_time_s"] else "–"
            mark = " (chosen)" if r is chosen else ""
            lines.append(f"| {_setting_text(r['setting'])}{mark} | {r['status']} | " + " | ".join(cells) +
                         f" | {wall} | {step} | {rss} |")
        lines.append("")
    curves = {tag_of(r["setting"]): r["records"] for r in rows}
    png = plot_metrics(curves, ["reward", "val_pass@1", "val_accuracy", "val_loss", "val_rewards/accuracies"],
                       preset.out / f"sweep_{name}.png")
    if png is not None:
        lines += [f"![in-training curves](sweep_{name}.png)", "",
                  "The curves are what each run logged while training (its own held-out evaluations, "
                  "on dev prompts).", ""]
    lines += ["Changes are paired on the same dev problems, with the 95 % bootstrap interval; ✓: it excludes 0. "
              "Wall time and peak RSS are the pipeline runner's, per training stage; step time the median of "
              "its training records' (generation included).", ""]
    md = preset.out / f"sweep_{name}.md"
    with atomic_write(md, "w") as f:
        f.write("\n".join(lines))
    write_json_atomic(preset.out / f"sweep_{name}.json", data)
    if chosen is not None:
        log(f"sweep: chosen on dev {_setting_text(chosen['setting'])} (of {len(rows)} settings)")
    return md
