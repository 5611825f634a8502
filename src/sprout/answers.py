"""Reasoning answers, `<think>…</think><answer>N</answer>`, and their numbers: what data prep
writes, the RL prompt format checks and `sprout.rl.verifiers` rewards. No torch, no sprout imports.

`format_reasoning` writes the shape SFT data teaches; `parse_answer` reads the last complete
block only, a block being `<answer>X</answer>` whose X holds no answer tag: in `<answer>1</answer>
no, <answer>2</answer>` the answer is 2, in `<answer><answer>5</answer></answer>` the inner 5,
and an unclosed `<answer>5` is no answer. `fallback_last_number` adds the flexible reading
(the text's last number when it has no block); it is off in rewards, where it would pay rambling.
`parse_number` gives an exact `fractions.Fraction`, never a float, and never evaluates the text:
a leading `+`/`-` (also U+2212 and its small and full-width forms), `$`, thousands separators in
groups of three (`1,000`), decimals (`0.50`, `.5`, `5.`), fractions (`3/4`), a trailing `%`
(dropped) and surrounding whitespace; anything else (`1e3`, `seven`, `5 apples`, `1,00`, more
than `MAX_NUMBER_CHARS` characters) is not a number (`not_a_number_reason` says which).
`normalise_number` writes a gold's canonical text; `answers_match` compares integers exactly,
at any size, else allows `rel_tol` × |gold|.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# ---- the reasoning shape --------------------------------------------------------------

_TAG_RE = re.compile(r"</?(?:think|answer)>")
_REASONING_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_ANSWER_BLOCK_RE = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)


def format_reasoning(think: str, answer: str) -> str:
    """`<think>{think}</think><answer>{answer}</answer>`, both parts stripped."""
    return f"<think>{think.strip()}</think><answer>{answer.strip()}</answer>"


def _reasoning_parts(text: str) -> tuple[str, str] | None:
    """(think, answer) of a text in the reasoning shape (`is_reasoning_format`), else None.

    One pass over the tags: the shape holds exactly the four tags, in order, with only
    whitespace outside the two blocks, so the time is linear in the text's length."""
    tags = []
    for m in _TAG_RE.finditer(text):
        if len(tags) == len(_REASONING_TAGS) or m.group() != _REASONING_TAGS[len(tags)]:
            return None
        tags.append(m)
    if len(tags) != len(_REASONING_TAGS):
        return None
    open_think, close_think, open_answer, close_answer = tags
    outside = (text[:open_think.start()], text[close_think.end():open_answer.start()], text[close_answer.end():])
    if any(part.strip() for part in outside):
        return None
    think, answer = text[open_think.end():close_think.start()], text[open_answer.end():close_answer.start()]
    return (think, answer) if think.strip() and answer.strip() else None


def is_reasoning_format(text: str) -> bool:
    """True when `text` is exactly one non-empty think block then one non-empty answer
    block (whitespace around and between them allowed), with no tag inside either."""
    return _reasoning_parts(text) is not None


def parse_answer(text: str, strict: bool = False, fallback_last_number: bool = False) -> str | None:
    """The stripped text of the last complete `<answer>…</answer>` block, or None.

    With `strict`, `text` must have the full reasoning shape (`is_reasoning_format`).
    With `fallback_last_number` (the flexible reading), a text without a complete block gives
    its last number, as lm-evaluation-harness's GSM8K "flexible-extract" takes the last match
    of `(-?[$0-9.,]{2,})|(-?[0-9]+)`: a sign, a `$`, and digits joined by commas or periods
    are one token, a trailing period or comma is not (`The answer is 1,234.` gives `1,234`);
    `parse_number` reads the token, so `1,2345` and `2,3` are no number (the harness reads 12345
    and 23). Unlike the harness, `+` or a Unicode minus is a sign, and `3/4` is 3/4 (not 4).
    A block, even one holding no number, wins over any number outside it. An empty block gives ""."""
    if strict:
        parts = _reasoning_parts(text)
        return parts[1].strip() if parts is not None else None
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
    r"[-+\u2212\ufe63\uff0d]?\$?(?:[0-9]+\s*/\s*[0-9]+|(?:[0-9]+|\.[0-9]+)(?:[.,][0-9]+)*)",
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


def quote_short(text: str, limit: int = 24) -> str:
    """`text` quoted as Python writes it, cut to its first `limit` characters (with the
    length said) when it is longer, so a message about it stays short."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text):,} characters)"


def not_a_number_reason(text: str) -> str:
    """Why `parse_number` refuses `text`, as a short phrase that quotes `text` (`quote_short`):
    too long for a number, or not a number."""
    if len(text) > MAX_NUMBER_CHARS:
        return f"{quote_short(text)} is longer than a number may be ({MAX_NUMBER_CHARS:,} characters)"
    return f"{quote_short(text, 60)} is not a number"


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
