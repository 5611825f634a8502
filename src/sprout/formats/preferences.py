"""The preference-pair JSONL contract: single source of truth, reader, verifier, writer.

TRL's conversational preference format, one JSON object per line, UTF-8:

    {"id": str,                       unique within the file, non-empty
     "source": str,                   the prep source it came from, non-empty
     "prompt": [{"role": "system"|"user"|"assistant", "content": str}, ...],
                                      the conversation so far, earlier turns kept as their
                                      own messages; [system?] user, assistant, user, ...,
                                      ending with a user turn
     "chosen":   [{"role": "assistant", "content": str}],   exactly one message
     "rejected": [{"role": "assistant", "content": str}],   exactly one message
     "margin": float}                 optional: how much better chosen is (e.g. a score
                                      difference); finite

Every content is a non-empty string without the chat template's reserved markers, so
`prompt + chosen` and `prompt + rejected` are conversations `sprout.chat.render` accepts.
The two answers differ (compared after stripping surrounding whitespace). No other keys.

A prepared folder holds `preferences.jsonl` (train), `preferences_test.jsonl` (test;
a prompt is in one file or the other, by a hash of the prompt) and `manifest.json`
(`sprout.prep.preferences` writes it: counts, the split rule, the command).

`read_preferences` yields checked records and refuses anything else with one line naming
the file and line; `verify_preferences` checks a whole file and returns counts and the
first errors instead of raising; `write_preferences` checks each record and writes the
file atomically.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

from sprout.atomic import atomic_write
from sprout.chat import ChatError, validate
from sprout.errors import SproutError

FORMAT = "sprout-preferences"
FORMAT_VERSION = 1
TRAIN_FILE = "preferences.jsonl"
TEST_FILE = "preferences_test.jsonl"
KEYS = ("id", "source", "prompt", "chosen", "rejected")
OPTIONAL_KEYS = ("margin",)


def _messages(value, name: str) -> list:
    """Check the shape of a message list (roles and string contents)."""
    if not isinstance(value, list) or not value:
        raise SproutError(f"{name!r} must be a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise SproutError(f"{name}[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise SproutError(f"{name}[{i}]: unknown role {m['role']!r}")
        if not isinstance(m["content"], str):
            raise SproutError(f"{name}[{i}]: content must be a string, got {type(m['content']).__name__}")
    return value


def _answer(value, name: str) -> str:
    _messages(value, name)
    if len(value) != 1 or value[0]["role"] != "assistant":
        raise SproutError(f"{name!r} must be exactly one assistant message, got roles "
                          f"{[m['role'] for m in value]}")
    if not value[0]["content"].strip():
        raise SproutError(f"{name!r} is empty")
    return value[0]["content"]


def check_pair(record) -> dict:
    """Return `record` when it is a valid preference pair; raise `SproutError` (without the
    location: callers add it) saying what is wrong otherwise."""
    if not isinstance(record, dict):
        raise SproutError(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in KEYS if k not in record]
    if missing:
        raise SproutError(f"missing key(s) {', '.join(missing)}")
    unknown = sorted(set(record) - set(KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise SproutError(f"unknown key(s) {', '.join(unknown)}")
    for k in ("id", "source"):
        if not isinstance(record[k], str) or not record[k]:
            raise SproutError(f"{k!r} must be a non-empty string")
    prompt = _messages(record["prompt"], "prompt")
    if prompt[-1]["role"] != "user":
        raise SproutError(f"prompt must end with a user turn, ends with {prompt[-1]['role']}")
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
    return record


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    if not path.is_file():
        raise SproutError(f"{path}: preference file not found")
    with open(path, "rb") as f:
        yield from enumerate(f, 1)


def _parse(raw: bytes, path: Path, lineno: int):
    """One line's JSON value; `SproutError` naming the file and line when it has none."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SproutError(f"{path}:{lineno}: not valid UTF-8 (byte {exc.start} of the line)") from None
    if not text.strip():
        raise SproutError(f"{path}:{lineno}: empty line")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SproutError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None


def _check_line(raw: bytes, path: Path, lineno: int, ids: dict) -> dict:
    """One line as a checked record; `SproutError` naming the file and line otherwise."""
    record = _parse(raw, path, lineno)
    try:
        check_pair(record)
    except SproutError as exc:
        raise SproutError(f"{path}:{lineno}: {exc}") from None
    if record["id"] in ids:
        raise SproutError(f"{path}:{lineno}: id {record['id']!r} repeats line {ids[record['id']]}")
    ids[record["id"]] = lineno
    return record


def read_preferences(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the checked records of a preference file; the first bad line (or a repeated
    id) raises `SproutError` naming the file and line."""
    path = Path(path)
    ids: dict[str, int] = {}
    for lineno, raw in _lines(path):
        yield _check_line(raw, path, lineno, ids)


def verify_preferences(path: str | os.PathLike, max_errors: int = 5) -> dict:
    """Check every line of a preference file. Returns `{"path", "records", "valid",
    "sources", "with_margin", "errors"}`: `errors` holds up to `max_errors` lines
    `file:line: what is wrong` (empty when the file keeps the contract); a missing file
    is its only error."""
    path = Path(path)
    result = {"path": str(path), "records": 0, "valid": 0, "sources": Counter(), "with_margin": 0, "errors": []}
    ids: dict[str, int] = {}
    try:
        for lineno, raw in _lines(path):
            result["records"] += 1
            try:
                record = _check_line(raw, path, lineno, ids)
            except SproutError as exc:
                if len(result["errors"]) < max_errors:
                    result["errors"].append(str(exc))
                continue
            result["valid"] += 1
            result["sources"][record["source"]] += 1
            result["with_margin"] += "margin" in record
    except SproutError as exc:  # the file itself is missing
        result["errors"].append(str(exc))
    result["sources"] = dict(result["sources"])
    return result


def write_preferences(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Check and write records, one JSON line each, atomically; returns the count."""
    path = Path(path)
    n = 0
    with atomic_write(path, "wb") as f:
        for n, record in enumerate(records, 1):
            try:
                check_pair(record)
            except SproutError as exc:
                raise SproutError(f"{path}: record {n} ({record.get('id') if isinstance(record, dict) else '?'}): {exc}") from None
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    return n
