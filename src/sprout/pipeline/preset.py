"""A pipeline preset: its YAML format (`Preset`), the stages it expands to, their command lines.

`load_preset` reads and checks configs/pipelines/<name>.yaml (or any path) into stages in run
order: seeds (`expand_seeds`) turn a seeded stage and all that reads it into one stage per seed;
`--set` and `--sweep` (sprout.pipeline.sweep) add options or run a stage once per setting.
`command_args` fills each command's {stage}, {out} and {model}; `select` picks --from/--to.
Nothing here runs a stage: sprout.pipeline.runner does.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from sprout.config import read_yaml
from sprout.errors import SproutError
from sprout.mirror import REPO_ROOT
from sprout.pipeline import sweep

KINDS = ("prep", "train", "eval")
LAUNCHERS = ("python", "accelerate")
PRESETS = REPO_ROOT / "configs" / "pipelines"
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


# ---- the preset ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Stage:
    name: str
    kind: str
    script: Path
    out: str | None = None              # relative to the output root
    config: Path | None = None
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] | None = None    # relative to the output root
    commands: list[list[str]] = dataclasses.field(default_factory=lambda: [[]])  # argument templates
    role: str = ""                      # what the report card reads from it: pretrain, sft, reward, dpo, ...
    seed: int | None = None             # a seeded stage's seed (a train stage gets --train.seed)
    seed_of: str | None = None          # a seeded stage: the preset's stage it runs one seed of
    sweep_of: str | None = None         # a swept stage: the preset's stage it runs one setting of
    setting: dict = dataclasses.field(default_factory=dict)  # a swept stage's options (sprout.pipeline.sweep)


@dataclasses.dataclass
class Preset:
    """A preset (configs/pipelines/*.yaml) is a YAML mapping:

        out: runs/demo                # the output root; every stage's `out` is relative to it
        launcher: python              # how train and eval stages run: python | accelerate
        accelerate_config: null       # the --config_file of `accelerate launch` (launcher: accelerate)
        model: null                   # what {model} in args stands for (a published model to import;
                                      # run_pipeline.py --model overrides it)
        seeds: [1337, 1338, 1339]     # optional, with seed_stages: the seeds (--seeds overrides them)
        seed_stages: [grpo]           # train stages run once per seed (--seed-stages overrides them)
        stages:
          - name: pretrain            # a word; other stages name it in `inputs` and as {pretrain}
            kind: train               # prep | train | eval
            script: scripts/pretrain.py
            config: configs/demo/pretrain.yaml       # passed as --config; its sha256 is an input
            inputs: [pretrain_data]   # the earlier stages whose outputs this one reads
            out: base                 # its output: a folder, a file, or a file prefix
            outputs: [...]            # prep/eval: the files that are its output (default: `out`)
            args: [--data, "{pretrain_data}"]        # {stage} is that stage's out path, {out} its own,
                                                     # {model} the preset's model (a train stage gets
                                                     # --out <its out> at the end)

    Relative `script` and `config` paths are read from the repository root; `out` paths from
    the current directory. `args` may be a list of argument lists: one command each, run in
    order (an eval stage's tasks).

    Seeds: with `seeds`, each stage of `seed_stages` (train stages) and every stage that reads a
    seeded stage (any kind: its evaluation, a prep such as an export, a later trainer) becomes
    one stage per seed N, in place: `<name>_seed<N>`, its out `<out>_seed<N>` (a file's name
    before its suffix; `outputs` under `out` alike), its seeded inputs the same seed's; a train
    stage gets `--train.seed N`. So the whole tail after a seeded stage runs once per seed, all
    seeds from the same earlier stages. `seed_stages` without `seeds` seeds nothing (it names
    what `--seeds` seeds). `--from/--to <name>` mean its first/last seed.
    """

    path: Path
    out: Path
    launcher: str
    accelerate_config: Path | None
    stages: list[Stage]
    model: str | None = None  # what {model} stands for

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise SproutError(f"{self.path}: no stage named {name!r} (stages: {', '.join(s.name for s in self.stages)})")

    def out_of(self, stage: Stage) -> Path | None:
        return self.out / stage.out if stage.out else None


def preset_path(preset: str) -> Path:
    """A preset name (configs/pipelines/<name>.yaml) or a YAML path."""
    if preset.endswith((".yaml", ".yml")) or os.sep in preset:
        return Path(preset)
    path = PRESETS / f"{preset}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESETS.glob("*.yaml"))
        raise SproutError(f"--preset {preset}: no {path} (presets: {', '.join(known)}; or give a PATH.yaml)")
    return path


def _repo_path(value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() else REPO_ROOT / path


def _str_list(where: str, value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                              for v in value):
        raise SproutError(f"{where}: expected a list of strings, got {value!r}")
    return [str(v) for v in value]


def load_preset(path: str | Path, out: str | Path | None = None, model: str | None = None,
                seeds: list[int] | None = None, seed_stages: list[str] | None = None, *,
                sets: list | None = None, sweeps: list | None = None, sweep_tasks: list[str] | None = None) -> Preset:
    """Read and check a preset; `out` overrides its output root, `model` its model, `seeds` and
    `seed_stages` its own; `sets` and `sweeps` (`sprout.pipeline.sweep.parse_option`'s) add an
    option to a stage or sweep one, judged on `sweep_tasks`' dev evaluations (default: all)."""
    path = Path(path)
    data = read_yaml(path)
    known = {"out", "launcher", "accelerate_config", "model", "stages", "seeds", "seed_stages"}
    if extra := set(data) - known:
        raise SproutError(f"{path}: unknown key(s) {', '.join(sorted(extra))} (known: {', '.join(sorted(known))})")
    launcher = data.get("launcher", "python")
    if launcher not in LAUNCHERS:
        raise SproutError(f"{path}: launcher: {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    acc_cfg = data.get("accelerate_config")
    if launcher == "accelerate" and not acc_cfg:
        raise SproutError(f"{path}: launcher accelerate needs accelerate_config (an accelerate config file)")
    root = out if out is not None else data.get("out")
    if not root:
        raise SproutError(f"{path}: out: the output root is missing (or pass --out DIR)")
    model = model if model is not None else data.get("model")
    if model is not None and not isinstance(model, str):
        raise SproutError(f"{path}: model: expected a folder, hub id or .gguf path, got {model!r}")
    stages_data = data.get("stages")
    if not isinstance(stages_data, list) or not stages_data:
        raise SproutError(f"{path}: stages: expected a non-empty list of stages")
    stages: list[Stage] = []
    fields = {"name", "kind", "script", "config", "inputs", "out", "outputs", "args", "role"}
    for i, raw in enumerate(stages_data):
        where = f"{path}: stages[{i}]"
        if not isinstance(raw, dict):
            raise SproutError(f"{where}: expected a mapping")
        name = raw.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise SproutError(f"{where}: name: expected a word (letters, digits, _), got {name!r}")
        where = f"{path}: stage {name}"
        if extra := set(raw) - fields:
            raise SproutError(f"{where}: unknown key(s) {', '.join(sorted(extra))} (known: {', '.join(sorted(fields))})")
        if any(s.name == name for s in stages):
            raise SproutError(f"{where}: a second stage with this name")
        kind = raw.get("kind")
        if kind not in KINDS:
            raise SproutError(f"{where}: kind: {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(raw.get("script"), str):
            raise SproutError(f"{where}: script: expected a path")
        inputs = _str_list(f"{where}: inputs", raw.get("inputs", []))
        for name_in in inputs:
            if not any(s.name == name_in for s in stages):
                raise SproutError(f"{where}: inputs: {name_in!r} is not an earlier stage")
        args = raw.get("args", [])
        commands = [_str_list(f"{where}: args", a) for a in args] if args and isinstance(args[0], list) \
            else [_str_list(f"{where}: args", args)]
        for arg in (a for c in commands for a in c):
            for ref in PLACEHOLDER.findall(arg):
                if ref == "model" and model is None:
                    raise SproutError(f"{where}: args: {{model}} but the preset has no model (or pass --model)")
                if ref not in ("out", "model") and ref not in inputs:
                    raise SproutError(f"{where}: args: {{{ref}}} names no stage in its inputs ({', '.join(inputs) or 'none'})")
        if kind == "train" and not raw.get("out"):
            raise SproutError(f"{where}: out: a train stage needs its run folder")
        outputs = raw.get("outputs")
        script = raw["script"]
        role = raw.get("role") or Path(script).stem.removeprefix("train_")
        stages.append(Stage(name=name, kind=kind, script=_repo_path(script), out=raw.get("out"),
                            config=_repo_path(raw["config"]) if raw.get("config") else None, inputs=inputs,
                            outputs=None if outputs is None else _str_list(f"{where}: outputs", outputs),
                            commands=commands, role=role))
    if seed_stages is not None and not (seeds if seeds is not None else data.get("seeds")):
        raise SproutError(f"--seed-stages {','.join(seed_stages)}: no seeds to run them with (pass --seeds N,N,... "
                          f"or set the preset's seeds:)")
    seeds = seeds if seeds is not None else data.get("seeds")
    seed_stages = seed_stages if seed_stages is not None else data.get("seed_stages")
    if seed_stages is not None:
        for name in _str_list(f"{path}: seed_stages", seed_stages):
            if next((s.kind for s in stages if s.name == name), None) != "train":
                raise SproutError(f"{path}: seed_stages: {name!r} is not a train stage of this preset (a stage "
                                  f"reading a seeded stage runs per seed by itself)")
    if sets:
        for stage, key, _ in sets:  # an option given twice: the last would win, silently
            if any(stage == name and key == k for name, k, _ in sweeps or []):
                raise SproutError(f"--set {stage}:{key}: {key} is also swept (--sweep {stage}:{key}=...)")
            if key == "train.seed" and seeds and stage in (seed_stages or []):
                raise SproutError(f"--set {stage}:train.seed: {stage} is seeded (--seeds gives each run its seed)")
        stages = sweep.apply_sets(path, stages, sets)
    if sweeps and seeds and {name for name, _, _ in sweeps} & set(seed_stages or []):
        raise SproutError(f"--sweep {sweeps[0][0]} with --seeds: a sweep chooses a setting on dev, seeds then "
                          f"report it; run the sweep first, then the seeds with --set (or sweep train.seed)")
    if seeds:
        stages = expand_seeds(path, stages, seeds, seed_stages)
    if sweeps:
        stages = sweep.expand_sweep(path, stages, sweeps, sweep_tasks)
    return Preset(path=path, out=Path(root), launcher=launcher,
                  accelerate_config=_repo_path(acc_cfg) if acc_cfg else None, stages=stages, model=model)


def seeded_path(rel: str, seed: int) -> str:
    """`grpo_model` -> `grpo_model_seed1337`; a file `eval/x.json` -> `eval/x_seed1337.json`."""
    return sweep.tagged_path(rel, f"seed{seed}")


def expand_seeds(path: Path, stages: list[Stage], seeds, seed_stages) -> list[Stage]:
    """The stages with each seeded one (a stage of `seed_stages`, or one reading a seeded stage)
    replaced, in place, by one stage per seed (`Preset`)."""
    if not seed_stages:
        raise SproutError(f"{path}: seeds {seeds!r} need the train stages run once per seed (seed_stages:, "
                          f"--seed-stages)")
    whole = lambda n: isinstance(n, int) and not isinstance(n, bool) and n >= 0  # noqa: E731
    if not isinstance(seeds, list) or not all(map(whole, seeds)) or len(set(seeds)) < len(seeds):
        raise SproutError(f"{path}: seeds: expected distinct whole numbers >= 0, got {seeds!r}")
    seeded: set[str] = set()
    out: list[Stage] = []
    for stage in stages:
        reads = [name for name in stage.inputs if name in seeded]
        if stage.name not in seed_stages and not reads:
            out.append(stage)
            continue
        seeded.add(stage.name)
        if stage.outputs and (stage.out is None or any(
                rel != stage.out and not rel.startswith(stage.out.rstrip("/") + "/") for rel in stage.outputs)):
            raise SproutError(f"{path}: stage {stage.name}: a seeded stage (or one reading a seeded stage) needs an "
                              f"out that holds all its outputs")
        for n in seeds:
            def fill(arg: str) -> str:  # {grpo} -> {grpo_seed<n>} for each seeded input
                return PLACEHOLDER.sub(lambda m: f"{{{m.group(1)}_seed{n}}}" if m.group(1) in reads else m.group(0),
                                       arg)
            out_n = seeded_path(stage.out, n) if stage.out else None
            out.append(dataclasses.replace(
                stage, name=f"{stage.name}_seed{n}", out=out_n, seed=n, seed_of=stage.name,
                inputs=[f"{name}_seed{n}" if name in reads else name for name in stage.inputs],
                outputs=None if stage.outputs is None else [out_n + rel[len(stage.out):] for rel in stage.outputs],
                commands=[[fill(a) for a in c] for c in stage.commands]))
    names = [s.name for s in out]
    if clash := next((name for name in names if names.count(name) > 1), None):
        raise SproutError(f"{path}: a seeded stage's name {clash} is also another stage's")
    return out


def select(preset: Preset, start: str | None, end: str | None) -> tuple[list[Stage], list[Stage]]:
    """(stages before --from, stages from --from to --to), in the preset's order; a seeded or
    swept stage's name stands for its first seed or setting (--from) or its last (--to)."""
    def at(name: str) -> list[int]:
        found = [i for i, s in enumerate(preset.stages) if name in (s.name, s.seed_of, s.sweep_of)]
        if found and all(preset.stages[i].kind == "eval" and preset.stages[i].sweep_of == name for i in found):
            raise SproutError(f"{name}: a swept stage's evaluation runs right after each setting; name one setting's "
                              f"({preset.stages[found[0]].name}) or the swept train stage")
        return found or [preset.stages.index(preset.stage(name))]
    i = at(start)[0] if start else 0
    j = at(end)[-1] if end else len(preset.stages) - 1
    if i > j:
        raise SproutError(f"--from {start} comes after --to {end} in {preset.path}")
    return preset.stages[:i], preset.stages[i:j + 1]


# ---- command lines ------------------------------------------------------------------------------
def command_args(preset: Preset, stage: Stage) -> list[list[str]]:
    """Each command's arguments with {stage} and {out} filled in (paths under the output root),
    and {model} (the preset's model, as written: a script expands ${SPROUT_MIRROR} in it)."""
    paths = {s.name: str(preset.out_of(s)) for s in preset.stages if s.out}
    paths["out"] = str(preset.out_of(stage)) if stage.out else ""
    if preset.model is not None:
        paths["model"] = preset.model

    def fill(arg: str) -> str:
        def one(m: re.Match) -> str:
            if m.group(1) not in paths or not paths[m.group(1)]:
                raise SproutError(f"{preset.path}: stage {stage.name}: {{{m.group(1)}}} has no out path")
            return paths[m.group(1)]
        return PLACEHOLDER.sub(one, arg)

    config = ["--config", str(stage.config)] if stage.config else []
    seed = ["--train.seed", str(stage.seed)] if stage.kind == "train" and stage.seed is not None else []
    run_dir = ["--out", paths["out"]] if stage.kind == "train" else []  # a trainer's run folder
    return [config + [fill(a) for a in args] + seed + run_dir for args in stage.commands]
