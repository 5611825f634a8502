"""Running the CLI for tests: in a subprocess without leaving stragglers behind, or in the test's
own process when only what the script prints and its exit status are checked.

`run_group` kills every descendant of the command on timeout before raising (a command under
`accelerate launch` starts workers that would otherwise keep its port and the output pipe);
`free_port` gives each 2-process launch a port of its own, so parallel test workers never meet.
`run_until` starts a command and sends it (or one launched worker) SIGTERM once it prints a line.
`run_here` runs `python SCRIPT ARGS...` inside the test's process, as `python` would: the script
as `__main__` with that argv, working directory and environment, stdout and stderr captured, the
exit status its `SystemExit` (1 and the traceback for any other exception), warnings printed as a
new interpreter prints them (tests/test_proc.py compares the two). It skips the interpreter's
start-up (importing torch), but what is read at startup or on first import is not read again:
use it for one-process runs whose outcome is their output and files, not for launches, signals,
kills, resource limits, locks the test's process holds, or start-up settings. What a run may
change is put back (environment, cwd, argv, sys.path, warning filters, logging streams, signal
handlers, torch threads, Python/NumPy/torch random states, accelerate's state, the run folders it
held, `sprout.engine.cli`'s pending --overwrite deletions, `sprout.model.generate`'s once-warnings). `one_error` reads a refused run's one `error:` line,
and `tree` what a folder holds, to show a refused run left it as it was.
"""

import contextlib
import faulthandler
import gc
import hashlib
import io
import logging
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import psutil  # a dependency of accelerate
import torch

REPO = Path(__file__).resolve().parents[1]
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, ...) that kills every process it started on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        for pid in reversed(tree):  # workers first, so none is re-parented before it is found
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_until(cmd: list, marker: str, *, wait: float = 0.0, timeout: float = 300, rank: int | None = None):
    """Start `cmd`, send SIGTERM `wait` seconds after a stdout line starts with `marker` (to the
    launched worker of that RANK when `rank` is given, else to `cmd`); returns (the process's
    result, seconds from the signal to its exit). Every process it started is killed after `timeout`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(marker):
                time.sleep(wait)
                target = proc if rank is None else worker(proc.pid, rank)
                target.send_signal(signal.SIGTERM)
                break
        sent = time.perf_counter()
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc.pid)
    took = time.perf_counter() - sent
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(seen) + stdout, stderr), took


def worker(pid: int, rank: int) -> psutil.Process:
    """The launched process of `pid`'s tree whose environment says RANK=`rank`."""
    return next(p for p in psutil.Process(pid).children(recursive=True) if p.environ().get("RANK") == str(rank))


def kill_tree(pid: int) -> None:
    """SIGKILL to whatever of `pid`'s process tree still runs."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def free_port() -> int:
    """A TCP port free on this machine now, for `--main_process_port` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_error(proc, *needles: str, alone: bool = False) -> str:
    """The one `error:` line of a refused run (exit 2, no traceback), which must contain every
    needle; `alone`: and nothing else on stderr."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stderr)
    assert not alone or lines == errors, proc.stderr
    assert all(n in errors[0] for n in needles), (needles, errors[0])
    return errors[0]


def tree(folder: str | os.PathLike) -> dict:
    """Every entry under `folder`, not following links: a link's target, a file's sha256 and
    mtime, None for a folder ({} when there is no `folder`)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            p = Path(root) / name
            key = str(p.relative_to(folder))
            if p.is_symlink():
                out[key] = ("link", os.readlink(p))
            elif p.is_file():
                out[key] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            else:
                out[key] = None
    return out


def interpreter_warnings() -> None:
    """Warnings as a new interpreter shows them: its default filters (pytest's replaced), each
    printed to sys.stderr. Inside `warnings.catch_warnings()`, which puts everything back."""
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)  # each goes first: the list ends as Python's own
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line))


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every logging handler that writes to a stream (a library's own handler included)."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers  # a _StderrHandler follows sys.stderr by itself
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging._StderrHandler)]


@contextlib.contextmanager
def _logging_to(out: io.StringIO, err: io.StringIO):
    """Logging handlers on this process's stdout / stderr write to `out` / `err` for the block; a
    handler made in the block on `out` or `err` (a library first imported there) is moved to the
    real stream after it. Entered before stdout and stderr are redirected to `out` and `err`."""
    real_out, real_err = sys.stdout, sys.stderr
    moved = [(h, h.stream) for h in _stream_handlers() if h.stream in (real_out, real_err)]
    for h, stream in moved:
        h.setStream(err if stream is real_err else out)
    try:
        yield
    finally:
        for h, stream in moved:
            h.setStream(stream)
        for h in _stream_handlers():
            if h.stream in (out, err):
                h.setStream(real_err if h.stream is err else real_out)


@contextlib.contextmanager
def _swapped(container, items=()):
    """`container` (a dict or set, os.environ too) holding only `items` for the block, and its
    own items again after it."""
    own = container.copy()
    container.clear()
    container.update(items)
    try:
        yield
    finally:
        container.clear()
        container.update(own)


@contextlib.contextmanager
def _fresh_process_state(env: dict | None):
    """The state a script may change, or that a new interpreter starts without, as a new
    interpreter has it for the block (`env`: its environment, None for this process's), and as
    it was after it (module doc)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from sprout.engine import cli as run_cli
    from sprout.model import generate

    held = set(run_cli._held_runs)
    saved = (os.getcwd(), sys.argv, list(sys.path), torch.get_num_threads(),
             {s: signal.getsignal(s) for s in SIGNALS}, random.getstate(), np.random.get_state(),
             torch.get_rng_state())
    with contextlib.ExitStack() as stack:
        stack.enter_context(_swapped(os.environ, os.environ.copy() if env is None else env))
        for fresh in (PartialState._shared_state, AcceleratorState._shared_state, GradientState._shared_state,
                      run_cli._pending_clear, generate._warned):
            stack.enter_context(_swapped(fresh))
        try:
            yield
        finally:
            cwd, sys.argv, sys.path[:], threads, handlers, py_rng, np_rng, torch_rng = saved
            os.chdir(cwd)
            torch.set_num_threads(threads)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            random.setstate(py_rng)
            np.random.set_state(np_rng)
            torch.set_rng_state(torch_rng)
            for key in set(run_cli._held_runs) - held:  # what the run held ends with it, as with its process
                run_cli.release_run(key)


def run_here(cmd: list[str], cwd=None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`cmd` ([sys.executable, script, *args]) run in this process (module doc), as
    subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env) would return it. A run
    still going after `timeout` seconds ends the test process, its stacks printed (faulthandler):
    a hung script stops the suite's worker instead of holding it for ever."""
    python, script, *args = map(str, cmd)
    assert python == sys.executable and script.endswith(".py"), cmd
    assert int((env or os.environ).get("WORLD_SIZE", "1")) == 1, "a launched worker needs a real process"
    out, err, code = io.StringIO(), io.StringIO(), 0
    with _fresh_process_state(env):
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [script, *args]
        faulthandler.dump_traceback_later(timeout, exit=True, file=sys.__stderr__)
        try:
            with (_logging_to(out, err), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err),
                  warnings.catch_warnings()):
                interpreter_warnings()
                try:
                    runpy.run_path(script, run_name="__main__")
                except SystemExit as exc:
                    if exc.code is None or isinstance(exc.code, int):
                        code = exc.code or 0
                    else:  # sys.exit("message"): printed, status 1
                        print(exc.code, file=sys.stderr)
                        code = 1
                except Exception:  # what the interpreter does with an uncaught exception
                    traceback.print_exc()
                    code = 1
        finally:
            faulthandler.cancel_dump_traceback_later()
    gc.collect()  # what the run built (a 135M model, its optimizer) goes now, not at a later collection
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())
