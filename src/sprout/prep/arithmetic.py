"""Arithmetic problems by level, with gold answers, worked answers and wrong answers.

One generator feeds SFT (a worked answer per problem), preference pairs (a worked answer
against a wrong one) and RL prompts (question and gold). Levels (`LEVELS`): 1 one-digit
addition, 2 two-digit addition/subtraction (never below 0), 3 one-digit multiplication,
4 two steps (left to right, or * before +/-). A `Problem` holds its question, its gold (an
integer as `sprout.answers.normalise_number` writes it) and a worked answer
`<think>12 + 5 = 17. 17 - 9 = 8.</think><answer>8</answer>` (`sprout.answers.format_reasoning`).

Split (`question_split`): a problem is a test problem when `sprout.prep.keys.is_val(
text_key(question), TEST_FRACTION)`; else a dev problem when `is_val(text_key("dev:" + question),
DEV_FRACTION)`; else a train problem. Whatever the seed, level mix or count, so a dev or test
problem never reaches data built from the train split. `generate` is deterministic for a seed and yields distinct problems,
round-robin over the levels, until `count` or until a level's problems in the split run out.
`wrong_answer` gives a `near_miss` (last result off by 1..3, never the gold) or a `broken_format`
(the right number without the required tags, so `sprout.answers.parse_answer` finds no answer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from sprout.answers import format_reasoning
from sprout.errors import SproutError
from sprout.prep.keys import is_val, text_key

LEVELS = {1: "one-digit addition", 2: "two-digit addition and subtraction",
          3: "one-digit multiplication", 4: "two-step expressions"}
SPLITS = ("train", "dev", "test", "all")
TEST_FRACTION = 0.1  # share of all problems held out as test problems (by question hash)
DEV_FRACTION = 0.1  # share of the problems that are not test problems held out as dev problems
WRONG_KINDS = ("near_miss", "broken_format")
_MAX_MISSES = 200  # draws in a row without a new problem before a level counts as exhausted


@dataclass(frozen=True)
class Problem:
    question: str
    gold: str  # integer as a string
    level: int
    steps: tuple  # ((left, op, right, result), ...): the worked computation, in order

    @property
    def worked(self) -> str:
        """The correct answer in the reasoning format."""
        return format_reasoning(_steps_text(self.steps), self.gold)

    @property
    def split(self) -> str:
        return question_split(self.question)


def question_split(question: str) -> str:
    """"test", "dev" or "train": the split of a generator question (module docstring)."""
    if is_val(text_key(question), TEST_FRACTION):
        return "test"
    return "dev" if is_val(text_key("dev:" + question), DEV_FRACTION) else "train"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _steps_text(steps, last_result: int | None = None) -> str:
    parts = []
    for i, (a, op, b, r) in enumerate(steps):
        if last_result is not None and i == len(steps) - 1:
            r = last_result
        parts.append(f"{a} {op} {b} = {r}.")
    return " ".join(parts)


def _problem(level: int, expr: str, steps: list) -> Problem:
    return Problem(f"What is {expr}?", str(steps[-1][3]), level, tuple(steps))


def draw_problem(level: int, rng: random.Random) -> Problem:
    """One random problem of `level` (not checked against the split)."""
    if level == 1:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return _problem(1, f"{a} + {b}", [(a, "+", b, a + b)])
    if level == 2:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        return _problem(2, f"{a} {op} {b}", [(a, op, b, _apply(a, op, b))])
    if level == 3:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return _problem(3, f"{a} * {b}", [(a, "*", b, a * b)])
    if level == 4:
        form = rng.randrange(3)
        if form == 0:  # a + b - c, left to right; c at most a + b
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            c = rng.randint(1, a + b)
            return _problem(4, f"{a} + {b} - {c}", [(a, "+", b, a + b), (a + b, "-", c, a + b - c)])
        if form == 1:  # a * b + c
            a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 50)
            return _problem(4, f"{a} * {b} + {c}", [(a, "*", b, a * b), (a * b, "+", c, a * b + c)])
        a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 9)  # a - b * c
        if a < b * c:
            a += b * c
        return _problem(4, f"{a} - {b} * {c}", [(b, "*", c, b * c), (a, "-", b * c, a - b * c)])
    raise SproutError(f"arithmetic: unknown level {level} (expected one of {', '.join(map(str, LEVELS))})")


def check_levels(levels, where: str = "arithmetic") -> tuple:
    """`levels` as a tuple of known levels; a one-line error naming `where` otherwise."""
    if isinstance(levels, int):
        levels = [levels]
    if not levels or any(not isinstance(x, int) or x not in LEVELS for x in levels):
        raise SproutError(f"{where}: levels must be a non-empty list of {sorted(LEVELS)}, got {levels!r}")
    return tuple(levels)


def generate(count: int, levels=(1, 2, 3, 4), seed: int = 0, split: str = "train") -> Iterator[Problem]:
    """Up to `count` distinct problems of `split`, levels taken in turn; deterministic for
    `seed`. Stops early when every level's problems in the split are used up."""
    levels = check_levels(levels)
    if split not in SPLITS:
        raise SproutError(f"arithmetic: split must be one of {', '.join(SPLITS)}, got {split!r}")
    if count < 0:
        raise SproutError(f"arithmetic: count must be >= 0, got {count}")
    rng = random.Random(seed)
    seen: set[str] = set()
    live = list(levels)
    made = 0
    while made < count and live:
        for level in list(live):
            if made >= count:
                break
            for _ in range(_MAX_MISSES):
                p = draw_problem(level, rng)
                if p.question not in seen and (split == "all" or p.split == split):
                    break
            else:
                live.remove(level)
                continue
            seen.add(p.question)
            made += 1
            yield p


def near_miss(problem: Problem, rng: random.Random) -> str:
    """A worked answer whose last result and answer are off by 1..3 (never the gold)."""
    wrong = int(problem.gold) + rng.choice((-3, -2, -1, 1, 2, 3))
    return format_reasoning(_steps_text(problem.steps, wrong), str(wrong))


def broken_format(problem: Problem, rng: random.Random) -> str:
    """The right number without the required tags: a strict parse finds no answer."""
    think = _steps_text(problem.steps)
    form = rng.randrange(3)
    if form == 0:
        return f"{think} The answer is {problem.gold}."
    if form == 1:
        return f"<think>{think}</think> The answer is {problem.gold}."
    return f"<think>{think}</think><answer>{problem.gold}"


def wrong_answer(problem: Problem, rng: random.Random, broken_format_fraction: float = 0.25) -> tuple[str, str]:
    """`(text, kind)`: a broken format with probability `broken_format_fraction`, else a
    near miss."""
    if rng.random() < broken_format_fraction:
        return broken_format(problem, rng), "broken_format"
    return near_miss(problem, rng), "near_miss"
