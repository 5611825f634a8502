"""A training script's command line and its run folder, before the stage loads torch.

`run_parser` + `parse_run_config` give every script --help with each config field, and:
  - a fresh run into a folder that holds a run (`run_files`) is refused unless --overwrite,
    which deletes those files and only those, once the stage has checked its inputs
    (`clear_deferred`, before the new run's first write);
  - --resume reads the run's own <out>/config.yaml (refused, naming it, when it lacks a field),
    keeps the run's length unless --train.max_steps is given, and exits 0 with "nothing to do"
    when the run is complete.
Nothing here imports torch, so --help, a refused folder and "nothing to do" never load it.
One trainer at a time per run folder: `run_lock` holds `<out>/run.lock` (rank 0) while it
trains, --overwrite deletes nothing before it holds it, and a second trainer exits 2 naming the
folder and the holder's pid (with --overwrite as the command line is read, writing nothing). A
run folder holding a symbolic link where a trainer writes (`RUN_WRITES`, or inside those
folders) is refused in one line naming it (`check_run_links`), before anything is written. Setup, from taking the folder to the first step, leaves the folder
as it was when it ends early: a refusal, an error, or SIGINT / SIGTERM (then exit 128 + the
signal number) puts back what the run wrote or deleted there (`run_lock`; --overwrite's old
files are only moved aside until `setup_finished`). An interrupted run prints the command that
resumes it (`resume_command`) and exits with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import sys
from glob import escape as glob_escape
from pathlib import Path
from typing import IO, Iterator

from sprout.atomic import first_missing, symlink_error
from sprout.locks import check_unlocked, hold_lock
from sprout.config import load_config, missing_fields, parse_overrides, read_yaml
from sprout.config_help import add_config_help
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import META, read_meta, resolve_checkpoint
from sprout.formats.verify_inputs import VERIFY_MODES
from sprout.engine.run_setup import OVERWRITTEN, RunSetup, Stopped, catch_signals, file_state


def run_parser(doc: str, config_example: str) -> argparse.ArgumentParser:
    """The arguments every training script shares: --config, --out, --resume [PATH|latest], --overwrite.

    A script adds its own (--data, --init, ...); `parse_run_config` then reads the config with
    the remaining `--section.field VALUE` overrides.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"YAML config ({config_example}); on --resume: default <out>/config.yaml")
    p.add_argument("--out", help="run directory; overrides out")
    p.add_argument("--resume", nargs="?", const="latest", metavar="PATH|latest",
                   help="continue from a checkpoint (default: the latest in --out), with the run's own "
                        "config.yaml and length (--train.max_steps N changes the length)")
    p.add_argument("--overwrite", action="store_true",
                   help="start again in an --out that holds a run: delete that run's files first")
    return p


VERIFY_FILES_HELP = ("start-up data check: full (sha256 of every file, the default) or sizes (skip the hashes, "
                     "for data too big to hash at every start); overrides data.verify")
VERIFY_MANIFEST_HELP = ("start-up data check: full (both files listed in the prep's manifest.json with their "
                        "sha256, the default) or sizes (listed only, no hashing); overrides data.verify")


def add_input_flags(parser: argparse.ArgumentParser, *, data_help: str, data_metavar: str | None = None,
                    data_field: str = "path", init_help: str | None = None,
                    verify_help: str | None = None) -> None:
    """The input flags of a training script: --data (overrides data.<data_field>), --init when
    `init_help` is given, --data-verify when `verify_help` is given; `parse_run_config` copies
    them into the config (`apply_input_flags`)."""
    parser.add_argument("--data", metavar=data_metavar, help=f"{data_help}; overrides data.{data_field}")
    if init_help is not None:
        parser.add_argument("--init", metavar="CKPT", help=f"{init_help}; overrides init")
    if verify_help is not None:
        parser.add_argument("--data-verify", choices=VERIFY_MODES, help=verify_help)
    parser.set_defaults(input_data_field=data_field)


def apply_input_flags(args: argparse.Namespace, cfg) -> None:
    """Copy the flags of `add_input_flags` that were given into `cfg` (data.verify, data.<field>, init)."""
    if getattr(args, "data_verify", None):
        cfg.data.verify = args.data_verify
    if getattr(args, "data", None):
        setattr(cfg.data, args.input_data_field, args.data)
    if getattr(args, "init", None):
        cfg.init = args.init


# ---- the run folder -----------------------------------------------------------------------------
RUN_FILES = ("config.yaml", "metrics.jsonl", "report.md", "loss.png", "checkpoints", "tokenizer")
RUN_LOCK = "run.lock"  # held by the trainer writing the folder; not a file of the run (never deleted with them)
TRACKER_DIR = "sprout"  # TensorBoard's event folder: accelerate's project_dir / the project MetricsLogger names
RUN_WRITES = (*RUN_FILES, TRACKER_DIR, RUN_LOCK)  # where a trainer writes in its run folder


def is_rank0() -> bool:
    """Rank 0 of a launched run (torchrun / accelerate launch set RANK), or a lone process;
    for what happens before the accelerator exists."""
    return os.environ.get("RANK", "0") == "0"


def print_rank0(message: str) -> None:
    """`message` printed by rank 0 only (`is_rank0`: before the accelerator exists)."""
    if is_rank0():
        print(message, flush=True)


def run_files(out: str | Path) -> list[Path]:
    """The files a run wrote in `out`: RUN_FILES that exist, and the TensorBoard folder when the
    run's config.yaml names the tensorboard tracker. Anything else in `out` is not the run's."""
    out = Path(out)
    found = [out / name for name in RUN_FILES if (out / name).exists()]
    if (out / TRACKER_DIR).is_dir() and (out / "config.yaml").is_file():
        try:
            trackers = (read_yaml(out / "config.yaml").get("train") or {}).get("trackers") or []
        except SproutError:
            trackers = []
        if "tensorboard" in trackers:
            found.append(out / TRACKER_DIR)
    return found


def latest_step(out: str | Path) -> int | None:
    """Step of the latest checkpoint in `<out>/checkpoints`, or None when there is none."""
    try:
        return int(read_meta(Path(out) / "checkpoints", verify=False)["step"])
    except (SproutError, OSError, ValueError, KeyError, TypeError):
        steps = [int(p.name[5:]) for p in (Path(out) / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
        return max(steps) if steps else None


def check_run_links(out: str | Path) -> None:
    """Refuse, naming it, a symbolic link where a trainer writes in `out`: one of `RUN_WRITES`,
    or anything inside those that are folders (checkpoints, the tokenizer copy, TensorBoard's
    events). `out` itself may be a link: the run then lives where it points."""
    out = Path(out)
    for name in RUN_WRITES:
        path = out / name
        if path.is_symlink():
            raise symlink_error(path, "the trainer")
        if path.is_dir():
            for root, dirs, files in os.walk(path):  # never into a linked folder: it is refused first
                for entry in sorted(dirs + files):
                    if os.path.islink(os.path.join(root, entry)):
                        raise symlink_error(os.path.join(root, entry), "the trainer")


_pending_clear: dict[Path, list[Path]] = {}  # run folder -> the old run's files --overwrite deletes later


def check_fresh_run(out: str | Path, overwrite: bool = False, resumable: bool = True, *,
                    defer: bool = False) -> list[Path]:
    """A fresh run may start in `out` when it holds no run: returns the old run's files (`run_files`)
    that it replaces, none when there is none. With `overwrite` they are deleted later, by the
    caller once it holds the folder and is about to write (with `defer`: `clear_deferred`), so a
    run refused by its own checks leaves the old one whole; a folder another process holds now is
    refused at once (`check_unlocked`, rank 0: nothing is written). Otherwise one line says what
    to pass (--resume only when the script has it: `resumable`). A folder with a link where a
    trainer writes is refused first (`check_run_links`)."""
    check_run_links(out)
    files = run_files(out)
    if not files:
        return []
    if overwrite:
        if is_rank0() and Path(out).resolve() not in _held_runs:
            check_unlocked(out, RUN_LOCK, "trainer")  # another trainer may be writing this run
        if defer:
            _pending_clear[Path(out).resolve()] = files
        return files
    step = latest_step(out)
    held = f"holds a run at step {step}" if step is not None else \
        f"holds the files of a run without a checkpoint ({', '.join(f.name for f in files)})"
    resume = "pass --resume to continue it or " if step is not None and resumable else "pass "
    raise SproutError(f"{out} {held}; {resume}--overwrite to start again")


_held_runs: dict[Path, IO] = {}  # run folder -> its open lock file, while this process holds it
_before_hold: dict[Path, tuple] = {}  # run folder -> (first folder hold_run created, lock file before)
_setups: dict[Path, RunSetup] = {}  # run folder -> its setup, while `run_lock` holds it


def hold_run(out: str | Path) -> bool:
    """Hold the run folder `out` (`RUN_LOCK`, `sprout.locks.hold_lock`) until `release_run` or
    the process ends; True when this call took it, False when this process held it already.
    Refuses a folder with a link where a trainer writes (`check_run_links`); once held, removes
    the old files a killed --overwrite left moved aside."""
    key = Path(out).resolve()
    if key in _held_runs:
        return False
    check_run_links(out)
    created = first_missing(out)
    before = file_state(Path(out) / RUN_LOCK)
    _held_runs[key] = hold_lock(out, RUN_LOCK, "trainer")
    _before_hold[key] = (created, before)
    for stale in Path(out).glob(glob_escape(OVERWRITTEN) + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    return True


def release_run(out: str | Path) -> None:
    key = Path(out).resolve()
    _before_hold.pop(key, None)
    f = _held_runs.pop(key, None)
    if f is not None:
        f.close()


@contextlib.contextmanager
def run_lock(out: str | Path, main: bool = True) -> Iterator[None]:
    """The run folder held for the block (on the main process: `main`), and released after it.
    The block is the run's setup until `setup_finished(out)`: if it ends before that (an
    exception, or SIGINT / SIGTERM, which stop the setup at once), the main process first puts
    the folder back as it was when it was taken (`sprout.engine.run_setup`); a signal then ends
    the process with 128 + its number."""
    if main:
        hold_run(out)
    key = Path(out).resolve()
    names = [name for name in RUN_WRITES if name != RUN_LOCK]
    setup = _setups[key] = RunSetup(Path(out), names, *_before_hold.get(key, (None, None)), main=main)
    restore = catch_signals(lambda: any(s.active for s in _setups.values()))
    try:
        yield
    except BaseException as exc:
        if setup.active:
            setup.roll_back(Path(out) / RUN_LOCK, _held_runs.get(key))
            if isinstance(exc, Stopped):
                name = signal.Signals(exc.signum).name
                print_rank0(f"stopped by {name} before the first step; {out} is as it was before this run")
                raise SystemExit(128 + exc.signum) from None
        raise
    finally:
        _setups.pop(key, None)
        restore()
        if main:
            release_run(out)


def setup_finished(out: str | Path) -> None:
    """The run in `out` is about to take its first step: its setup is over (`run_lock`), and the
    old files --overwrite moved aside are deleted."""
    setup = _setups.get(Path(out).resolve())
    if setup is not None and setup.active:
        setup.finish()


def clear_run(out: str | Path, files: list[Path] | None = None) -> None:
    """Delete the run's files in `out` (`run_files`), nothing else."""
    files = run_files(out) if files is None else files
    for f in files:
        if f.is_dir() and not f.is_symlink():
            shutil.rmtree(f)
        else:
            f.unlink()
    print(f"--overwrite: deleted the previous run's {', '.join(f.name for f in files)} in {out}", flush=True)


def clear_deferred(out: str | Path, main: bool = True) -> None:
    """Delete the old run's files that --overwrite left in `out` (`check_fresh_run` with `defer`),
    on the main process (`main`): called once the stage has checked its inputs, just before the
    new run's first write. Inside `run_lock`'s setup they are moved aside instead, and deleted
    when the first step starts (`setup_finished`)."""
    key = Path(out).resolve()
    old_run = _pending_clear.pop(key, None)
    if old_run and main:
        files = [f for f in old_run if f.exists()]
        setup = _setups.get(key)
        if setup is not None and setup.active:
            if files:
                setup.put_aside(files)
        else:
            clear_run(out, files)


def resume_command(out: str | Path, world_size: int = 1) -> str:
    """The command line that resumes the run in `out` with this script (its own config.yaml)."""
    cmd = shlex.join([sys.argv[0], "--out", str(out), "--resume"])
    if world_size > 1:
        return f"accelerate launch <the same launch options> {cmd}"
    return f"python {cmd}"


# ---- the config, fresh or resumed ---------------------------------------------------------------
def parse_run_config(parser: argparse.ArgumentParser, config_cls):
    """(args, config): the YAML config with the command line's overrides applied, then --out,
    after the run-folder checks (see the module docstring), then the flags of `add_input_flags`.

    Fresh run: --config (or the defaults) + overrides; refused when --out holds a run, unless
    --overwrite. --resume: the run's own <out>/config.yaml (else the checkpoint's config), or
    --config when given (the checkpoint refuses one that differs in a field a resume may not
    change); train.max_steps stays the run's unless given on the command line.
    """
    add_config_help(parser, config_cls)
    args, rest = parser.parse_known_args()
    overrides = parse_overrides(rest)
    if args.resume and args.overwrite:
        raise SproutError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    if not args.resume:
        cfg = load_config(config_cls, args.config, overrides)
        if args.out:
            cfg.out = args.out
        check_fresh_run(cfg.out, args.overwrite, defer=True)  # deleted after the stage's input checks
    else:
        cfg = _resume_config(args, overrides, config_cls)
        check_run_links(cfg.out)
    apply_input_flags(args, cfg)
    return args, cfg


def _resume_config(args, overrides: dict, config_cls):
    if args.out:
        out = Path(args.out)
    elif args.resume != "latest":
        ckpt = resolve_checkpoint(args.resume)
        out = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    elif args.config:
        out = Path(load_config(config_cls, args.config, overrides).out)
    else:
        raise SproutError("--resume needs --out RUN_DIR (the run to continue)")
    ckpt = resolve_checkpoint(out / "checkpoints" if args.resume == "latest" else args.resume)
    try:
        meta = read_meta(ckpt, verify=False)  # its own hash checked: the step below is the one saved
    except OSError as exc:
        raise SproutError(f"{ckpt / META}: unreadable checkpoint meta ({exc})") from None
    check_same_stage(meta, ckpt, config_cls.stage_name)
    saved_yaml = out / "config.yaml"
    saved = read_yaml(saved_yaml) if saved_yaml.is_file() else meta.get("config") or {}
    source = saved_yaml if saved_yaml.is_file() else ckpt / META
    missing = missing_fields(config_cls, saved)
    if missing:
        raise SproutError(f"{source}: no {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} (written by "
                          f"an earlier version of sprout); train the run again (--overwrite)")
    if args.config:
        cfg = load_config(config_cls, args.config, overrides)
    else:
        cfg = load_config(config_cls, None, overrides, base=saved, where=str(source))
    cfg.out = str(args.out) if args.out else (cfg.out if args.config else str(out))
    saved_steps = (saved.get("train") or {}).get("max_steps")
    if "max_steps" in (overrides.get("train") or {}):
        if cfg.train.max_steps != saved_steps:
            print_rank0(f"train.max_steps {saved_steps} -> {cfg.train.max_steps or 'auto'} (from the command line)")
    elif saved_steps is not None:
        if args.config and cfg.train.max_steps not in (None, saved_steps):
            print_rank0(f"{args.config}: train.max_steps {cfg.train.max_steps} ignored: the run keeps its length of "
                        f"{saved_steps} steps (pass --train.max_steps N to change it)")
        cfg.train.max_steps = saved_steps
    step = int(meta["step"])
    if cfg.train.max_steps is not None and step >= cfg.train.max_steps:
        print_rank0(f"nothing to do: {out} is complete at step {step}"
                    + (f" (train.max_steps {cfg.train.max_steps})" if step > cfg.train.max_steps else "")
                    + "; pass --train.max_steps N to train longer")
        raise SystemExit(0)
    return cfg


def resolve_resume(resume: str | None, out: str | Path) -> Path | None:
    """--resume PATH, or `latest` for the newest checkpoint in the run's own folder."""
    if not resume:
        return None
    return resolve_checkpoint(Path(out) / "checkpoints" if resume == "latest" else resume)


STAGE_SCRIPTS = {"pretrain": "scripts/pretrain.py", "sft": "scripts/train_sft.py", "reward": "scripts/train_reward.py",
                 "dpo": "scripts/train_dpo.py", "ppo": "scripts/train_ppo.py", "grpo": "scripts/train_grpo.py"}


def check_same_stage(meta: dict, ckpt: Path, stage: str) -> None:
    """A resume continues a run of its own stage: a checkpoint of another stage is refused,
    naming the stage it belongs to and the script that resumes it."""
    saved = meta.get("stage")
    if not stage or not saved or saved == stage:
        return
    script = STAGE_SCRIPTS.get(saved)
    hint = f"; resume it with {script}" if script else ""
    raise SproutError(f"{ckpt / META}: a checkpoint of a {saved} run, which the {stage} trainer cannot resume{hint}")
