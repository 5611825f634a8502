"""Text cleaning: normalisations and filters applied to every pretraining document.

Normalisations, each switchable (`CleanConfig`) and counted per document they changed:
    quotes     ‘ ’ “ ” -> ' "          dashes    – -> -, — -> " - "
    ellipsis   … -> ...                nbsp      U+00A0 -> space
    cr         drop \\r (Windows line ends)
    whitespace strip the text, collapse runs of spaces/tabs in each line, trim each line,
               at most one blank line in a row
Filters, each counted as a drop reason:
    too_short  fewer than `min_chars` characters after cleaning
    non_ascii  more than `max_non_ascii` of the characters beyond printable ASCII (ord > 126):
               other scripts, emoji, mojibake (0.2% lets one such character through per 500)
The cleaned text is what `sprout.prep.keys.text_key` keys for exact dedup and the split.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from sprout.ranges import in_range

RULES: dict[str, dict[str, str]] = {
    "quotes": {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'},
    "dashes": {"\u2013": "-", "\u2014": " - "},
    "ellipsis": {"\u2026": "..."},
    "nbsp": {"\u00a0": " "},
    "cr": {"\r": ""},
}
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass
class CleanConfig:
    quotes: bool = True                  # curly quotes -> straight
    dashes: bool = True                  # en/em dashes -> - and ' - '
    ellipsis: bool = True                # the ellipsis character -> ...
    nbsp: bool = True                    # non-breaking spaces -> spaces
    cr: bool = True                      # drop carriage returns
    whitespace: bool = True              # trim lines, collapse runs of blank lines
    min_chars: int = in_range(80, "[0, inf)")  # 0 disables
    max_non_ascii: float | None = in_range(0.002, "[0, 1]")  # None disables
    dedup: bool = True                   # drop exact duplicate documents


class Cleaner:
    """Applies one CleanConfig; `counts` records changes ("fixed_<rule>") and drops (reason)."""

    def __init__(self, cfg: CleanConfig) -> None:
        self.cfg = cfg
        self.rules = {name: chars for name, chars in RULES.items() if getattr(cfg, name)}
        table = {}
        for chars in self.rules.values():
            table.update(chars)
        self.table = str.maketrans(table)
        self.counts: Counter = Counter()

    def __call__(self, text: str) -> str | None:
        """The cleaned text, or None when a filter drops it."""
        cfg, counts = self.cfg, self.counts
        if self.rules:
            for name, chars in self.rules.items():
                if any(c in text for c in chars):
                    counts[f"fixed_{name}"] += 1
            text = text.translate(self.table)
        if cfg.whitespace:
            fixed = normalise_whitespace(text)
            if fixed != text:
                counts["fixed_whitespace"] += 1
            text = fixed
        if cfg.min_chars and len(text) < cfg.min_chars:
            counts["too_short"] += 1
            return None
        if cfg.max_non_ascii is not None and non_ascii_count(text) > cfg.max_non_ascii * len(text):
            counts["non_ascii"] += 1
            return None
        return text


def normalise_whitespace(text: str) -> str:
    lines = [" ".join(line.split()) for line in text.strip().split("\n")]
    return _BLANK_RUNS.sub("\n\n", "\n".join(lines).strip())


def non_ascii_count(text: str) -> int:
    """Characters with code point > 126 (vectorised; no loop over characters)."""
    if text.isascii():
        return text.count("\x7f")
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return int(np.count_nonzero(codes > 126))

