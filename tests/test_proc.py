"""`proc.run_here` gives what a new interpreter gives (exit status, stdout, stderr) for the ways a
script ends, and leaves the test's process as it found it."""

import logging
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from proc import run_here

ENDINGS = {
    "refusal": "import sys\nprint('partial', flush=True)\nprint('error: x.h5: bad', file=sys.stderr)\nsys.exit(2)\n",
    "exit_message": "import sys\nsys.exit('stopped: no data')\n",
    "exit_none": "import sys\nprint('done')\nsys.exit()\n",
    "falls_off_the_end": "print('done')\n",
    "warns": "import warnings\nwarnings.warn('rows stop early')\nwarnings.warn('old', DeprecationWarning)\n"
             "warnings.warn('once')\nwarnings.warn('once')\n",
    "env_cwd_argv": "import os, sys\nprint(os.environ['SPROUT_PROBE'], os.path.basename(os.getcwd()), sys.argv[1:])\n",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_script_ends_here_as_in_a_new_interpreter(ending, tmp_path):
    script = tmp_path / f"{ending}.py"
    script.write_text(ENDINGS[ending])
    cmd = [sys.executable, str(script), "a b", "--flag"]
    env = {**os.environ, "SPROUT_PROBE": "probe"}
    real = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    here = run_here(cmd, cwd=tmp_path, env=env)
    assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr)


def test_an_uncaught_exception_is_status_1_with_its_traceback(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("def f():\n    raise ValueError('boom')\nf()\n")
    real = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    here = run_here([sys.executable, str(script)])
    assert here.returncode == real.returncode == 1
    assert here.stderr.startswith("Traceback") and here.stderr.splitlines()[-1] == real.stderr.splitlines()[-1]


def test_what_a_script_changes_in_the_process_is_put_back(tmp_path):
    script = tmp_path / "changes.py"
    script.write_text("import os, random, signal, sys, torch\nos.environ['SPROUT_PROBE'] = 'set'\nos.chdir('/')\n"
                      "sys.path.insert(0, '/nowhere')\ntorch.set_num_threads(3)\ntorch.manual_seed(1)\n"
                      "random.seed(1)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nsys.exit(0)\n")
    before = (dict(os.environ), os.getcwd(), list(sys.path), torch.get_num_threads(), signal.getsignal(signal.SIGTERM))
    torch_rng, py_rng = torch.get_rng_state(), random.getstate()
    assert run_here([sys.executable, str(script)]).returncode == 0
    assert (dict(os.environ), os.getcwd(), list(sys.path), torch.get_num_threads(),
            signal.getsignal(signal.SIGTERM)) == before
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == py_rng


def test_a_run_starts_as_a_new_process_and_leaves_no_accelerator_log_stream_or_held_run(tmp_path):
    """The run finds no accelerate state and leaves the test's as it was; a logging handler made
    in the run writes there, then to the real stderr; a run folder it held is released."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from sprout.engine import cli as run_cli

    Accelerator(cpu=True)
    state = dict(AcceleratorState._shared_state)
    script = tmp_path / "holds.py"
    script.write_text(f"""import logging, sys
from accelerate.state import AcceleratorState
from sprout.engine.cli import hold_run
print(len(AcceleratorState._shared_state))
hold_run({str(tmp_path / "run")!r})
log = logging.getLogger("a_library")
log.addHandler(logging.StreamHandler())
log.warning("in the run")
""")
    done = run_here([sys.executable, str(script)])
    assert (done.returncode, done.stdout, done.stderr) == (0, "0\n", "in the run\n")
    assert AcceleratorState._shared_state == state and Accelerator(cpu=True).state.initialized
    handler = logging.getLogger("a_library").handlers.pop()
    assert handler.stream is sys.stderr
    assert (tmp_path / "run").resolve() not in run_cli._held_runs
    assert run_cli.hold_run(tmp_path / "run")  # free again: this process takes it
    run_cli.release_run(tmp_path / "run")
