"""Running the CLI in a subprocess for tests, without leaving stragglers behind.

`accelerate launch` and torchrun start worker processes of their own; subprocess.run's
timeout kills only the launcher, so a hung collective would leave its workers running
(and holding their port) after the test. `run_group` starts the command in a new session
and, on timeout, kills the whole process group before raising.
"""

import os
import signal
import subprocess


def run_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, ...) that kills every process it started on timeout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
