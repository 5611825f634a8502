"""Verifiers for reasoning answers: parse `<think>…</think><answer>N</answer>`, compare
numbers, and the reward functions RL trainers weight and sum.

Answers. `format_reasoning` writes the shape SFT data teaches; `parse_answer` reads the
answer back from `<answer>…</answer>` only. When a completion holds several blocks, the
last complete block counts: a block is `<answer>X</answer>` whose X holds no answer tag,
so in `<answer>1</answer> no, <answer>2</answer>` the answer is 2, in the nested
`<answer><answer>5</answer></answer>` it is the inner 5, and an unclosed `<answer>5` is no
answer. (open-r1 and TRL take the last match when they extract a tagged block; their
accuracy rewards run math_verify over the whole completion, which a tag-based verifier
has no use for.) A fallback to the last number anywhere in the text exists behind a flag,
off by default: it rewards rambling that happens to end on the right number.

Numbers. `parse_number` turns answer text into an exact `fractions.Fraction`, never a
float, and never evaluates the text as code. It accepts a leading `+` or `-` (also the
unicode minus U+2212 and its small and full-width forms), a `$`, thousands separators in
groups of three (`1,000`), decimals (`0.50`, `.5`, `5.`), fractions (`3/4`), a trailing
`%` (dropped: the number of percent is the answer) and surrounding whitespace. Anything
else (`1e3`, `seven`, `5 apples`, `1,00`, more than `MAX_NUMBER_CHARS` characters) is not
a number. `answers_match` compares integers exactly, at any size; when the gold is not an
integer (a decimal or a fraction) the answer may differ by `rel_tol` × |gold|.

Rewards follow TRL's reward-function convention: `fn(completions, **columns)` returns one
float per completion, or None to abstain on it (here: a gold that is not a number).
`combine_rewards` sums `weight × value` over the functions that did not abstain (an
abstention counts 0, as TRL's nansum does; a sample every function abstains on gets 0)
and keeps each function's values for `reward_metrics` (`rewards/<name>/mean|std`).

No torch here: data prep imports `format_reasoning`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Callable, Sequence

# ---- the reasoning shape --------------------------------------------------------------

_TAG = r"</?(?:think|answer)>"
_ANSWER_BLOCK_RE = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)
_REASONING_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)


def format_reasoning(think: str, answer: str) -> str:
    """`<think>{think}</think><answer>{answer}</answer>`, both parts stripped."""
    return f"<think>{think.strip()}</think><answer>{answer.strip()}</answer>"


def is_reasoning_format(text: str) -> bool:
    """True when `text` is exactly one non-empty think block then one non-empty answer
    block (whitespace around and between them allowed), with no tag inside either."""
    m = _REASONING_RE.fullmatch(text)
    if m is None:
        return False
    think, answer = m.group(1), m.group(2)
    return bool(think.strip() and answer.strip()) and not re.search(_TAG, think + answer)


def parse_answer(text: str, strict: bool = False, fallback_last_number: bool = False) -> str | None:
    """The stripped text of the last complete `<answer>…</answer>` block, or None.

    With `strict`, `text` must have the full reasoning shape (`is_reasoning_format`).
    With `fallback_last_number`, a text without a complete block gives its last number
    (see the module doc for why this is off by default). An empty block gives ""."""
    if strict:
        return _REASONING_RE.fullmatch(text).group(2).strip() if is_reasoning_format(text) else None
    blocks = _ANSWER_BLOCK_RE.findall(text)
    if blocks:
        return blocks[-1].strip()
    if fallback_last_number:
        numbers = _NUMBER_IN_TEXT_RE.findall(text)
        return numbers[-1].strip() if numbers else None
    return None


# ---- numbers ---------------------------------------------------------------------------

MAX_NUMBER_CHARS = 1000  # longer answers are refused (and Python's int() refuses > 4300 digits)
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_DECIMAL_RE = re.compile(r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)
_PREFIX_RE = re.compile(r"([+-]?)\s*\$?\s*([+-]?)\s*")
_FRACTION_RE = re.compile(r"([0-9]+)\s*/\s*([0-9]+)", re.ASCII)
_NUMBER_IN_TEXT_RE = re.compile(
    r"[-+\u2212\ufe63\uff0d]?\$?(?:[0-9]+\s*/\s*[0-9]+|(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)",
    re.ASCII)


def parse_number(text: str | None) -> Fraction | None:
    """The exact value of a numeric answer (rules in the module doc), or None."""
    if text is None or len(text) > MAX_NUMBER_CHARS:
        return None
    s = text.translate(_MINUS_SIGNS).strip()
    prefix = _PREFIX_RE.match(s)  # a sign and a $, in either order ("-$5", "$-5")
    if prefix.group(1) and prefix.group(2):
        return None
    sign = -1 if "-" in (prefix.group(1), prefix.group(2)) else 1
    s = s[prefix.end():]
    s = s[:-1].rstrip() if s.endswith("%") else s
    try:
        if _DECIMAL_RE.fullmatch(s):
            value = Fraction(Decimal(s.replace(",", "")))
        elif (m := _FRACTION_RE.fullmatch(s)) and int(m.group(2)) != 0:
            value = Fraction(int(m.group(1)), int(m.group(2)))
        else:
            return None
    except (InvalidOperation, ValueError):
        return None
    return sign * value


def normalise_number(text: str | None) -> str | None:
    """Canonical text of a numeric answer, or None when `text` is not a number.

    Integers print as integers (`1,080` -> `1080`, `$5.00` -> `5`), other values with a
    finite decimal expansion as decimals without trailing zeros (`-0.50` -> `-0.5`,
    `3/4` -> `0.75`), the rest as a reduced fraction (`2/6` -> `1/3`)."""
    value = parse_number(text)
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    twos = fives = 0
    d = value.denominator
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    if d != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)  # value × 10**places is an integer
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0")


def answers_match(answer: str | None, gold: str | None, rel_tol: float = 1e-6) -> bool:
    """Whether the numeric `answer` equals `gold`: exactly when the gold is an integer,
    within `rel_tol` × |gold| otherwise. False when either is not a number."""
    a, g = parse_number(answer), parse_number(gold)
    if a is None or g is None:
        return False
    if g.denominator == 1:
        return a == g
    return abs(a - g) <= Fraction(rel_tol) * abs(g)


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


def combine_rewards(rewards: Sequence[WeightedReward], completions: Sequence[str], **columns) -> CombinedRewards:
    """Call every function on the batch; total = sum of weight × value over the functions
    that did not abstain on a sample (0 when all did)."""
    per_function: dict[str, list[float | None]] = {}
    for r in rewards:
        if r.name in per_function:
            raise ValueError(f"two reward functions are named {r.name!r}")
        values = list(r.fn(completions, **columns))
        if len(values) != len(completions):
            raise ValueError(f"reward {r.name!r} returned {len(values)} values for {len(completions)} completions")
        per_function[r.name] = [None if v is None else float(v) for v in values]
    totals = []
    for i in range(len(completions)):
        totals.append(math.fsum(r.weight * per_function[r.name][i] for r in rewards
                                if per_function[r.name][i] is not None))
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
