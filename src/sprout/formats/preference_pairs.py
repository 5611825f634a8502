"""The preference-pair JSONL contract (TRL's conversational preference format): reader, verifier, writer.

One JSON object per line: a prompt (the conversation so far, ending with a user turn) and two
single-message assistant answers that differ, `chosen` and `rejected`; the fields are in
`check_pair`'s docstring. Every content is a non-empty string without the chat template's reserved
markers, so `prompt + chosen` and `prompt + rejected` are conversations `sprout.chat.render`
accepts. A prepared folder holds `preferences.jsonl` (train), `preferences_dev.jsonl` (dev, what
the reward and DPO stages evaluate on), `preferences_test.jsonl` (test; a prompt is in one file
only, by a hash of the prompt) and `manifest.json` (`sprout.prep.preference_data`).
`read_preferences` refuses a bad record in one line naming file and line; `verify_preferences`
returns counts and the first errors instead; `write_preferences` checks and writes atomically.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterable, Iterator

from sprout.chat import ChatError, validate
from sprout.errors import SproutError
from sprout.formats.jsonl import check_messages, check_prompt_record, read_records, verify_records, write_records

FORMAT = "sprout-preferences"
FORMAT_VERSION = 1
TRAIN_FILE = "preferences.jsonl"
DEV_FILE = "preferences_dev.jsonl"
TEST_FILE = "preferences_test.jsonl"
KEYS = ("id", "source", "prompt", "chosen", "rejected")
OPTIONAL_KEYS = ("margin", "rejected_kind")
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]*")  # a rejected_kind


def _answer(value, name: str) -> str:
    check_messages(value, name)
    if len(value) != 1 or value[0]["role"] != "assistant":
        raise SproutError(f"{name!r} must be exactly one assistant message, got roles "
                          f"{[m['role'] for m in value]}")
    if not value[0]["content"].strip():
        raise SproutError(f"{name!r} is empty")
    return value[0]["content"]


def check_pair(record) -> dict:
    """Return `record` when it is a valid preference pair; raise `SproutError` (without the
    location: callers add it) saying what is wrong otherwise. A record has no other keys than:

        id             str, non-empty, unique within the file
        source         str, non-empty: the prep source it came from
        prompt         [{"role": "system"|"user"|"assistant", "content": str}, ...]: the
                       conversation so far, earlier turns as their own messages: [system?] user,
                       assistant, user, ..., ending with a user turn
        chosen         [{"role": "assistant", "content": str}]: exactly one message
        rejected       [{"role": "assistant", "content": str}]: exactly one message; the two
                       answers differ (compared after stripping surrounding whitespace)
        margin         optional, finite float: how much better chosen is (e.g. a score difference)
        rejected_kind  optional, [a-z][a-z0-9_]*: how the rejected answer was made (e.g.
                       `near_miss`); a reward model's held-out evaluation reports its accuracy per kind"""
    prompt = check_prompt_record(record, KEYS, OPTIONAL_KEYS)
    chosen = _answer(record["chosen"], "chosen")
    rejected = _answer(record["rejected"], "rejected")
    if chosen.strip() == rejected.strip():
        raise SproutError("chosen and rejected are the same text")
    for side in ("chosen", "rejected"):
        try:
            validate(prompt + record[side])
        except ChatError as exc:
            raise SproutError(f"prompt + {side}: {exc}") from None
    if "margin" in record:
        m = record["margin"]
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
            raise SproutError(f"'margin' must be a finite number, got {m!r}")
    if "rejected_kind" in record:
        check_rejected_kind(record["rejected_kind"])
    return record


def kind_group(kind: str) -> str:
    """The name a `rejected_kind` is counted under (a prep manifest's counts, a reward model's
    held-out accuracy): `rejected_<kind>`."""
    return f"rejected_{kind}"


def check_rejected_kind(kind) -> str:
    """`kind` when it is a valid `rejected_kind`; `SproutError` (without the location) otherwise."""
    if not isinstance(kind, str) or not KIND_PATTERN.fullmatch(kind):
        raise SproutError(f"'rejected_kind' must be a lowercase identifier ([a-z][a-z0-9_]*), got {kind!r}")
    return kind


def read_preferences(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the checked records of a preference file; the first bad line (or a repeated
    id) raises `SproutError` naming the file and line."""
    return read_records(path, check_pair, "preference file")


def _tally(result: dict, record: dict) -> None:
    result["with_margin"] += "margin" in record


def verify_preferences(path: str | os.PathLike, max_errors: int = 5) -> dict:
    """Check every line of a preference file. Returns `{"path", "records", "valid",
    "sources", "with_margin", "errors"}`: `errors` holds up to `max_errors` lines
    `file:line: what is wrong` (empty when the file keeps the contract); a missing file
    is its only error."""
    return verify_records(path, check_pair, "preference file", max_errors, _tally, with_margin=0)


def write_preferences(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Check and write records, one JSON line each, atomically; returns the count."""
    return write_records(path, records, check_pair)
