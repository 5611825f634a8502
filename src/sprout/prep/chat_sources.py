"""SFT sources: Alpaca, Dolly, GSM8K, chat JSONL and the arithmetic generator -> conversations.

Each reader yields `Example(source, messages, where)`: `messages` the `{"role", "content"}`
list `sprout.chat.render` takes, `where` the file and line (or hub row). Formats: `alpaca`,
`dolly` (databricks-dolly-15k or mosaicml/dolly_hhrlhf, both giving the user text
`instruction\\ncontext`), `gsm8k` (the answer becomes `<think>reasoning</think><answer>N</answer>`,
N the normalised `#### N` gold), `chat` (JSONL `{"messages": [...]}`) and `arithmetic` (no
file: `count` problems of `sprout.prep.arithmetic`, its train split by default).

Files may be `.json` (an array), `.jsonl`, `.jsonl.gz` or `.jsonl.zst`. A line that is not
UTF-8 or JSON, a missing field or a bad archive is an error naming the file and line; a text
with a lone surrogate is skipped and counted (`dropped_invalid_unicode`); content problems are
left to the chat template. A source is read from its `path` (`${SPROUT_MIRROR}` stands for the
data mirror, `sprout.mirror`); with no path, or one needing a mirror when none is found, from
the hub through `datasets.load_dataset(hub, hub_config, split=split)`.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from sprout.answers import format_reasoning, normalise_number, not_a_number_reason
from sprout.config import from_dict
from sprout.ranges import SEED_RANGE, in_range
from sprout.errors import SproutError
from sprout.formats.jsonl import load_json
from sprout.mirror import ENV as MIRROR_VARIABLE
from sprout.mirror import expand_path, mirror_dir
from sprout.prep.arithmetic import check_levels
from sprout.prep.arithmetic import generate as generate_arithmetic
from sprout.prep.compressed import open_binary
from sprout.prep.sources import (Warnings, encodable, numbered_lines, parse_source_arg, print_warning,
                                 source_name, surrogate_message)

FORMATS = ("alpaca", "dolly", "gsm8k", "chat", "arithmetic")


@dataclass
class SourceConfig:
    name: str
    format: str
    path: str | None = None  # file; `${SPROUT_MIRROR}/...` for a file of the data mirror
    hub: str | None = None  # dataset id (or local folder) for `datasets.load_dataset`
    hub_config: str | None = None
    split: str = "train"
    weight: float = in_range(1.0, "[0, inf)")  # examples taken per example read (train split): 0.5 halves, 2 doubles
    count: int = in_range(0, "[0, inf)")  # arithmetic only: problems generated
    levels: list = field(default_factory=lambda: [1, 2, 3, 4])  # arithmetic only
    seed: int = in_range(0, SEED_RANGE)  # arithmetic only


def from_dict_source(data, index: int) -> SourceConfig:
    """A `SourceConfig` from one entry of a config's `sources:` list."""
    spec = from_dict(SourceConfig, data, f"sources[{index}]")
    if spec.format not in FORMATS:
        raise SproutError(f"sources[{index}] ({spec.name}): unknown format {spec.format!r} (expected one of {', '.join(FORMATS)})")
    return spec


def source_from_arg(arg: str, fmt: str | None, taken: set[str]) -> dict:
    """A `sources:` entry from `--source PATH[:WEIGHT]` and `--format FMT`, named after the
    file (made unique against `taken`, which it joins). For `arithmetic` PATH is the number
    of problems to generate."""
    if fmt not in FORMATS:
        raise SproutError(f"--source {arg}: --format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    spec = parse_source_arg(arg)
    entry = {"format": fmt, "weight": 1.0 if spec.weight is None else spec.weight}
    if fmt == "arithmetic":
        try:
            entry["count"] = int(spec.path)
        except ValueError:
            raise SproutError(f"--source {arg}: with --format arithmetic, give the number of problems (N[:WEIGHT])") from None
        base = "arithmetic"
    else:
        entry["path"] = spec.path
        base = source_name(spec)
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return {"name": name, **entry}


@dataclass
class Example:
    source: str
    messages: list
    where: str


# ---- reading records -----------------------------------------------------------------

def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SproutError(f"{path}:{lineno}: not valid UTF-8 (byte {exc.start} of the line: {raw[exc.start:exc.start + 4]!r})") from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _strings_encodable(obj) -> bool:
    if isinstance(obj, str):
        return encodable(obj)
    if isinstance(obj, dict):
        return all(_strings_encodable(k) and _strings_encodable(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_strings_encodable(v) for v in obj)
    return True


def iter_records(path: str | os.PathLike, skipped: Counter | None = None, warn=print_warning) -> Iterator[tuple[str, dict]]:
    """Yield `(where, record)` from a `.json` array, `.jsonl`, `.jsonl.gz` or `.jsonl.zst` file.
    Records holding a lone surrogate are skipped, warned about and counted in
    `skipped["dropped_invalid_unicode"]`. A file without a single record (empty, blank lines
    only, or `[]`) is refused: it is not the data its config names."""
    path = Path(path)
    if not path.is_file():
        raise SproutError(f"{path}: source file not found")
    warn = Warnings(warn)

    def usable(raw: bytes, record, where: str) -> bool:
        if not _SURROGATE_ESCAPE.search(raw) or _strings_encodable(record):
            return True
        if skipped is not None:
            skipped["dropped_invalid_unicode"] += 1
        warn(surrogate_message(where))
        return False

    if path.suffix == ".json":
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise SproutError(f"{path}:{line}: not valid UTF-8 (byte offset {exc.start})") from None
        rows = load_json(text, path)
        if not isinstance(rows, list):
            raise SproutError(f"{path}: expected a JSON array of records, got {type(rows).__name__}")
        if not rows:
            raise SproutError(f"{path}: the source file holds no records (an empty JSON array)")
        any_escape = bool(_SURROGATE_ESCAPE.search(data))
        for i, row in enumerate(rows):
            if not any_escape or usable(data, row, f"{path}[{i}]"):
                yield f"{path}[{i}]", row
        return
    records = 0
    with open_binary(path) as f:
        for lineno, raw in numbered_lines(f, path):
            text = _decode(raw, path, lineno)
            if not text.strip():
                continue
            record = load_json(text, path, lineno)
            records += 1
            if usable(raw, record, f"{path}:{lineno}"):
                yield f"{path}:{lineno}", record
    if not records:
        raise SproutError(f"{path}: the source file holds no records (it is empty or has blank lines only)")


def string_field(row, key: str, where: str, optional: bool = False) -> str:
    """The string `row[key]` of a JSON object row ('' when absent and `optional`), else one error naming `where`."""
    if not isinstance(row, dict):
        raise SproutError(f"{where}: expected a JSON object, got {type(row).__name__}")
    value = row.get(key)
    if value is None:
        if optional:
            return ""
        raise SproutError(f"{where}: missing field {key!r} (has {', '.join(sorted(row)) or 'nothing'})")
    if not isinstance(value, str):
        raise SproutError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


# ---- one record -> one conversation --------------------------------------------------

def _chat(user: str, assistant: str) -> list:
    return [{"role": "user", "content": user.strip()}, {"role": "assistant", "content": assistant.strip()}]


def alpaca_messages(row, where: str) -> list:
    instruction = string_field(row, "instruction", where).strip()
    extra = string_field(row, "input", where, optional=True).strip()
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return _chat(user, string_field(row, "output", where))


_ALPACA_WRAPPER = re.compile(
    r"Below is an instruction that describes a task(?:, paired with an input that provides further context)?\. "
    r"Write a response that appropriately completes the request\.\s*"
    r"### Instruction:\n(?P<instruction>.*?)(?:\n\n### Input:\n(?P<input>.*?))?\n\n### Response:\n?\s*",
    re.DOTALL,
)


def strip_alpaca_wrapper(prompt: str) -> str:
    """The instruction (plus input/context) inside an Alpaca-template prompt; the prompt
    itself when it carries no wrapper."""
    m = _ALPACA_WRAPPER.fullmatch(prompt.strip() + "\n")
    if m is None:
        return prompt.strip()
    extra = (m.group("input") or "").strip()
    instruction = m.group("instruction").strip()
    return f"{instruction}\n\n{extra}" if extra else instruction


def dolly_messages(row, where: str) -> list:
    if isinstance(row, dict) and "prompt" in row and "instruction" not in row:
        return _chat(strip_alpaca_wrapper(string_field(row, "prompt", where)), string_field(row, "response", where))
    instruction = string_field(row, "instruction", where).strip()
    context = string_field(row, "context", where, optional=True).strip()
    user = f"{instruction}\n{context}" if context else instruction
    return _chat(user, string_field(row, "response", where))


_CALC_RE = re.compile(r"<<[^<>]*>>")


def gsm8k_gold(answer: str, where: str) -> str:
    """The normalised number after `####`."""
    if "####" not in answer:
        raise SproutError(f"{where}: GSM8K answer has no '#### N' final answer")
    final = answer.rsplit("####", 1)[1]
    gold = normalise_number(final)
    if gold is None:
        raise SproutError(f"{where}: GSM8K final answer {not_a_number_reason(final.strip())}")
    return gold


def gsm8k_reasoning(answer: str) -> str:
    """The worked solution before `####`, without `<<expr=value>>` annotations."""
    return _CALC_RE.sub("", answer.rsplit("####", 1)[0]).strip()


def gsm8k_messages(row, where: str) -> list:
    answer = string_field(row, "answer", where)
    gold = gsm8k_gold(answer, where)
    return _chat(string_field(row, "question", where), format_reasoning(gsm8k_reasoning(answer), gold))


def chat_messages(row, where: str) -> list:
    msgs = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(msgs, list):
        raise SproutError(f"{where}: missing list field 'messages'")
    return msgs


def arithmetic_messages(row, where: str) -> list:
    return _chat(row["question"], row["answer"])


CONVERTERS = {"alpaca": alpaca_messages, "dolly": dolly_messages, "gsm8k": gsm8k_messages, "chat": chat_messages,
              "arithmetic": arithmetic_messages}


# ---- sources ---------------------------------------------------------------------------

def _hub_rows(spec: SourceConfig) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - a declared dependency
        raise SproutError("reading from the hub needs the `datasets` package") from None
    try:
        ds = datasets.load_dataset(spec.hub, spec.hub_config, split=spec.split)
    except Exception as exc:  # network, missing split, bad folder: one line for the user
        raise SproutError(f"{spec.hub}: cannot load dataset ({type(exc).__name__}: {exc}); "
                          "pass --mirror DIR to read local files instead") from None
    for i, row in enumerate(ds):
        yield f"{spec.hub}[{spec.split}][{i}]", row


def _arithmetic_rows(spec: SourceConfig) -> Iterator[tuple[str, dict]]:
    if spec.count <= 0:
        raise SproutError(f"source {spec.name}: count must be > 0 for an arithmetic source")
    for i, p in enumerate(generate_arithmetic(spec.count, check_levels(spec.levels, f"source {spec.name}"),
                                              spec.seed, spec.split)):
        yield f"{spec.name}[{i}] (level {p.level})", {"question": p.question, "answer": p.worked}


def source_rows(spec: SourceConfig, mirror: str | os.PathLike | None,
                skipped: Counter | None = None) -> Iterator[tuple[str, dict]]:
    """Raw records of one source: its `path` (with the mirror filled in), else the hub;
    records skipped while reading are counted in `skipped` (`iter_records`)."""
    if spec.format not in CONVERTERS:
        raise SproutError(f"source {spec.name}: unknown format {spec.format!r} (expected one of {', '.join(FORMATS)})")
    if spec.format == "arithmetic":
        return _arithmetic_rows(spec)
    return file_or_hub_rows(spec, mirror, skipped)


def file_or_hub_rows(spec, mirror: str | os.PathLike | None,
                     skipped: Counter | None = None) -> Iterator[tuple[str, dict]]:
    """Raw records of a source with a `path` (the mirror filled in; used when it needs no mirror
    or one is found) or a `hub` id (`spec.name`, `.path`, `.hub`, and what `_hub_rows` reads)."""
    if spec.path and (MIRROR_VARIABLE not in spec.path or mirror_dir(mirror) is not None):
        return iter_records(Path(expand_path(spec.path, mirror)), skipped)
    if spec.hub:
        return _hub_rows(spec)
    raise SproutError(f"source {spec.name}: {spec.path or 'no path'} needs a mirror (--mirror DIR or SPROUT_MIRROR) "
                      "and there is no hub id")


def read_source(spec: SourceConfig, mirror=None, max_examples: int | None = None,
                skipped: Counter | None = None) -> Iterator[Example]:
    """Conversations of one source, in file order; at most `max_examples` records (skipped
    ones, counted in `skipped`, not included)."""
    convert = CONVERTERS.get(spec.format)
    for n, (where, row) in enumerate(source_rows(spec, mirror, skipped)):
        if max_examples is not None and n >= max_examples:
            break
        yield Example(spec.name, convert(row, where), where)
