"""Running the CLI in a subprocess for tests, without leaving stragglers behind.

Commands run under `accelerate launch` start worker processes of their own; a timeout that
killed only the launcher would leave a hung worker holding its port and the output pipe.
`run_group` kills every descendant of the command on timeout before raising. `free_port` gives
each 2-process launch a port of its own, so launches on parallel test workers never meet.
"""

import socket
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


def free_port() -> int:
    """A TCP port free on this machine now, for `--main_process_port` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
