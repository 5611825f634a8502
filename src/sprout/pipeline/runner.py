"""The pipeline runner: every stage of a preset, in order, skipping what is done.

A preset (sprout.pipeline.preset: configs/pipelines/*.yaml, seeds, sweeps) lists the stages:
a prep stage runs as a plain process, a train or eval stage under `accelerate
launch` when the launcher is `accelerate`. `<out>/pipeline_state.json` (written atomically)
records for each stage its input hashes (`stage_inputs`), its wall time over every run of it
(a run whose runner was killed outright counts up to its stage's last written file,
`lost_run_s`), its peak resident memory (`peak_rss_mb`, `run_child`: of the runs the runner
saw end) and, once it completes, its output hashes. Same inputs and
outputs that verify (`outputs_verify`) -> skipped; same inputs, no completion: a train stage
with a checkpoint resumes (`--out DIR --resume`), any other runs again; otherwise it runs
afresh (`--overwrite` for a train stage). A missing script or config stops the pipeline with
one line naming it, when its stage is reached. One runner per output root (`pipeline.lock`); at
start the `.tmp-*` a killed write left are removed; a child process dies with the runner.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from sprout.atomic import sha256_file, write_json_atomic
from sprout.locks import locked
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import WEIGHTS, read_meta
from sprout.mirror import ENV as MIRROR_ENV
from sprout.mirror import REPO_ROOT
from sprout.pipeline.preset import Preset, Stage, command_args, select

STATE = "pipeline_state.json"
LOCK = "pipeline.lock"


# ---- commands and hashes ------------------------------------------------------------------------
def launch_prefix(preset: Preset, stage: Stage) -> list[str]:
    if stage.kind != "prep" and preset.launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(preset.accelerate_config)]
    return [sys.executable]


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def stage_inputs(preset: Preset, stage: Stage, state: dict) -> dict:
    """What a stage's result depends on: its config's sha256, its command lines (the output root
    written as {root} and the repository as {repo}, so a moved root or another checkout keeps its
    hashes) and the input and output hashes of the stages it reads (so a change anywhere upstream
    reaches it)."""
    root, repo = str(preset.out), str(REPO_ROOT)
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
            "commands": [[a.replace(root, "{root}").replace(repo, "{repo}") for a in c]
                         for c in command_args(preset, stage)],
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


def upgrade_state(state: dict) -> list[str]:
    """Rewrite in place every record (of any preset run in this root: seeds, sweep settings)
    whose inputs an earlier sprout hashed with this checkout's path written out: the path
    becomes {repo} in its command lines, the upstream input hashes it names become their
    upgraded ones, and its input hash is recomputed. Only a record whose `inputs` digest to its
    `input_hash` is touched; returns the names rewritten. What was skipped or resumed still is."""
    repo, renamed, upgraded = str(REPO_ROOT), {}, []
    for _ in range(len(state["stages"])):  # upstream records first; passes until nothing changes
        changed = False
        for name, rec in state["stages"].items():
            inputs = rec.get("inputs")
            if not isinstance(inputs, dict) or digest(inputs) != rec.get("input_hash"):
                continue
            new = copy.deepcopy(inputs)
            new["commands"] = [[a.replace(repo, "{repo}") for a in c] for c in inputs.get("commands", [])]
            for up in new.get("upstream", {}).values():
                up["inputs"] = renamed.get(up.get("inputs"), up.get("inputs"))
            if new != inputs:
                renamed[rec["input_hash"]] = digest(new)
                rec["inputs"], rec["input_hash"] = new, digest(new)
                upgraded.append(name)
                changed = True
        if not changed:
            break
    return sorted(set(upgraded), key=upgraded.index)


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
    """A stage's process exited non-zero (its own output says why); `code`: the runner's exit status;
    `interrupted`: stopped by a signal or Ctrl-C/SIGTERM, not failed by itself."""

    def __init__(self, message: str, code: int, interrupted: bool = False):
        super().__init__(message)
        self.code, self.interrupted = code, interrupted


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
                           f"{'resume it' if stage.kind == 'train' else 'run it again'}", 128 - code, True)
    if code in (130, 143):  # interrupted by Ctrl-C / SIGTERM: the trainer saved a checkpoint
        return StageFailed(f"stage {stage.name} was interrupted; run the pipeline again to resume it", code, True)
    return StageFailed(f"stage {stage.name} failed ({stage.script.name} exited with status {code}; "
                       f"its output above says why)", 1)


def lost_run_s(out: Path, rec: dict) -> float:
    """Seconds of a stage's run whose runner was killed outright (SIGKILL, a lost machine), so
    never added its wall time: from the run's start (`started_at`, wall clock) to the last
    modification of a file under the stage's output `out` (a lower bound); 0 when none was lost."""
    started = rec.get("started_at")
    if started is None or not out.exists():
        return 0.0
    files = [out] if out.is_file() else [p for p in out.rglob("*") if p.is_file()]
    last = max((p.stat().st_mtime for p in files), default=started)
    return max(0.0, last - started)


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
    lost = lost_run_s(out, rec) if resume else 0.0
    if lost:
        log(f"    its last run's runner was killed: {lost:.0f} s of it counted, up to its last written file")
    state["stages"][stage.name] = {"status": "running", "input_hash": input_hash, "inputs": inputs,
                                   "wall_s": rec.get("wall_s", 0.0) + lost if resume else 0.0,
                                   "peak_rss_mb": rec.get("peak_rss_mb", 0.0) if resume else 0.0,
                                   "started_at": time.time()}
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
        del state["stages"][stage.name]["started_at"]  # this run's time is counted
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
    `start` and every stage after it run again. Raises StageFailed when a stage's process fails;
    a sweep's setting that fails (not one interrupted) is passed over with what reads it, the
    other settings go on, and StageFailed names every failed setting at the end.
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
        if upgraded := upgrade_state(state):
            write_state(preset.out, state)
            log(f"recorded the inputs of {len(upgraded)} stage(s) with the repository as {{repo}} (same inputs)")
        for stage in before:
            rec = state["stages"].get(stage.name) or {}
            if rec.get("status") != "done" or not outputs_verify(preset, stage, rec):
                raise SproutError(f"--from {start}: the earlier stage {stage.name} is not done; "
                                  f"run without --from (or --from {stage.name})")
        t0, failed, passed_over = time.perf_counter(), [], set()
        for stage in chosen:
            if passed_over & set(stage.inputs):
                log(f"==> {stage.name}: passed over (it reads a failed setting)")
                passed_over.add(stage.name)
                continue
            try:
                run_stage(preset, stage, state, env, force=start is not None, log=log)
            except StageFailed as exc:
                if not stage.sweep_of or exc.interrupted:  # not a sweep's setting, or interrupted: stop here
                    raise
                log(f"==> {stage.name}: failed; the other settings go on")
                failed.append(stage.name)
                passed_over.add(stage.name)
        if failed:
            raise StageFailed(f"{len(failed)} setting(s) failed: {', '.join(failed)} (their output above says why; "
                              f"run the pipeline again to resume them)", 1)
        log(f"pipeline: {len(chosen)} stage(s) up to date in {time.perf_counter() - t0:.1f}s ({preset.out})")
    return state
