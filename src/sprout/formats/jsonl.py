"""Checked JSONL files: what every JSON-lines contract in `sprout.formats` shares.

A contract module (`preferences`, `prompts`) supplies `check(record)`, which returns the
record or raises `SproutError` saying what is wrong (without the location); this module
reads the file line by line and adds the location, so every refusal is one line
`file:line: what is wrong`:

- each line is UTF-8 JSON, one value per line; an empty line is refused;
- `id` repeats nowhere in the file (the first line that repeats one is refused);
- `check_messages` is the one shape check of a message list: a non-empty list of objects
  with exactly `role` (system, user or assistant) and a string `content`.

`read_records` yields checked records, `verify_records` checks a whole file and returns
counts and the first errors instead of raising, `write_records` checks each record and
writes the file atomically (nothing is left behind when a record is refused).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

from sprout.atomic import atomic_write
from sprout.chat_formats import ROLES
from sprout.errors import SproutError

Check = Callable[[object], dict]


def check_messages(value, name: str) -> list:
    """`value` when it is a non-empty list of `{"role", "content": str}` messages; a
    `SproutError` naming `name` and the message otherwise."""
    if not isinstance(value, list) or not value:
        raise SproutError(f"{name!r} must be a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise SproutError(f"{name}[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ROLES:
            raise SproutError(f"{name}[{i}]: unknown role {m['role']!r}")
        if not isinstance(m["content"], str):
            raise SproutError(f"{name}[{i}]: content must be a string, got {type(m['content']).__name__}")
    return value


def check_prompt_record(record, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> list:
    """The checks every record with an id, a source and a prompt shares: a JSON object with all
    of `keys` and nothing else but `optional` ones, non-empty string 'id' and 'source', and a
    'prompt' of messages ending with a user turn. Returns the prompt; raises `SproutError`
    (without the location: callers add it) otherwise."""
    if not isinstance(record, dict):
        raise SproutError(f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in keys if k not in record]
    if missing:
        raise SproutError(f"missing key(s) {', '.join(missing)}")
    unknown = sorted(set(record) - set(keys) - set(optional))
    if unknown:
        raise SproutError(f"unknown key(s) {', '.join(unknown)}")
    for k in ("id", "source"):
        if not isinstance(record[k], str) or not record[k]:
            raise SproutError(f"{k!r} must be a non-empty string")
    prompt = check_messages(record["prompt"], "prompt")
    if prompt[-1]["role"] != "user":
        raise SproutError(f"prompt must end with a user turn, ends with {prompt[-1]['role']}")
    return prompt


def load_json(text: str | bytes, path: str | os.PathLike, lineno: int | None = None):
    """`json.loads(text)` of line `lineno` of `path` (None: the whole file); `SproutError`
    naming the file and line when it is not JSON, or holds an integer longer than Python
    reads (4,300 digits), which the message does not print."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SproutError(f"{path}:{lineno or exc.lineno}: invalid JSON: {exc.msg}") from None
    except ValueError as exc:  # int()'s digit limit; the message names the limit, not the digits
        where = f"{path}:{lineno}" if lineno else str(path)
        raise SproutError(f"{where}: a JSON number too long to read: {str(exc).split(';')[0]}") from None


def _lines(path: Path, what: str) -> Iterator[tuple[int, bytes]]:
    if not path.is_file():
        raise SproutError(f"{path}: {what} not found")
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
    return load_json(text, path, lineno)


def _check_line(raw: bytes, path: Path, lineno: int, ids: dict, check: Check) -> dict:
    """One line as a checked record; `SproutError` naming the file and line otherwise."""
    record = _parse(raw, path, lineno)
    try:
        check(record)
    except SproutError as exc:
        raise SproutError(f"{path}:{lineno}: {exc}") from None
    if record["id"] in ids:
        raise SproutError(f"{path}:{lineno}: id {record['id']!r} repeats line {ids[record['id']]}")
    ids[record["id"]] = lineno
    return record


def read_records(path: str | os.PathLike, check: Check, what: str) -> Iterator[dict]:
    """Yield the checked records of a file; the first bad line (or a repeated id) raises
    `SproutError` naming the file and line. `what` names the file kind when it is missing."""
    path = Path(path)
    ids: dict[str, int] = {}
    for lineno, raw in _lines(path, what):
        yield _check_line(raw, path, lineno, ids, check)


def verify_records(path: str | os.PathLike, check: Check, what: str, max_errors: int = 5,
                   tally: Callable[[dict, dict], None] | None = None, **extra) -> dict:
    """Check every line of a file. Returns `{"path", "records", "valid", "sources",
    **extra, "errors"}`; `tally(result, record)` adds each valid record to the contract's
    own counts in `extra`. `errors` holds up to `max_errors` lines `file:line: what is
    wrong` (empty when the file keeps the contract); a missing file is its only error."""
    path = Path(path)
    result = {"path": str(path), "records": 0, "valid": 0, "sources": {}, **extra, "errors": []}
    ids: dict[str, int] = {}
    try:
        for lineno, raw in _lines(path, what):
            result["records"] += 1
            try:
                record = _check_line(raw, path, lineno, ids, check)
            except SproutError as exc:
                if len(result["errors"]) < max_errors:
                    result["errors"].append(str(exc))
                continue
            result["valid"] += 1
            result["sources"][record["source"]] = result["sources"].get(record["source"], 0) + 1
            if tally is not None:
                tally(result, record)
    except SproutError as exc:  # the file itself is missing
        result["errors"].append(str(exc))
    return result


def write_records(path: str | os.PathLike, records: Iterable[dict], check: Check) -> int:
    """Check and write records, one JSON line each, atomically; returns the count."""
    path = Path(path)
    n = 0
    with atomic_write(path, "wb") as f:
        for n, record in enumerate(records, 1):
            try:
                check(record)
            except SproutError as exc:
                rid = record.get("id") if isinstance(record, dict) else "?"
                raise SproutError(f"{path}: record {n} ({rid}): {exc}") from None
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    return n
