"""Settings chosen on the dev split: a train stage run once per setting, each judged on dev only.

`--sweep STAGE:KEY=V1,V2,...` (scripts/run_pipeline.py; several, for one stage, multiply) turns
the train stage STAGE into one stage per setting, `<name>_<tag>` into `<out>_<tag>` (the tag is
each key's last part and its value: `lr2e-5`), given `--KEY VALUE`. An eval stage reading STAGE
runs once per setting with its dev commands only: a command with `--split test`, or naming a
`*_test.*` file, is dropped, so a sweep never reads a test split. Every other stage reading STAGE
(a later trainer, an export), and all that follows from it, is left out: a sweep ends at its
evaluations. `write_sweep_table` writes `<out>/sweep_<stage>.md` and `.json`: each setting's dev
figures with their 95 % intervals, its paired change from the stage it starts from and from the
chosen setting, its wall time and peak memory; chosen is the highest mean of the selection
figure (`--sweep-select TASK:FIGURE`, default the first task's pass@1; ties: the first listed).
`--set STAGE:KEY=VALUE` gives one stage (every seed of it) one more option: the chosen setting.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
from pathlib import Path

from sprout.atomic import atomic_write, write_json_atomic
from sprout.errors import SproutError
from sprout.mirror import REPO_ROOT

KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
VALUE = re.compile(r"^[A-Za-z0-9_.+-]+$")
DEFAULT_FIGURE = "pass@1"
SEED_KEY = "train.seed"  # a sweep's own seed: not part of the setting it recommends
TABLE_FIGURES = ("pass@1", "pass@8", "greedy/accuracy", "format/rate", "flexible/pass@1", "flexible/greedy/accuracy")


# ---- the command line ---------------------------------------------------------------------------
def parse_option(text: str, *, many: bool) -> tuple[str, str, list[str]]:
    """`STAGE:KEY=V1,V2` -> (stage, key, values); one value only unless `many`."""
    flag = "--sweep" if many else "--set"
    stage, _, rest = text.partition(":")
    key, eq, values_text = rest.partition("=")
    values = [v.strip() for v in values_text.split(",")] if eq else []
    if not stage or not key or not eq:
        raise SproutError(f"{flag} {text}: expected STAGE:KEY=VALUE{',VALUE,...' if many else ''} "
                          f"(e.g. grpo:optim.lr=1e-5{',2e-5' if many else ''})")
    if not KEY.match(key):
        raise SproutError(f"{flag} {text}: {key!r} is not an option name (words joined by dots: optim.lr)")
    if not values or not all(VALUE.match(v) for v in values):
        raise SproutError(f"{flag} {text}: each value must be letters, digits or _ . + - (got {values_text!r})")
    if not many and len(values) > 1:
        raise SproutError(f"{flag} {text}: one value only (--sweep tries several)")
    if len(set(values)) < len(values):
        raise SproutError(f"{flag} {text}: a value is listed twice")
    return stage, key, values


def apply_sets(path: Path, stages: list, sets: list[tuple[str, str, list[str]]]) -> list:
    """The stages with `--KEY VALUE` added to every command of each set stage."""
    names = [s.name for s in stages]
    extra: dict[str, list[str]] = {}
    for stage, key, values in sets:
        if stage not in names:
            raise SproutError(f"--set {stage}:{key}: {path} has no stage {stage!r} (stages: {', '.join(names)})")
        if f"--{key}" in extra.get(stage, []):
            raise SproutError(f"--set {stage}:{key}: set twice")
        extra.setdefault(stage, []).extend([f"--{key}", values[0]])
    return [dataclasses.replace(s, commands=[c + extra[s.name] for c in s.commands]) if s.name in extra else s
            for s in stages]


def reads_test(command: list[str]) -> bool:
    """Whether an eval command reads a test split: `--split test`, or a `*_test.*` file argument."""
    pairs = zip(command, command[1:] + [""])
    return any((a == "--split" and b == "test") or a == "--split=test" for a, b in pairs) or \
        any(Path(a).stem.endswith("_test") for a in command)


def command_task(command: list[str]) -> str | None:
    pairs = zip(command, command[1:] + [""])
    return next((b for a, b in pairs if a == "--task"), None)


def tag_of(setting: dict[str, str]) -> str:
    return "_".join(f"{key.rsplit('.', 1)[-1]}{value}" for key, value in setting.items())


def expand_sweep(path: Path, stages: list, sweeps: list[tuple[str, str, list[str]]],
                 tasks: list[str] | None = None) -> list:
    """The stages with the swept one replaced, in place, by one stage per setting, each eval stage
    reading it by one per setting with its dev commands (only `tasks`' when given), and every
    other stage that reads it, directly or not, left out (module docstring)."""
    names = {s.name: s for s in stages}
    swept = {stage for stage, _, _ in sweeps}
    if len(swept) > 1:
        raise SproutError(f"--sweep: one stage at a time (got {', '.join(sorted(swept))})")
    name = swept.pop()
    if name not in names or names[name].kind != "train":
        raise SproutError(f"--sweep {name}: not a train stage of {path} (train stages: "
                          f"{', '.join(s.name for s in stages if s.kind == 'train')})")
    keys = [key for _, key, _ in sweeps]
    if len(set(keys)) < len(keys):
        raise SproutError(f"--sweep {name}: an option is swept twice ({', '.join(keys)})")
    settings = [dict(zip(keys, values)) for values in itertools.product(*(v for _, _, v in sweeps))]
    out, left_out, judged = [], set(), False
    for stage in stages:
        if stage.name == name:
            for setting in settings:
                tag = tag_of(setting)
                out.append(dataclasses.replace(
                    stage, name=f"{name}_{re.sub(r'[^A-Za-z0-9_]', '_', tag)}", out=f"{stage.out}_{tag}",
                    sweep_of=name, setting=setting,
                    commands=[c + [a for k, v in setting.items() for a in (f"--{k}", v)] for c in stage.commands]))
            continue
        reads = [n for n in stage.inputs if n == name or n in left_out]
        if not reads:
            out.append(stage)
            continue
        dev = [c for c in stage.commands if not reads_test(c) and (not tasks or command_task(c) in tasks)]
        if stage.kind != "eval" or name not in stage.inputs or len(reads) > 1 or not dev:
            left_out.add(stage.name)
            continue
        judged = True
        for copy in (s for s in out if s.sweep_of == name and s.kind == "train"):
            out.append(dataclasses.replace(
                stage, name=f"{stage.name}_{copy.name[len(name) + 1:]}", out=f"{stage.out}_{tag_of(copy.setting)}",
                outputs=None, sweep_of=stage.name, setting=copy.setting,
                inputs=[copy.name if n == name else n for n in stage.inputs],
                commands=[[a.replace(f"{{{name}}}", f"{{{copy.name}}}") for a in c] for c in dev]))
    if not judged:
        raise SproutError(f"--sweep {name}: no eval stage of {path} reads {name} with a dev command"
                          f"{' for ' + ', '.join(tasks) if tasks else ''}: nothing would judge the settings")
    evals = [s for s in out if s.sweep_of and s.kind == "eval"]
    ordered, moved = [], set()  # each setting's evaluations right after its training: it finishes whole
    for stage in out:
        if stage.name in moved:
            continue
        ordered.append(stage)
        if stage.sweep_of == name and stage.kind == "train":
            placed = {s.name for s in ordered}
            for e in evals:
                if stage.name in e.inputs and set(e.inputs) <= placed:
                    ordered.append(e)
                    moved.add(e.name)
    out = ordered
    names_out = [s.name for s in out]
    if clash := next((n for n in names_out if names_out.count(n) > 1), None):
        raise SproutError(f"{path}: a swept stage's name {clash} is also another stage's")
    return out


def without_sweep(preset):
    """The preset without its swept stages (the report card's: a sweep has its own table)."""
    return dataclasses.replace(preset, stages=[s for s in preset.stages if not s.sweep_of])


# ---- the table ----------------------------------------------------------------------------------
def parse_select(text: str) -> tuple[str, str]:
    """`--sweep-select arith:pass@1` -> ("arith", "pass@1")."""
    task, sep, figure = text.partition(":")
    if not task or not sep or not figure:
        raise SproutError(f"--sweep-select {text}: expected TASK:FIGURE (e.g. arith:pass@1)")
    return task, figure


def _setting_text(setting: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items())


def sweep_rows(preset, state: dict) -> tuple[str, list[dict]] | None:
    """(swept stage, one row per setting: {stage, setting, status, wall_s, peak_rss_mb, files:
    {task: dev eval JSON}}), or None when the preset sweeps nothing."""
    from sprout.pipeline.report_held_out import eval_files

    settings = [s for s in preset.stages if s.sweep_of and s.kind == "train"]
    if not settings:
        return None
    rows = []
    for s in settings:
        rec = state["stages"].get(s.name) or {}
        files = {task: splits["dev"] for task, splits in eval_files(preset, s.name, state).items() if "dev" in splits}
        rows.append({"stage": s.name, "setting": s.setting, "status": rec.get("status", "not run"),
                     "wall_s": rec.get("wall_s"), "peak_rss_mb": rec.get("peak_rss_mb"),
                     "out": str(preset.out_of(s)), "files": files})
    return settings[0].sweep_of, rows


def choose(rows: list[dict], select: tuple[str, str] | None) -> tuple[tuple[str, str] | None, dict | None]:
    """((task, figure) selected on, the row with its highest dev mean; the first on ties)."""
    tasks = [t for r in rows for t in r["files"]]
    if select is None:
        if not tasks:
            return None, None
        select = (tasks[0], DEFAULT_FIGURE)
    task, figure = select
    scored = [(r["files"][task]["metrics"][figure], -i, r) for i, r in enumerate(rows)
              if task in r["files"] and r["files"][task].get("metrics", {}).get(figure) is not None]
    return select, (max(scored, key=lambda t: t[:2])[2] if scored else None)


def write_sweep_table(preset, state: dict, select: tuple[str, str] | None = None, log=print,
                      command: str | None = None) -> Path | None:
    """`<out>/sweep_<stage>.md`, `.json` and `.png` (the in-training curves): the module
    docstring's table, with `command` (the sweep's) and the first setting's own command line;
    None when the preset sweeps nothing."""
    from sprout.engine.metrics import METRICS, read_metrics
    from sprout.pipeline.preset import command_args
    from sprout.pipeline.report_card import plot_metrics
    from sprout.pipeline.report_held_out import change, change_cell, eval_files, figure_cell, title

    found = sweep_rows(preset, state)
    if found is None:
        return None
    name, rows = found
    swept = next(s for s in preset.stages if s.sweep_of == name and s.kind == "train")
    select, chosen = choose(rows, select)
    start = {}  # task: the dev file of the stage the sweep starts from (its first input evaluated on dev)
    for inp in swept.inputs:
        for task, splits in eval_files(preset, inp, state).items():
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
             f"each run once. Judged on dev only: no test split was read. Output root: `{preset.out}`.", ""]
    if command:
        lines += [f"Sweep: `{command}`", ""]
    first = ["python", str(swept.script.relative_to(REPO_ROOT) if swept.script.is_relative_to(REPO_ROOT)
                           else swept.script), *command_args(preset, swept)[0]]
    lines += [f"First setting's training command: `{shlex.join(first)}`", ""]
    if chosen is not None:
        sets = " ".join(f"--set {name}:{k}={v}" for k, v in chosen["setting"].items() if k != SEED_KEY)
        seeds = " and the seeds to report (`--seeds N,N,...`)" if SEED_KEY in chosen["setting"] else ""
        lines += [f"Chosen: **{_setting_text(chosen['setting'])}**, the highest dev {select[0]} {title(select[1])} "
                  f"of the {sum(r['status'] == 'done' for r in rows)} settings done. Its paired change against "
                  f"each other setting shows whether dev separates them."
                  + (f" Run it with `{sets}`{seeds}." if sets else ""), ""]
    else:
        lines += ["Chosen: none yet (no setting has a dev evaluation).", ""]
    tasks = list(dict.fromkeys(t for r in rows for t in r["files"]))
    data = {"stage": name, "command": command, "first_command": first, "select": list(select) if select else None,
            "chosen": chosen["setting"] if chosen else None, "settings": []}
    for r in rows:
        data["settings"].append({k: r[k] for k in ("stage", "setting", "status", "wall_s", "peak_rss_mb", "out")}
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
                  "| setting | status | " + " | ".join(head) + " | wall | peak RSS |",
                  "| --- | --- | " + " | ".join("---:" for _ in head) + " | ---: | ---: |"]
        if base:
            cells = [figure_cell(base[1]["metrics"], f) for f in figures] + ["–"] * (len(head) - len(figures))
            lines.append(f"| {base[0]} (start) | done | " + " | ".join(cells) + " | – | – |")
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
            mark = " (chosen)" if r is chosen else ""
            lines.append(f"| {_setting_text(r['setting'])}{mark} | {r['status']} | " + " | ".join(cells) +
                         f" | {wall} | {rss} |")
        lines.append("")
    curves = {tag_of(r["setting"]): read_metrics(Path(r["out"]) / METRICS) for r in rows}
    png = plot_metrics(curves, ["reward", "val_pass@1", "val_accuracy", "val_loss", "val_rewards/accuracies"],
                       preset.out / f"sweep_{name}.png")
    if png is not None:
        lines += [f"![in-training curves](sweep_{name}.png)", "",
                  "The curves are what each run logged while training (its own held-out evaluations, "
                  "on dev prompts).", ""]
    lines += ["Changes are paired on the same dev problems, with the 95 % bootstrap interval; ✓: it excludes 0. "
              "Wall time and peak RSS are the pipeline runner's, per training stage.", ""]
    md = preset.out / f"sweep_{name}.md"
    with atomic_write(md, "w") as f:
        f.write("\n".join(lines))
    write_json_atomic(preset.out / f"sweep_{name}.json", data)
    if chosen is not None:
        log(f"sweep: chosen on dev {_setting_text(chosen['setting'])} (of {len(rows)} settings)")
    return md
