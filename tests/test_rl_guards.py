"""What an RL run refuses about its rewards and its steps: a reward function's values are taken
as they are (a list of one finite number or None per completion) or refused in one line naming
the function and the completion; an import spec that is not a reward function is refused at
start; a run whose every completion is out of the loss warns at the first such step and stops
after rollout.max_all_masked_steps of them; a first batch of all-zero rewards is warned about.

The functions below are reward functions the scripts are given as "test_rl_guards:<name>"."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grpo_fixtures import config_dict, data  # noqa: F401 (data: a fixture)
from preference_train_fixtures import base  # noqa: F401 (base: a fixture)

from sprout.errors import SproutError
from sprout.rl.verifiers import WeightedReward, check_reward_function, combine_rewards, format_reward

ROOT = Path(__file__).resolve().parents[1]


# ---- reward functions the scripts name as "test_rl_guards:<name>" ----
def one_short(completions, **_):
    return [0.5] * (len(completions) - 1)


def nan_on_the_second(completions, **_):
    return [math.nan if i == 1 else 1.0 for i in range(len(completions))]


def zero(completions, **_):
    return [0.0] * len(completions)


# ---- the values a reward function returns -------------------------------------------------------
@pytest.mark.parametrize("values, message", [
    ([1.0, math.nan], "reward function 'f' returned nan for completion 1 (of prompt 'p0'); expected a finite number "
                      "or None (abstain)"),
    ([math.inf, 1.0], "reward function 'f' returned inf for completion 0 (of prompt 'p0'); expected a finite number "
                      "or None (abstain)"),
    (["1.0", 1.0], "reward function 'f' returned '1.0' for completion 0 (of prompt 'p0'); expected a finite number "
                   "or None (abstain)"),
    ([1.0, True], "reward function 'f' returned True for completion 1 (of prompt 'p0'); expected a finite number "
                  "or None (abstain)"),
    ([1.0], "reward function 'f' returned 1 values for 2 completions; expected one per completion"),
    (1.0, "reward function 'f' returned 1.0; expected a list of one number (or None) per completion"),
    ("10", "reward function 'f' returned '10'; expected a list of one number (or None) per completion"),
])
def test_a_reward_that_is_not_one_finite_number_per_completion_is_refused(values, message):
    names = ["completion 0 (of prompt 'p0')", "completion 1 (of prompt 'p0')"]
    with pytest.raises(SproutError) as exc:
        combine_rewards([WeightedReward("f", lambda c, **_: values)], ["a", "b"], completion_names=names, gold=["1"] * 2)
    assert str(exc.value) == message


def test_numbers_of_any_kind_and_abstentions_are_taken_as_they_are():
    import numpy as np

    out = combine_rewards([WeightedReward("f", lambda c, **_: np.array([0.5, 2.0])),
                           WeightedReward("g", lambda c, **_: (1, None))], ["a", "b"])
    assert out.per_function == {"f": [0.5, 2.0], "g": [1.0, None]} and out.totals == [1.5, 2.0]


def test_only_a_function_callable_as_a_reward_function_is_accepted():
    for fn in (format_reward, one_short, lambda completions, gold, completion_lengths: []):
        check_reward_function("f", fn, "rewards.reward_funcs")
    with pytest.raises(SproutError, match=r"^rewards.reward_funcs: 'os:system' is not a reward function: it takes "
                                          r"\(command\), not \(completions, \*\*columns\)"):
        check_reward_function("os:system", os.system, "rewards.reward_funcs")
    with pytest.raises(SproutError, match=r"^rewards.reward_funcs: 'os:sep' is a str, not a function$"):
        check_reward_function("os:sep", os.sep, "rewards.reward_funcs")


# ---- through the script -------------------------------------------------------------------------
def train_grpo(data, base, out: Path, *args: str, **values) -> subprocess.CompletedProcess:
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(config_dict(data, base, out, **values)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_grpo.py"), "--config", str(config), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)


def test_an_import_spec_that_is_no_reward_function_is_refused_before_anything_is_written(data, base, tmp_path):
    out = tmp_path / "run"
    proc = train_grpo(data, base, out, "--rewards.reward_funcs", "[os:system]")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: rewards.reward_funcs: 'os:system' is not a reward function: it takes "
                                  "(command)") and proc.stderr.count("\n") == 1, proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("reward, message", [
    ("one_short", "error: reward function 'one_short' returned 3 values for 4 completions; expected one per "
                  "completion\n"),
    ("nan_on_the_second", "error: reward function 'nan_on_the_second' returned nan for completion 1 of prompt "),
])
def test_a_reward_function_returning_bad_values_stops_the_run_in_one_line(data, base, tmp_path, reward, message):
    out = tmp_path / "run"
    proc = train_grpo(data, base, out, reward_funcs=[f"test_rl_guards:{reward}"], global_prompts=1)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert f"({data})" in proc.stderr or reward == "one_short"
    assert not (out / "checkpoints").exists()


def test_a_run_with_every_completion_masked_warns_then_stops(data, base, tmp_path):
    """max_completion_length 1: the untrained model never stops in one token, so every completion is
    truncated, and masked: a warning at step 1, the stop at step 2 (max_all_masked_steps 2)."""
    out = tmp_path / "run"
    proc = train_grpo(data, base, out, "--rollout.max_all_masked_steps", "2", reward_funcs=["test_rl_guards:zero"],
                      max_completion_length=1, mask_truncated_completions=True, max_steps=4)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert warnings[0].startswith("warning: grpo: every reward of the first generation batch is 0 (8 completions; "
                                  "reward functions zero)")
    assert warnings[1].startswith("warning: grpo: step 1: every completion of the batch is out of the loss "
                                  "(truncated at rollout.max_completion_length 1 and masked): loss 0, no gradient")
    assert len(warnings) == 2
    assert lines[-1].startswith("error: grpo: step 2: 2 step(s) in a row where every completion of the batch is out "
                                "of the loss")
