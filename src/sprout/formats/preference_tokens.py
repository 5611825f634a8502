"""Preference pairs as token sequences: the one rendering the pair loader and the mask checker share.

Each side of a pair (`sprout.formats.preference_pairs`) is one conversation (`sprout.chat.render`):
    prompt_ids = render(prompt, add_generation_prompt=True)   ends with the assistant header
    ids        = render(prompt + [answer])                    = prompt_ids + answer + [eot]
    mask[i]    = 1 for len(prompt_ids) <= i < len(ids), else 0
A side ends with that end-of-turn token (text a chat format writes after it, such as chatml's
newline, is left out) and its mask covers exactly the final answer and that eot; `mask[i]` marks
token i itself (a batch shifts it onto targets). Both sides start with the same `prompt_ids`,
else an error names the file and line. A pair fits when both sides have `len(ids) <= seq_len`;
`truncation` decides what happens to one that does not: `drop` (default) drops and counts it
(`dropped_too_long`); `keep_end` removes whole exchanges (a user turn and the assistant turn
answering it) from the front of the prompt, oldest first, always keeping the system message and
the last user turn and never cutting a response or its eot; a pair that still does not fit is
dropped (`dropped_too_long`), a kept one that lost turns counts in `truncated` (its messages in
`prompt_turns_dropped`). Record n is line n of the file (`read_preferences`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from sprout.chat import ChatError, render
from sprout.errors import SproutError
from sprout.formats.preference_pairs import read_preferences

TRUNCATIONS = ("drop", "keep_end")
SIDES = ("chosen", "rejected")
CHUNK = 1024  # records that share one memo of encoded texts


@dataclass(frozen=True)
class PairTokens:
    """One pair rendered: each side's ids and response mask (uint8), the shared prompt length."""

    line: int  # 1-based line of the record in its file
    id: str
    chosen: np.ndarray
    chosen_mask: np.ndarray
    rejected: np.ndarray
    rejected_mask: np.ndarray
    prompt_len: int  # tokens before the response, the same on both sides
    margin: float | None
    turns_dropped: int = 0  # prompt messages removed by `keep_end`

    @property
    def longest(self) -> int:
        return max(len(self.chosen), len(self.rejected))


@dataclass
class PairSet:
    """The pairs of a file that fit the context, with what happened to the others.

    `counts`: pairs_read, pairs (kept), dropped_too_long, truncated, prompt_turns_dropped.
    `dropped`: (line, id, longest side in tokens) per dropped pair; `truncated`: (line, id,
    messages removed) per kept pair whose prompt lost turns."""

    pairs: list
    counts: dict
    dropped: list = field(default_factory=list)
    truncated: list = field(default_factory=list)


class _EncodeOnce:
    """`tok` whose `encode` remembers what it returned for each text (cleared per chunk of
    records); `render` takes it as a tokenizer."""

    def __init__(self, tok):
        self._tok = tok
        self._ids: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = self._tok.encode(text)
        return list(ids)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _first_difference(a: list, b: list) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def render_pair(record: dict, tok, where: str = "", line: int = 0, turns_dropped: int = 0) -> PairTokens:
    """Render both sides of one checked record (see the module docstring); `SproutError`
    naming `where` when the template refuses it or the two prompts render differently."""
    prompt = record["prompt"]
    try:
        prompt_ids, _ = render(prompt, tok, add_generation_prompt=True)
    except ChatError as exc:
        raise SproutError(f"{where}: prompt: {exc}") from None
    p = len(prompt_ids)
    sides = {}
    for side in SIDES:
        try:
            ids, mask = render(prompt + record[side], tok)
        except ChatError as exc:
            raise SproutError(f"{where}: prompt + {side}: {exc}") from None
        if ids[:p] != prompt_ids:
            raise SproutError(f"{where}: the prompt tokens of the {side} side differ from the prompt's "
                              f"(position {_first_difference(ids[:p], prompt_ids)})")
        end = len(mask) - mask[::-1].index(1)  # just after the end-of-turn token closing the response
        mask = np.zeros(end, dtype=np.uint8)
        mask[p:] = 1
        sides[side] = (np.asarray(ids[:end], dtype=np.int64), mask)
    margin = record.get("margin")
    return PairTokens(line, record["id"], sides["chosen"][0], sides["chosen"][1], sides["rejected"][0],
                      sides["rejected"][1], p, None if margin is None else float(margin), turns_dropped)


def fit_pair(record: dict, tok, seq_len: int, truncation: str = "drop", where: str = "",
             line: int = 0) -> tuple[PairTokens | None, int]:
    """The pair rendered to fit `seq_len` under `truncation`, or None when it cannot; also
    the longest side of the whole (untruncated) pair, for reporting."""
    if truncation not in TRUNCATIONS:
        raise SproutError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
    pair = render_pair(record, tok, where, line)
    longest = pair.longest
    if longest <= seq_len:
        return pair, longest
    if truncation == "drop":
        return None, longest
    prompt = record["prompt"]
    first = 1 if prompt[0]["role"] == "system" else 0
    for dropped in range(2, len(prompt) - first, 2):  # remove (user, assistant) exchanges, oldest first
        shorter = {**record, "prompt": prompt[:first] + prompt[first + dropped:]}
        pair = render_pair(shorter, tok, where, line, turns_dropped=dropped)
        if pair.longest <= seq_len:
            return pair, longest
    return None, longest


def records_to_render(path: str | os.PathLike, tok) -> Iterator[tuple[int, dict, _EncodeOnce]]:
    """(line, record, tokenizer to render it with) for every record of a preference file;
    the tokenizer encodes each distinct text of a chunk of `CHUNK` records once."""
    for line, record in enumerate(read_preferences(path), 1):
        if (line - 1) % CHUNK == 0:
            encoded = _EncodeOnce(tok)
        yield line, record, encoded


def tokenize_preferences(path: str | os.PathLike, tok, seq_len: int, truncation: str = "drop") -> PairSet:
    """Read and render every pair of a preference file, keeping those that fit `seq_len`."""
    if seq_len < 2:
        raise SproutError(f"seq_len must be at least 2, got {seq_len}")
    if truncation not in TRUNCATIONS:
        raise SproutError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
    result = PairSet([], {"pairs_read": 0, "pairs": 0, "dropped_too_long": 0, "truncated": 0,
                          "prompt_turns_dropped": 0})
    c = result.counts
    for line, record, encoded in records_to_render(path, tok):
        c["pairs_read"] += 1
        pair, longest = fit_pair(record, encoded, seq_len, truncation, f"{path}:{line}", line)
        if pair is None:
            c["dropped_too_long"] += 1
            result.dropped.append((line, record["id"], longest))
            continue
        if pair.turns_dropped:
            c["truncated"] += 1
            c["prompt_turns_dropped"] += pair.turns_dropped
            result.truncated.append((line, record["id"], pair.turns_dropped))
        result.pairs.append(pair)
    c["pairs"] = len(result.pairs)
    return result
