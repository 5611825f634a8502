"""Running the CLI for tests: in a subprocess without leaving stragglers behind, or in the test's
own process when only what the script prints and its exit status are checked.

Commands run under `accelerate launch` start worker processes of their own; a timeout that
killed only the launcher would leave a hung worker holding its port and the output pipe.
`run_group` kills every descendant of the command on timeout before raising. `free_port` gives
each 2-process launch a port of its own, so launches on parallel test workers never meet.

`run_here` runs `python SCRIPT ARGS...` as `python` would, inside the test's process: the script
file executed as `__main__` with that argv, working directory and environment, its stdout and
stderr captured, its exit status the `SystemExit` it ends with (1 and the traceback on stderr for
any other exception, as the interpreter prints it), its warnings printed as a new interpreter
prints them (tests/test_proc.py compares the two). A new interpreter costs about 2 s of CPU
before the script's first line (importing torch), most of a refusal's time; run here, a refusal
costs what the script itself does. Two things a new interpreter does are not redone: a warning a
module gives once, when first imported, and anything read from the environment at startup or
import (PYTHONPATH, OMP_NUM_THREADS, a library's settings). Use it for one-process runs whose
outcome is their output and files: not for launches, signals, kills, resource limits, locks the
test's own process holds, or what is read at startup, which need a real process. What such a run
may change in the process is put back: environment, working directory, argv, sys.path, warning
filters, signal handlers, torch's thread count, the Python, NumPy and torch random states,
accelerate's state.
"""

import contextlib
import io
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import traceback
import warnings

import numpy as np
import psutil  # a dependency of accelerate
import torch

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


def free_port() -> int:
    """A TCP port free on this machine now, for `--main_process_port` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def interpreter_warnings() -> None:
    """Warnings as a new interpreter shows them: its default filters (pytest's replaced), each
    printed to sys.stderr. Inside `warnings.catch_warnings()`, which puts everything back."""
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)  # each goes first: the list ends as Python's own
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line))


def run_here(cmd: list[str], cwd=None, env: dict | None = None, **_ignored) -> subprocess.CompletedProcess:
    """`cmd` ([sys.executable, script, *args]) run in this process (module doc), as
    subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env) would return it."""
    python, script, *args = map(str, cmd)
    assert python == sys.executable and script.endswith(".py"), cmd
    assert int((env or os.environ).get("WORLD_SIZE", "1")) == 1, "a launched worker needs a real process"
    saved = (dict(os.environ), os.getcwd(), sys.argv, list(sys.path), torch.get_num_threads(),
             {s: signal.getsignal(s) for s in SIGNALS}, random.getstate(), np.random.get_state(),
             torch.get_rng_state())
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [script, *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            interpreter_warnings()
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:  # sys.exit("message"): printed, status 1
                    print(exc.code, file=sys.stderr)
                    code = 1
            except BaseException:  # what the interpreter does with an uncaught exception
                traceback.print_exc()
                code = 1
    finally:
        environ, cwd_, sys.argv, sys.path[:], threads, handlers, py_rng, np_rng, torch_rng = saved
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd_)
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        torch.set_rng_state(torch_rng)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())
