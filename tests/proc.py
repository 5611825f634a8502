"""Running the CLI in a subprocess for tests, without leaving stragglers behind.

Commands run under `accelerate launch` start worker processes of their own; a timeout that
killed only the launcher would leave a hung worker holding its port and the output pipe.
`run_group` kills every descendant of the command on timeout before raising.
"""

import subprocess

import psutil  # a dependency of accelerate


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
