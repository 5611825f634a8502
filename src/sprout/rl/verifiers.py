"""The reward functions RL trainers weight and sum, on reasoning answers read and compared
by `sprout.answers` (`parse_answer`, `answers_match`, `is_reasoning_format`).

Rewards follow TRL's reward-function convention: `fn(completions, **columns)` returns one
float per completion, or None to abstain on it (here: a gold that is not a number). The RL
stages pass the columns `REWARD_COLUMNS`; `check_reward_function` refuses, before a run
starts, a function that cannot be called so. `combine_rewards` takes each function's values
as they are (a list of one finite number or None per completion; anything else -- NaN, inf,
a number beyond ±`REWARD_LIMIT`, a string, a bool, a value too many or too few -- is refused in
one line naming the function and the completion, never converted), sums `weight × value` over
the functions that did not abstain (an abstention counts 0, as TRL's nansum does; a sample every
function abstains on gets 0; a sum beyond ±`REWARD_LIMIT` is refused too) and keeps each
function's values for `reward_metrics` (`rewards/<name>/mean|std`). A reward function that
raises, or calls sys.exit, stops the run in one line naming it and the prompts it was scoring.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from collections.abc import Iterable, Sized
from typing import Callable, Sequence

from sprout.answers import answers_match, is_reasoning_format, parse_answer, parse_number
from sprout.errors import SproutError
from sprout.ranges import is_finite_number

REWARD_COLUMNS = ("gold", "completion_lengths")  # what the RL stages pass a reward function besides the completions
# The largest reward magnitude taken, a function's value or a weighted sum. Rewards are squared
# (their std, PPO's value loss) and kept in float32 (advantages, returns): the square of 1e12 is
# far inside float32's 3.4e38, while a reward of 1e308 makes the sums of squares inf and every
# advantage NaN.
REWARD_LIMIT = 1e12


# ---- reward functions ------------------------------------------------------------------

def correctness_reward(completions: Sequence[str], gold: Sequence[str], *, rel_tol: float = 1e-6,
                       fallback_last_number: bool = False, **_) -> list[float | None]:
    """1.0 when the parsed answer matches the gold (`answers_match`), else 0.0; None
    (abstain) when the gold itself is not a number."""
    out: list[float | None] = []
    for text, g in zip(completions, gold, strict=True):
        if parse_number(g) is None:
            out.append(None)
        else:
            answer = parse_answer(text, fallback_last_number=fallback_last_number)
            out.append(1.0 if answers_match(answer, g, rel_tol) else 0.0)
    return out


def format_reward(completions: Sequence[str], **_) -> list[float]:
    """1.0 when a completion has exactly the reasoning shape (`is_reasoning_format`), else 0.0."""
    return [1.0 if is_reasoning_format(text) else 0.0 for text in completions]


class SoftOverlongPenalty:
    """DAPO's soft overlong punishment over completion lengths L in tokens: 0 while
    L <= max_completion_length - cache_length, then linear, ((max - cache) - L) / cache,
    down to -1 at L = max_completion_length, and -1 beyond. Reads `completion_ids`
    (TRL's column) or `completion_lengths`."""

    __name__ = "overlong"

    def __init__(self, max_completion_length: int, cache_length: int):
        if not 0 < cache_length <= max_completion_length:
            raise ValueError(f"cache_length must be in (0, max_completion_length], got {cache_length}")
        self.max_completion_length = max_completion_length
        self.cache_length = cache_length

    def penalty(self, length: int) -> float:
        start = self.max_completion_length - self.cache_length
        if length <= start:
            return 0.0
        return max(-1.0, (start - length) / self.cache_length)

    def __call__(self, completions: Sequence[str], completion_ids=None, completion_lengths=None, **_) -> list[float]:
        if completion_lengths is None:
            if completion_ids is None:
                raise ValueError("overlong penalty needs completion_ids or completion_lengths")
            completion_lengths = [len(ids) for ids in completion_ids]
        return [self.penalty(int(n)) for n in completion_lengths]


@dataclass(frozen=True)
class WeightedReward:
    """One reward function, its weight in the sum and its metric name."""

    name: str
    fn: Callable[..., list]
    weight: float = 1.0


@dataclass(frozen=True)
class CombinedRewards:
    """Per-sample totals and each function's raw values (None where it abstained)."""

    totals: list[float]
    per_function: dict[str, list[float | None]]


def check_reward_function(name: str, fn, where: str) -> None:
    """SproutError (one line, naming `where` and the function) unless `fn` can be called as a
    reward function: `fn(completions, **{column: ...})` for every one of `REWARD_COLUMNS`."""
    if not callable(fn):
        raise SproutError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise SproutError(f"{where}: {name!r} is not a reward function (its signature cannot be read; a reward "
                          f"function is fn(completions, **columns))") from None
    try:
        signature.bind([], **{column: [] for column in REWARD_COLUMNS})
    except TypeError:
        raise SproutError(f"{where}: {name!r} is not a reward function: it takes {signature}, not (completions, "
                          f"**columns) with the columns {', '.join(REWARD_COLUMNS)}") from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def reward_values(r: WeightedReward, values, n: int, completion_names: Sequence[str] | None = None) -> list:
    """`values`, what reward function `r` returned for `n` completions, as a list of floats and
    Nones; SproutError naming the function (and the completion: `completion_names[i]`, else its
    index) unless it is a list of one finite number (not a bool) within ±`REWARD_LIMIT`, or None,
    per completion."""
    if isinstance(values, (str, bytes, dict)) or not (isinstance(values, Sized) and isinstance(values, Iterable)):
        raise SproutError(f"reward function {r.name!r} returned {_short(values)}; expected a list of one number "
                          f"(or None) per completion")
    values = list(values)
    if len(values) != n:
        raise SproutError(f"reward function {r.name!r} returned {len(values)} values for {n} completions; expected "
                          f"one per completion")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is not None and not is_finite_number(v):
            raise SproutError(f"reward function {r.name!r} returned {_short(v)} for {_name(completion_names, i)}; "
                              f"expected a finite number or None (abstain)")
        if v is not None and not abs(v) <= REWARD_LIMIT:
            raise SproutError(f"reward function {r.name!r} returned {_short(v)} for {_name(completion_names, i)}; "
                              f"expected a reward within ±{REWARD_LIMIT:g} (larger ones overflow the sums of squares "
                              f"of advantages and metrics)")
        out.append(None if v is None else float(v))
    return out


def _name(completion_names: Sequence[str] | None, i: int) -> str:
    return completion_names[i] if completion_names is not None else f"completion {i}"


def call_reward(r: WeightedReward, completions: Sequence[str], scoring: str | None = None, **columns):
    """What reward function `r` returns for `completions`; SproutError naming the function and
    `scoring` (what the batch is: "prompt 'add0-5' (prompts.jsonl)") when it raises or calls
    sys.exit, which would otherwise end the run with the function's own status (0 included)."""
    where = f" while scoring {scoring}" if scoring else ""
    try:
        return r.fn(completions, **columns)
    except SystemExit as exc:
        raise SproutError(f"reward function {r.name!r} called sys.exit({_short(exc.code)}){where}; a reward function "
                          f"returns one value per completion and cannot end the run") from None
    except Exception as exc:  # the user's function may raise anything
        text = " ".join(str(exc).split())
        text = text if len(text) <= 120 else text[:117] + "..."
        raise SproutError(f"reward function {r.name!r} raised {type(exc).__name__}: {text}{where}") from None


def combine_rewards(rewards: Sequence[WeightedReward], completions: Sequence[str], *,
                    completion_names: Sequence[str] | None = None, scoring: str | None = None,
                    **columns) -> CombinedRewards:
    """Call every function on the batch (with `columns`, `call_reward`); total = sum of weight ×
    value over the functions that did not abstain on a sample (0 when all did), refused beyond
    ±`REWARD_LIMIT`. `completion_names`: how an error names each completion (`reward_values`);
    `scoring`: how it names the batch (`call_reward`)."""
    per_function: dict[str, list[float | None]] = {}
    for r in rewards:
        if r.name in per_function:
            raise ValueError(f"two reward functions are named {r.name!r}")
        values = call_reward(r, completions, scoring, **columns)
        per_function[r.name] = reward_values(r, values, len(completions), completion_names)
    totals = []
    for i in range(len(completions)):
        terms = [r.weight * per_function[r.name][i] for r in rewards if per_function[r.name][i] is not None]
        try:
            total = math.fsum(terms)
        except (OverflowError, ValueError):  # terms of inf, or sums beyond the float range
            total = math.inf
        if not abs(total) <= REWARD_LIMIT:
            weights = ", ".join(f"{r.name} {r.weight:g}" for r in rewards)
            raise SproutError(f"the weighted sum of rewards for {_name(completion_names, i)} is {total:g}, beyond "
                              f"±{REWARD_LIMIT:g}; lower rewards.reward_weights ({weights})")
        totals.append(total)
    return CombinedRewards(totals, per_function)


def reward_metrics(per_function: dict[str, list[float | None]]) -> dict[str, float]:
    """`rewards/<name>/mean` and `rewards/<name>/std` over the values that are not None
    (std with Bessel's correction, as TRL's nanstd). A mean needs one value and a std two;
    a metric without enough values is left out rather than logged as NaN."""
    out: dict[str, float] = {}
    for name, values in per_function.items():
        xs = [v for v in values if v is not None]
        if xs:
            mean = math.fsum(xs) / len(xs)
            out[f"rewards/{name}/mean"] = mean
            if len(xs) > 1:
                out[f"rewards/{name}/std"] = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return out
