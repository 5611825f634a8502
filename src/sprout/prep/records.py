"""What the record preps share between reading a source and writing their files: the `Drop` of
a record, the source list's checks, the loop that counts and leaves out dropped records, record
ids, the seeded shuffle-and-write of the train/test JSONL files and the dropped totals.

Used by `sprout.prep.preference_data` (preference pairs), `sprout.prep.rl_prompts` (RL prompts)
and, for the drop loop, `sprout.prep.sft_data` (chat rows).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator

from sprout.atomic import sha256_file
from sprout.chat import ChatError
from sprout.config import from_dict
from sprout.errors import SproutError
from sprout.prep import arithmetic
from sprout.prep.sources import print_warning


class Drop(Exception):
    """A record that is counted and left out (not an error): `reason` is the count's key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


def check_sources(sources: list, spec_cls: type, formats,
                  check_spec: Callable[[object, str], None] | None = None) -> list:
    """`sources[i]` read as `spec_cls`, each checked: a known format; levels and a positive count
    for an arithmetic source, else a path or a hub id; then `check_spec(spec, where)` when given.
    Names unique."""
    if not sources:
        raise SproutError("no sources configured (the config needs a `sources:` list)")
    specs = []
    for i, data in enumerate(sources):
        spec = from_dict(spec_cls, data, f"sources[{i}]")
        where = f"sources[{i}] ({spec.name})"
        if spec.format not in formats:
            raise SproutError(f"{where}: unknown format {spec.format!r} (expected one of {', '.join(formats)})")
        if spec.format == "arithmetic":
            spec.levels = list(arithmetic.check_levels(spec.levels, where))
            if spec.count <= 0:
                raise SproutError(f"{where}: count must be > 0 for an arithmetic source")
        elif not spec.path and not spec.hub:
            raise SproutError(f"{where}: needs a path or a hub id")
        if check_spec is not None:
            check_spec(spec, where)
        specs.append(spec)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SproutError(f"source names must be unique, got {names}")
    return specs


def kept_records(rows: Iterable[tuple[str, object]], counts: Counter, first_drop: dict[str, str], source: str,
                 check: Callable[[object], None]) -> Iterator:
    """The records of `rows` ((where, record) pairs; a record may be a `Drop`) that `check` passes.
    Counts each row in counts["read"] and each drop in counts["dropped_<reason>"] (a `Drop` or a
    `ChatError` raised by `check`); the first drop of each reason goes in
    first_drop["<source>/<reason>"] as "<where>: <detail>"."""
    for where, record in rows:
        counts["read"] += 1
        try:
            if isinstance(record, Drop):
                raise record
            check(record)
        except (Drop, ChatError) as drop:
            counts[f"dropped_{drop.reason}"] += 1
            first_drop.setdefault(f"{source}/{drop.reason}", f"{where}: {drop}")
            continue
        yield record


def log_first_drops(first_drop: dict[str, str], log=print) -> None:
    for what, example in first_drop.items():
        log(f"dropped ({what}), first at {example}")


def record_id(ids: Counter, base: str) -> str:
    """`base`, then `base`-1, `base`-2, ... for the same id again (kept because dedup is off)."""
    ids[base] += 1
    return base if ids[base] == 1 else f"{base}-{ids[base] - 1}"


def write_split_files(out: Path, splits: dict[str, list], names: dict[str, str], seed: int,
                      write: Callable[[Path, list], int], what: str, log=print, warn=print_warning) -> dict:
    """Shuffle each split's records (seeded by `seed` and the split's name) and `write` them to
    out/names[split]; returns {split: {path, records, sha256}}. An empty split is written and
    warned about (`empty_split_warning`)."""
    files = {}
    total = sum(len(records) for records in splits.values())
    for split, name in names.items():
        random.Random(f"{seed}-{split}").shuffle(splits[split])
        n = write(out / name, splits[split])
        files[split] = {"path": name, "records": n, "sha256": sha256_file(out / name)}
        log(f"{split}: {n:,} {what} -> {out / name}")
        if n == 0:
            warn(empty_split_warning(split, out / name, total, what))
    return files


def empty_split_warning(split: str, path: Path, total: int, what: str) -> str:
    """What a prep says when it writes an empty split: the file and the counts."""
    return (f"{path}: the {split} split is empty (0 of {total:,} {what}); a trainer cannot use it "
            f"(more input, or a larger test/val fraction)")


def dropped_totals(per_source: dict[str, Counter]) -> dict[str, int]:
    """The dropped counts of every source summed by reason, sorted by reason."""
    dropped = Counter()
    for c in per_source.values():
        dropped.update({k[len("dropped_"):]: v for k, v in c.items() if k.startswith("dropped_")})
    return dict(sorted(dropped.items()))
