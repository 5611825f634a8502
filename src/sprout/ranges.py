"""The valid range of a numeric config field, declared once beside the field.

    beta2: float = in_range(0.95, "[0, 1)")            # AdamW's second-moment decay
    log_every: int = in_range(10, "[1, inf)", metadata=RESUME_FREE)
    top_p: float | None = in_range(None, "(0, 1]")     # None is not a number: not checked

An interval is written as in mathematics, "[" / "]" closed and "(" / ")" open, with `inf` and
`-inf` for no bound. `sprout.config.from_dict` refuses a number outside its field's interval
(an int, a float, or the numeric member of `X | None` and `int | Literal[...]`) before the
dataclass is built, in one line naming where the value came from, and `config_help` shows the
interval in --help after the type. `check_ranges` checks a config built in Python, which
skips `from_dict`: each stage's run function calls it before anything is written.
`is_finite_number` is the one test of a number a user gives where NaN or inf must not pass.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from sprout.errors import SproutError

RANGE_KEY = "range"  # field metadata: the field's `Interval`
SEED_RANGE = "[0, 4294967295]"  # a seed every generator takes (numpy's legacy seeding stops at 2**32 - 1)


@dataclasses.dataclass(frozen=True)
class Interval:
    """Numbers between `low` and `high`, each bound included when its `*_closed`."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> Interval:
        """ "[0, 1)" -> Interval(0, 1, True, False); ValueError for anything else."""
        text = text.strip()
        parts = text[1:-1].split(",")
        if len(text) < 5 or text[0] not in "[(" or text[-1] not in "])" or len(parts) != 2:
            raise ValueError(f"not an interval: {text!r} (expected e.g. [0, 1) or (0, inf))")
        low, high = (float(p) for p in parts)
        if math.isnan(low) or math.isnan(high) or low > high:
            raise ValueError(f"not an interval: {text!r}")
        return cls(low, high, text[0] == "[" and math.isfinite(low), text[-1] == "]" and math.isfinite(high))

    def __contains__(self, value: float) -> bool:
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self) -> str:
        def bound(x: float) -> str:
            if math.isinf(x):
                return "inf" if x > 0 else "-inf"
            return str(int(x)) if x == int(x) else f"{x:g}"
        return f"{'[' if self.low_closed else '('}{bound(self.low)}, {bound(self.high)}{']' if self.high_closed else ')'}"


def is_finite_number(value: Any) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def in_range(default: Any, interval: str, *, metadata: dict | None = None) -> Any:
    """`dataclasses.field(default=default)` whose numbers must lie in `interval` ("[0, 1)");
    `metadata`: more field metadata (e.g. `sprout.config.RESUME_FREE`)."""
    return dataclasses.field(default=default, metadata={**(metadata or {}), RANGE_KEY: Interval.parse(interval)})


def field_range(f: dataclasses.Field) -> Interval | None:
    """The interval declared for field `f`, or None."""
    return f.metadata.get(RANGE_KEY)


def out_of_range(value: Any, interval: Interval | None) -> bool:
    """True when `value` is a number (not a bool) outside `interval`."""
    return (interval is not None and isinstance(value, (int, float)) and not isinstance(value, bool)
            and value not in interval)


def check_ranges(cfg, where: str = "config", prefix: str = "") -> None:
    """Refuse a config built in Python rather than through `from_dict` (which checks as it
    builds) when one of its numbers, nested configs included, lies outside its field's range."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_ranges(value, where, f"{prefix}{f.name}.")
        elif out_of_range(value, field_range(f)):
            raise SproutError(f"{where}: {prefix}{f.name}: got {value!r}; expected a number in {field_range(f)}")
