"""The pipeline runner: every stage of a preset, in order, skipping what is done.

A preset (configs/pipelines/*.yaml; its format, seeds included, is `Preset`'s docstring) lists
the stages: a prep stage runs as a plain process, a train or eval stage under `accelerate
launch` when the launcher is `accelerate`. `<out>/pipeline_state.json` (written atomically)
records for each stage its input hashes (`stage_inputs`), its wall time, its peak resident
memory (`peak_rss_mb`, `run_child`) and, once it completes, its output hashes. Same inputs and
outputs that verify (`outputs_verify`) -> skipped; same inputs, no completion: a train stage
with a checkpoint resumes (`--out DIR --resume`), any other runs again; otherwise it runs
afresh (`--overwrite` for a train stage). A missing script or config stops the pipeline with
one line naming it, when its stage is reached. One runner per output root (`pipeline.lock`); at
start the `.tmp-*` a killed write left are removed; a child process dies with the runner.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from sprout.atomic import sha256_file, write_json_atomic
from sprout.locks import locked
from sprout.config import read_yaml
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import WEIGHTS, read_meta
from sprout.mirror import ENV as MIRROR_ENV
from sprout.mirror import REPO_ROOT
from sprout.pipeline import sweep

KINDS = ("prep", "train", "eval")
LAUNCHERS = ("python", "accelerate")
STATE = "pipeline_state.json"
LOCK = "pipeline.lock"
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
    path = Path(rel)
    return str(path.with_name(f"{path.stem}_seed{seed}{path.suffix}"))


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
        return found or [preset.stages.index(preset.stage(name))]
    i = at(start)[0] if start else 0
    j = at(end)[-1] if end else len(preset.stages) - 1
    if i > j:
        raise SproutError(f"--from {start} comes after --to {end} in {preset.path}")
    return preset.stages[:i], preset.stages[i:j + 1]


# ---- commands and hashes ------------------------------------------------------------------------
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


def launch_prefix(preset: Preset, stage: Stage) -> list[str]:
    if stage.kind != "prep" and preset.launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(preset.accelerate_config)]
    return [sys.executable]


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def stage_inputs(preset: Preset, stage: Stage, state: dict) -> dict:
    """What a stage's result depends on: its config's sha256, its command lines (the output root
    written as {root}, so a moved or copied root keeps its hashes) and the input and output
    hashes of the stages it reads (so a change anywhere upstream reaches it)."""
    root = str(preset.out)
    for path, what in ((stage.script, "script"), (stage.config, "config")):
        if path is not None and not path.is_file():
            raise SproutError(f"{path}: stage {stage.name}'s {what} does not exist (yet)")
    upstream = {}
    for name in stage.inputs:
        rec = state["stages"].get(name)
        if not rec or rec.get("status") != "done":
            raise SproutError(f"stage {stage.name} needs stage {name}, which is not done (run it first)")
        upstream[name] = {"inputs": rec["input_hash"], "outputs": rec["output_hash"]}
    return {"script": str(stage.script.relative_to(REPO_ROOT) if stage.script.is_relative_to(REPO_ROOT)
                          else stage.script),
            "config_sha256": sha256_file(stage.config) if stage.config else None,
            "commands": [[a.replace(root, "{root}") for a in c] for c in command_args(preset, stage)],
            "upstream": upstream}


def output_files(preset: Preset, stage: Stage) -> list[Path]:
    """A prep or eval stage's output files: `outputs` (each a file or a folder's files) or `out`."""
    named = stage.outputs if stage.outputs is not None else ([stage.out] if stage.out else [])
    files = []
    for rel in named:
        path = preset.out / rel
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp-"))
        else:
            files.append(path)
    return files


def hash_outputs(preset: Preset, stage: Stage) -> dict[str, str]:
    """{path relative to the output root: sha256} of a prep or eval stage's outputs."""
    found = {}
    for f in output_files(preset, stage):
        if not f.is_file():
            raise SproutError(f"{f}: stage {stage.name} finished without writing it")
        found[str(f.relative_to(preset.out))] = sha256_file(f)
    return found


def checkpoint_weights(run_dir: Path) -> tuple[str, int] | None:
    """(weights sha256, step) of a run folder's latest checkpoint when it verifies, else None."""
    try:
        meta = read_meta(run_dir / "checkpoints", verify=True)
    except (SproutError, OSError):
        return None
    return meta["files"][WEIGHTS], int(meta["step"])


def outputs_verify(preset: Preset, stage: Stage, rec: dict) -> bool:
    """Whether a stage recorded as done still has the outputs it recorded: a prep or eval stage's
    files their sha256, a train stage's latest checkpoint verifies and holds the recorded weights."""
    if stage.kind == "train":
        found = checkpoint_weights(preset.out_of(stage))
        return found is not None and found[0] == rec.get("outputs", {}).get("weights_sha256")
    try:
        return hash_outputs(preset, stage) == rec.get("outputs")
    except (SproutError, OSError):
        return False


# ---- state, lock, temporaries -------------------------------------------------------------------
def read_state(root: Path) -> dict:
    path = root / STATE
    if not path.is_file():
        return {"stages": {}}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SproutError(f"{path}: unreadable pipeline state ({exc}); delete it to run every stage again") from None
    if not isinstance(state, dict) or not isinstance(state.get("stages"), dict):
        raise SproutError(f"{path}: not a pipeline state file (no `stages` mapping)")
    return state


def write_state(root: Path, state: dict) -> None:
    write_json_atomic(root / STATE, state)


def remove_temporaries(root: Path) -> list[Path]:
    """Delete every `.tmp-*` file or folder under `root` (what killed atomic writes left)."""
    removed = []
    for folder, dirs, files in os.walk(root):
        for name in [d for d in dirs if d.startswith(".tmp-")]:
            shutil.rmtree(Path(folder) / name, ignore_errors=True)
            dirs.remove(name)
            removed.append(Path(folder) / name)
        for name in files:
            if name.startswith(".tmp-"):
                with contextlib.suppress(FileNotFoundError):
                    (Path(folder) / name).unlink()
                removed.append(Path(folder) / name)
    return removed


# ---- running ------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the runner dies (Linux), so no orphan keeps writing."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class StageFailed(Exception):
    """A stage's process exited non-zero (its own output says why); `code`: the runner's exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def run_child(cmd: list[str], env: dict) -> tuple[int, int]:
    """Run one command; returns its exit status (as Popen's returncode) and its peak resident
    memory in bytes (`ru_maxrss` of wait4: the largest of the child and the descendants it
    waited for, such as `accelerate launch`'s workers; one process's peak, not a sum). SIGTERM
    to the runner is passed on to it (Ctrl-C reaches it directly, as its process group's
    terminal signal), and the runner waits for it to stop."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
    previous = {}

    def forward(signum, _frame):
        if signum == signal.SIGTERM:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, forward)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, usage.ru_maxrss * 1024  # Linux reports KiB
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_message(stage: Stage, code: int) -> StageFailed:
    if code < 0:
        name = signal.Signals(-code).name
        return StageFailed(f"stage {stage.name} was killed by {name}; run the pipeline again to "
                           f"{'resume it' if stage.kind == 'train' else 'run it again'}", 128 - code)
    if code in (130, 143):  # interrupted by Ctrl-C / SIGTERM: the trainer saved a checkpoint
        return StageFailed(f"stage {stage.name} was interrupted; run the pipeline again to resume it", code)
    return StageFailed(f"stage {stage.name} failed ({stage.script.name} exited with status {code}; "
                       f"its output above says why)", 1)


def run_stage(preset: Preset, stage: Stage, state: dict, env: dict, *, force: bool = False, log=print) -> str:
    """Bring one stage up to date; returns what was done: skipped | resumed | ran."""
    inputs = stage_inputs(preset, stage, state)
    input_hash = digest(inputs)
    rec = state["stages"].get(stage.name) or {}
    same = rec.get("input_hash") == input_hash and not force
    if same and rec.get("status") == "done" and outputs_verify(preset, stage, rec):
        log(f"==> {stage.name}: done, skipped (inputs unchanged, outputs verified)")
        return "skipped"
    out = preset.out_of(stage)
    resume = stage.kind == "train" and same and rec.get("status") == "running" and checkpoint_weights(out) is not None
    if stage.kind == "train" and resume:
        commands = [["--out", str(out), "--resume"]]
        log(f"==> {stage.name}: resuming from its latest checkpoint ({out})")
    else:
        commands = command_args(preset, stage)
        why = ("interrupted, running it again" if same and rec.get("status") == "running" else
               "its outputs do not verify, running it again" if same else
               "forced (--from)" if force and rec else
               "inputs changed, running it again" if rec else "running")
        log(f"==> {stage.name}: {why}")
        if stage.kind == "train":
            commands = [c + ["--overwrite"] for c in commands]  # deletes only a run's own files, if any
    state["stages"][stage.name] = {"status": "running", "input_hash": input_hash, "inputs": inputs,
                                   "wall_s": rec.get("wall_s", 0.0) if resume else 0.0,
                                   "peak_rss_mb": rec.get("peak_rss_mb", 0.0) if resume else 0.0}
    write_state(preset.out, state)
    start = time.perf_counter()
    try:
        for args in commands:
            cmd = launch_prefix(preset, stage) + [str(stage.script), *args]
            log("$ " + shlex.join(["python", *cmd[1:]] if cmd[0] == sys.executable else cmd))
            sys.stdout.flush()
            code, peak_rss = run_child(cmd, env)
            rss = state["stages"][stage.name]
            rss["peak_rss_mb"] = max(rss["peak_rss_mb"], round(peak_rss / 2**20, 1))
            if code != 0:
                raise _exit_message(stage, code)
    finally:
        state["stages"][stage.name]["wall_s"] += time.perf_counter() - start
        write_state(preset.out, state)
    if stage.kind == "train":
        found = checkpoint_weights(out)
        if found is None:
            raise SproutError(f"{out}/checkpoints: stage {stage.name} finished without a checkpoint that verifies")
        outputs = {"weights_sha256": found[0], "step": found[1]}
        output_hash = found[0]
    else:
        outputs = hash_outputs(preset, stage)
        output_hash = digest(outputs)
    state["stages"][stage.name].update(status="done", outputs=outputs, output_hash=output_hash)
    write_state(preset.out, state)
    return "resumed" if resume else "ran"


def run_pipeline(preset: Preset, start: str | None = None, end: str | None = None, *,
                 mirror: str | None = None, log=print) -> dict:
    """Run the preset's stages from `start` to `end` (names; default: all); returns the state.

    With `start`, the stages before it must be done (they are checked, never run) and
    `start` and every stage after it run again. Raises StageFailed when a stage's process fails.
    """
    before, chosen = select(preset, start, end)
    env = dict(os.environ)
    if mirror:
        env[MIRROR_ENV] = str(Path(mirror).resolve())
    env.setdefault("PYTHONUNBUFFERED", "1")
    with locked(preset.out, LOCK, "pipeline runner"):
        if removed := remove_temporaries(preset.out):
            log(f"removed {len(removed)} temporary file(s) a killed write left under {preset.out}")
        state = read_state(preset.out)
        for stage in before:
            rec = state["stages"].get(stage.name) or {}
            if rec.get("status") != "done" or not outputs_verify(preset, stage, rec):
                raise SproutError(f"--from {start}: the earlier stage {stage.name} is not done; "
                                  f"run without --from (or --from {stage.name})")
        t0 = time.perf_counter()
        for stage in chosen:
            run_stage(preset, stage, state, env, force=start is not None, log=log)
        log(f"pipeline: {len(chosen)} stage(s) up to date in {time.perf_counter() - t0:.1f}s ({preset.out})")
    return state
