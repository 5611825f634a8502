"""Settings chosen on the dev split: a train stage run once per setting, each judged on dev only.

`--sweep STAGE:KEY=V1,V2,...` (scripts/run_pipeline.py; several, for one stage, multiply) turns
the train stage STAGE into one stage per setting, `<name>_<tag>` into `<out>_<tag>` (the tag is
each key's last part and its value: `lr2e-5`), given `--KEY VALUE`. An eval stage reading STAGE
runs right after each setting with only its commands shown to read dev (`reads_dev_only`), so a
sweep never reads a test split. Every other stage reading STAGE or a swept evaluation, and all
that follows from it, is left out: a sweep ends at its evaluations. Its table:
sprout.pipeline.sweep_table. `--set STAGE:KEY=VALUE` gives one stage (every seed of it) one
more option: the chosen setting.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

from sprout.errors import SproutError

OPTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
OPTION_VALUE = re.compile(r"^[A-Za-z0-9_.+-]+$")


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
    if not OPTION_NAME.match(key):
        raise SproutError(f"{flag} {text}: {key!r} is not an option name (words joined by dots: optim.lr)")
    if not values or not all(OPTION_VALUE.match(v) for v in values):
        raise SproutError(f"{flag} {text}: each value must be letters, digits or _ . + - (got {values_text!r})")
    if not many and len(values) > 1:
        raise SproutError(f"{flag} {text}: one value only (--sweep tries several)")
    if len(set(map(_same_value, values))) < len(values):
        raise SproutError(f"{flag} {text}: a value is listed twice")
    return stage, key, values


def _same_value(value: str):
    """A value as it compares with the others: a number by its value (1e-5 is 1E-5 is 0.00001)."""
    try:
        return float(value)
    except ValueError:
        return value


def parse_select(text: str) -> tuple[str, str]:
    """`--sweep-select arith:pass@1` -> ("arith", "pass@1")."""
    task, sep, figure = text.partition(":")
    if not task or not sep or not figure:
        raise SproutError(f"--sweep-select {text}: expected TASK:FIGURE (e.g. arith:pass@1)")
    return task, figure


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


def reads_dev_only(command: list[str]) -> bool:
    """Whether an eval command is shown to read a dev split: `--split dev`; or `--task` without
    `--split` (evaluate.py's default is dev); or a `*_dev.*` file argument and no `--split`.
    Anything else (`--split test`, a test or unnamed file) is not kept in a sweep."""
    pairs = list(zip(command, command[1:] + [""]))
    split = next((b for a, b in pairs if a == "--split"), None) or \
        next((a.split("=", 1)[1] for a in command if a.startswith("--split=")), None)
    if split is not None:
        return split == "dev"
    if any(Path(a).stem.endswith("_test") for a in command):
        return False
    return any(a == "--task" for a, _ in pairs) or any(Path(a).stem.endswith("_dev") for a in command)


def command_task(command: list[str]) -> str | None:
    pairs = zip(command, command[1:] + [""])
    return next((b for a, b in pairs if a == "--task"), None)


def tagged_path(rel: str, tag: str) -> str:
    """`grpo_model` -> `grpo_model_lr2e-5`; a file `eval/x.json` -> `eval/x_lr2e-5.json` (a seed's
    tag is `seed1337`)."""
    path = Path(rel)
    return str(path.with_name(f"{path.stem}_{tag}{path.suffix}"))


def tag_of(setting: dict[str, str]) -> str:
    """`lr2e-5_seed1`: each key's last part and its value; the whole key (dots as _) where two
    keys share a last part (`optim_lr1e-4_critic_lr1e-3`)."""
    last = [key.rsplit(".", 1)[-1] for key in setting]
    return "_".join(f"{part if last.count(part) == 1 else key.replace('.', '_')}{value}"
                    for part, (key, value) in zip(last, setting.items()))


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
    out, left_out, split, judged = [], set(), set(), False  # split: the eval stages run per setting
    for stage in stages:
        if stage.name == name:
            for setting in settings:
                tag = tag_of(setting)
                out.append(dataclasses.replace(
                    stage, name=f"{name}_{re.sub(r'[^A-Za-z0-9_]', '_', tag)}", out=tagged_path(stage.out, tag),
                    sweep_of=name, setting=setting,
                    commands=[c + [a for k, v in setting.items() for a in (f"--{k}", v)] for c in stage.commands]))
            continue
        reads = [n for n in stage.inputs if n == name or n in left_out or n in split]
        if not reads:
            out.append(stage)
            continue
        dev = [c for c in stage.commands if reads_dev_only(c) and (not tasks or command_task(c) in tasks)]
        if stage.kind != "eval" or reads != [name] or not dev:
            left_out.add(stage.name)
            continue
        judged = True
        split.add(stage.name)
        for copy in (s for s in out if s.sweep_of == name and s.kind == "train"):
            out.append(dataclasses.replace(
                stage, name=f"{stage.name}_{copy.name[len(name) + 1:]}",
                out=tagged_path(stage.out, tag_of(copy.setting)) if stage.out else None,
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
    """The preset without its swept stages: the stages a sweep starts from, and their evaluations."""
    return dataclasses.replace(preset, stages=[s for s in preset.stages if not s.sweep_of])
