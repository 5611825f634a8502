"""Streaming document readers: one text per document, memory flat however large the input.

Formats, from the file name and, for JSON, the first non-blank byte: `.txt` (documents split
by `<|endoftext|>` when the file holds one, else blank lines; a final fragment the file does not
terminate is dropped and counted as `unterminated`), `.jsonl` / `.json` (+ `.gz`/`.zst`: JSON
Lines, or one array parsed element by element), `.parquet` (one record batch at a time), a folder
(a `datasets.save_to_disk` folder, else every supported file in it) and a hub id `owner/name`
(`datasets`, streaming). A `path` may be a glob; its files are read in sorted order.

Errors name the file and the line, element or byte offset: a truncated or uncompressed
.gz/.zst, invalid UTF-8, a missing or non-string text field, a file with no documents. An
invalid JSON line is skipped, counted and warned about (or fails under `strict`); a text holding
a lone surrogate (`\\ud800`) is skipped, counted as `invalid_unicode` and warned about.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import sys
from dataclasses import dataclass, field
from glob import glob
from pathlib import Path
from typing import IO, Callable, Iterator

from sprout.errors import SproutError
from sprout.prep.compressed import CHUNK, open_binary
from sprout.ranges import in_range
from sprout.tokenizer import EOT

DETECT_CHARS = 1 << 20  # .txt: no <|endoftext|> in this many characters -> blank-line documents
MAX_WARNINGS_PER_FILE = 5
SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")


@dataclass
class SourceSpec:
    """One input source. `path` is a file, folder, glob or hub id."""

    path: str                          # file, folder, glob or hub id; `${SPROUT_MIRROR}/...` for the mirror
    name: str | None = None            # its name in summaries and the manifest (None: the file stem or hub id tail)
    weight: float | None = in_range(None, "[0, inf)")  # documents taken per document read; None: 1
    text_field: str | None = None      # None -> the pipeline's default ("text")
    format: str = "auto"              # auto | txt | jsonl | json | parquet | hf
    separator: str | None = None      # .txt: None = auto (<|endoftext|> if present, else blank lines)
    keep_unterminated: bool = False   # .txt: keep a final fragment with no closing separator
    hf_config: str | None = None      # hub datasets: config name (e.g. "sample-10BT")
    split: str = "train"              # hub / save_to_disk datasets: which split
    max_docs: int | None = in_range(None, "[0, inf)")  # stop after this many documents (None: all)


@dataclass
class ReadStats:
    """What a reader saw, for the summary and the manifest."""

    documents: int = 0
    invalid_json: int = 0
    invalid_unicode: int = 0
    unterminated: int = 0
    files: list[str] = field(default_factory=list)


def print_warning(msg: str) -> None:
    """`warning: msg` on stderr: what prep says about a source it reads on."""
    print(f"warning: {msg}", file=sys.stderr)


def parse_source_arg(arg: str) -> SourceSpec:
    """`PATH` or `PATH:WEIGHT` (the weight is the part after the last colon, if numeric)."""
    path, sep, tail = arg.rpartition(":")
    if sep and path:
        try:
            weight = float(tail)
        except ValueError:
            return SourceSpec(path=arg)
        if weight < 0:
            raise SproutError(f"--source {arg}: weight must be >= 0")
        return SourceSpec(path=path, weight=weight)
    return SourceSpec(path=arg)


def source_name(spec: SourceSpec) -> str:
    """A short name for summaries: the spec's name, else the file stem or hub id tail."""
    if spec.name:
        return spec.name
    base = Path(spec.path.rstrip("/")).name
    for suffix in (".gz", ".zst", ".jsonl", ".json", ".txt", ".parquet"):
        base = base.removesuffix(suffix)
    return re.sub(r"[^\w.-]+", "_", base) or "source"


def iter_documents(
    spec: SourceSpec,
    default_field: str = "text",
    *,
    strict: bool = False,
    stats: ReadStats | None = None,
    warn: Callable[[str], None] = print_warning,
) -> Iterator[str]:
    """Yield the text of every document of one source, in a fixed order."""
    stats = stats if stats is not None else ReadStats()
    fld = spec.text_field or default_field
    path = spec.path
    looks_like_hub_id = bool(HUB_ID.match(path)) and _kind(Path(path)) is None and not _exists(path)
    if spec.format == "hf" or (spec.format == "auto" and looks_like_hub_id):
        gen = _iter_hf(path, fld, spec)
        stats.files.append(path)
    else:
        files = _resolve_files(path)
        stats.files.extend(str(f) for f in files)
        gen = _iter_files(files, fld, spec, strict, stats, warn)
    n = 0
    try:
        for text in gen:
            if spec.max_docs is not None and n >= spec.max_docs:
                break
            n += 1
            stats.documents += 1
            yield text
    finally:
        gen.close()
    if n == 0:
        raise SproutError(f"{path}: empty input, no documents found")


def _exists(path: str) -> bool:
    return os.path.exists(path) or bool(glob(path))


def _resolve_files(path: str) -> list[Path]:
    if any(c in path for c in "*?["):
        files = sorted(Path(p) for p in glob(path))
        if not files:
            raise SproutError(f"{path}: no files match this pattern")
        return files
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
            return [p]  # a datasets.save_to_disk folder
        files = sorted(f for f in p.rglob("*") if f.is_file() and _kind(f) is not None)
        if not files:
            raise SproutError(f"{p}: folder holds no .txt/.jsonl/.json/.parquet files")
        return files
    raise SproutError(f"{path}: no such file or folder (and not a hub id like owner/name)")


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for comp in (".gz", ".zst"):
        name = name.removesuffix(comp)
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix[1:]
    return None


def _iter_files(files, fld, spec, strict, stats, warn) -> Iterator[str]:
    for path in files:
        if path.is_dir():
            yield from _iter_saved_dataset(path, fld, spec)
            continue
        kind = spec.format if spec.format != "auto" else _kind(path)
        if kind is None:
            raise SproutError(f"{path}: unknown file type (expected .txt, .jsonl, .json, .parquet, optionally .gz/.zst)")
        before = stats.invalid_json + stats.invalid_unicode + stats.unterminated
        n = 0
        if kind == "parquet":
            for n, text in enumerate(_iter_parquet(path, fld), start=1):
                yield text
        else:
            with open_binary(path) as f:
                docs = _iter_txt(f, path, spec, stats) if kind == "txt" else _iter_json_any(f, path, fld, strict, stats, warn)
                for n, text in enumerate(docs, start=1):
                    yield text
        if n == 0:
            skipped = stats.invalid_json + stats.invalid_unicode + stats.unterminated - before
            detail = f" ({skipped} invalid or unterminated record(s) skipped)" if skipped else ""
            raise SproutError(f"{path}: empty input, no documents found{detail}")


# ---------------------------------------------------------------- text files


def _iter_txt(f: IO[bytes], path: Path, spec: SourceSpec, stats: ReadStats) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    sep = spec.separator
    buf, consumed, seen_sep = "", 0, False
    while True:
        raw = f.read(CHUNK)
        try:
            buf += decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as exc:
            raise SproutError(f"{path}: invalid UTF-8 at byte {consumed + exc.start:,}") from None
        consumed += len(raw)
        if sep is None and (EOT in buf or not raw or len(buf) > DETECT_CHARS):
            sep = EOT if EOT in buf else ""  # "" = blank lines
        if sep is not None:
            parts = buf.split(sep) if sep else BLANK_LINES.split(buf)
            buf = parts.pop()
            seen_sep = seen_sep or bool(parts)
            for part in parts:
                if part.strip():
                    yield part.strip("\r\n")  # newlines around a separator are not content
        if not raw:
            break
    if buf.strip():
        if sep and seen_sep and not spec.keep_unterminated:
            stats.unterminated += 1
        else:
            yield buf.strip("\r\n")


# ---------------------------------------------------------------- JSON


def encodable(text: str) -> bool:
    """False for text holding a lone surrogate (from an unpaired `\\ud800`-style JSON escape),
    which cannot be written as UTF-8."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Warnings:
    """Warn about the first MAX_WARNINGS_PER_FILE problems of one file, then say the rest are suppressed."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn, self.count = warn, 0

    def __call__(self, msg: str) -> None:
        if self.count < MAX_WARNINGS_PER_FILE:
            last = self.count == MAX_WARNINGS_PER_FILE - 1
            self.warn(msg + (" (further warnings for this file suppressed)" if last else ""))
        self.count += 1


def surrogate_message(where: str) -> str:
    return f"{where}: text holds a lone surrogate (an unpaired \\ud800-\\udfff escape, not valid Unicode); skipped"


def numbered_lines(f: IO[bytes], path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a binary stream; a truncated or corrupted compressed stream
    stops with SproutError naming the file and the last complete line."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, start=1):
            yield lineno, line
    except SproutError as exc:
        last = f"after line {lineno:,}, the last complete one" if lineno else "before the first line"
        raise SproutError(f"{exc}; {last}") from None


def _text_of(obj, fld: str, where: str) -> str:
    if not isinstance(obj, dict):
        raise SproutError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if fld not in obj:
        keys = ", ".join(list(obj)[:8])
        raise SproutError(f"{where}: missing text field {fld!r} (keys: {keys})")
    text = obj[fld]
    if not isinstance(text, str):
        raise SproutError(f"{where}: text field {fld!r} is {type(text).__name__}, not a string")
    return text


def _iter_json_any(f, path: Path, fld: str, strict: bool, stats: ReadStats, warn) -> Iterator[str]:
    head = f.peek(64) if hasattr(f, "peek") else b""
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if first == b"[":
        yield from _iter_json_array(f, path, fld, stats, warn)
    else:
        yield from _iter_jsonl(f, path, fld, strict, stats, warn)


def _iter_jsonl(f, path: Path, fld: str, strict: bool, stats: ReadStats, warn) -> Iterator[str]:
    warn = Warnings(warn)
    for lineno, line in numbered_lines(f, path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            msg = f"{path}:{lineno}: invalid JSON line ({exc})"
            if strict:
                raise SproutError(msg) from None
            stats.invalid_json += 1
            warn(msg + "; skipped")
            continue
        text = _text_of(obj, fld, f"{path}:{lineno}")
        if not encodable(text):
            stats.invalid_unicode += 1
            warn(surrogate_message(f"{path}:{lineno}"))
            continue
        yield text


_WS = re.compile(r"\s*")


def _iter_json_array(f, path: Path, fld: str, stats: ReadStats, warn) -> Iterator[str]:
    """Elements of a top-level JSON array, decoded one at a time from a sliding buffer."""
    warn = Warnings(warn)
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8-sig")("strict")
    buf, pos, offset, eof, index = "", 0, 0, False, 0  # offset: chars consumed before buf

    def more(n: int) -> None:
        nonlocal buf, pos, offset, eof
        raw = f.read(n)
        eof = not raw
        try:
            text = utf8.decode(raw, final=eof)
        except UnicodeDecodeError as exc:
            raise SproutError(f"{path}: invalid UTF-8 in JSON near element {index}") from exc
        offset += pos
        buf, pos = buf[pos:] + text, 0

    def skip_ws() -> None:
        nonlocal pos
        while True:
            pos = _WS.match(buf, pos).end()
            if pos < len(buf) or eof:
                return
            more(CHUNK)

    more(CHUNK)
    skip_ws()
    if buf[pos : pos + 1] != "[":
        raise SproutError(f"{path}: expected a JSON array at character {offset + pos}")
    pos += 1
    skip_ws()
    if buf[pos : pos + 1] == "]":
        return
    while True:
        want = CHUNK
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as exc:
                incomplete = exc.pos >= len(buf) - 16 or exc.msg.startswith("Unterminated string")
                if eof or not incomplete:
                    raise SproutError(f"{path}: invalid JSON in array element {index} at character {offset + exc.pos:,}: {exc.msg}") from None
                more(max(want, len(buf)))  # grow geometrically: no quadratic re-parsing
        pos = end
        text = _text_of(obj, fld, f"{path}: array element {index}")
        if encodable(text):
            yield text
        else:
            stats.invalid_unicode += 1
            warn(surrogate_message(f"{path}: array element {index}"))
        index += 1
        skip_ws()
        ch = buf[pos : pos + 1]
        if ch == "]":
            return
        if ch != ",":
            where = "end of file" if not ch else f"character {offset + pos:,}"
            raise SproutError(f"{path}: expected ',' or ']' after array element {index - 1} at {where}")
        pos += 1
        skip_ws()


# ---------------------------------------------------------------- parquet and datasets


def _iter_parquet(path: Path, fld: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SproutError(f"{path}: not a readable parquet file ({exc})") from None
    if fld not in pf.schema_arrow.names:
        raise SproutError(f"{path}: missing text field {fld!r} (columns: {', '.join(pf.schema_arrow.names[:8])})")
    row = 0
    try:
        for group in range(pf.num_row_groups):
            for batch in pf.iter_batches(batch_size=4096, row_groups=[group], columns=[fld]):
                for text in batch.column(0).to_pylist():
                    if not isinstance(text, str):
                        raise SproutError(f"{path}: row {row}: text field {fld!r} is {type(text).__name__}, not a string")
                    row += 1
                    yield text
    except (pa.ArrowInvalid, OSError) as exc:
        raise SproutError(f"{path}: corrupted parquet data at row {row} ({exc})") from None


def _iter_rows(rows, fld: str, where: str) -> Iterator[str]:
    for i, row in enumerate(rows):
        yield _text_of(row, fld, f"{where}: row {i}")


def _iter_saved_dataset(path: Path, fld: str, spec: SourceSpec) -> Iterator[str]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if spec.split not in ds:
            raise SproutError(f"{path}: no split {spec.split!r} (splits: {', '.join(ds)})")
        ds = ds[spec.split]
    if fld not in ds.column_names:
        raise SproutError(f"{path}: missing text field {fld!r} (columns: {', '.join(ds.column_names[:8])})")
    yield from _iter_rows(ds.select_columns([fld]), fld, str(path))


def _iter_hf(path: str, fld: str, spec: SourceSpec) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_dataset(path, name=spec.hf_config, split=spec.split, streaming=True)
    except Exception as exc:  # hub/network/config errors all surface to the user
        raise SproutError(f"{path}: cannot open dataset ({type(exc).__name__}: {exc})") from None
    yield from _iter_rows(ds, fld, path)
