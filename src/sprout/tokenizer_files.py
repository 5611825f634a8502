"""A tokenizer's files against what data or a checkpoint recorded of them.

A tokenizer's files are its own file, whose sha256 is its `fingerprint()` (the SentencePiece
.model, the hf: tokenizer.json, tiktoken's ranks), and for `hf:` the side files beside it
(`side_file_names`). A prep records the fingerprint and, for `hf:`, the side files' sha256
(`side_files_sha256`); a checkpoint's meta.json records the same of its run folder's copy
(`sprout.checkpoint.checkpoint_tokenizer`). `load_recorded` loads a tokenizer against such a
`Record` and refuses, in one line naming the file and the file holding the record, a side file
changed, gone or new, a tokenizer that cannot be loaded, or one whose fingerprint differs. An
`hf:` record without side files (data prepared by an earlier version of sprout) has its
tokenizer file checked alone, with a note.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sprout.atomic import sha256_file
from sprout.errors import SproutError
from sprout.tokenizer import CHAT_FORMAT_FILE, CHAT_TEMPLATE_FILE, HF_SIDE_FILES, Tokenizer, load_tokenizer, spec_file

DATA_FIX = "put back the file the data was prepared with, or prepare the data again with this one"
_HASHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its side files' sha256, hashed once


@dataclass(frozen=True)
class Record:
    """What the file `where` recorded of the tokenizer it was made with."""

    fingerprint: str                  # `Tokenizer.fingerprint()`: the sha256 of the tokenizer's file
    side_sha256: dict | None          # {name: sha256} of an hf: tokenizer's side files; None: not recorded
    where: str                        # the file holding the record: a manifest.json, an sft.h5, a meta.json
    fields: tuple[str, str]           # the names of those two fields in it
    made: str = "this data was prepared with"  # what `where` says of the tokenizer, for the messages
    fix: str = DATA_FIX               # the advice closing a refusal ("" for none)

    def same(self, other: "Record") -> bool:
        """Whether `other` records the same tokenizer files (wherever it is kept)."""
        return (self.fingerprint, self.side_sha256) == (other.fingerprint, other.side_sha256)


def side_file_names(kind: str) -> tuple[str, ...]:
    """The files beside a tokenizer's own that belong to it: for `hf`, those transformers reads
    (`HF_SIDE_FILES`) and the chat format's (`CHAT_FORMAT_FILE`, `CHAT_TEMPLATE_FILE`); none for
    the other kinds."""
    if kind != "hf":
        return ()
    return (*HF_SIDE_FILES, CHAT_FORMAT_FILE, CHAT_TEMPLATE_FILE)


def hash_side_files(main: Path, kind: str) -> dict:
    """{name: sha256} of the `side_file_names(kind)` present beside the tokenizer file `main`."""
    sides = {name: main.parent / name for name in side_file_names(kind)}
    return {name: sha256_file(p) for name, p in sides.items() if p.is_file()}


def side_files_sha256(tok: Tokenizer) -> dict | None:
    """What a prep records of `tok`'s side files beside its fingerprint: {name: sha256} for an
    `hf:` tokenizer, None for the other kinds. Hashed on the first call and kept, as the
    fingerprint is (a prep calls it when it loads the tokenizer)."""
    if tok.spec.partition(":")[0] != "hf":
        return None
    if tok not in _HASHED:
        _HASHED[tok] = hash_side_files(tok.file, "hf")
    return _HASHED[tok]


def load_recorded(spec: str, record: Record, stand_in: Path | None = None,
                  note: Callable[[str], object] | None = print) -> Tokenizer:
    """The tokenizer `spec` names, checked against `record` (see the module docstring): its file
    and side files are hashed before it is loaded (a replaced file may not load; an hf: tokenizer
    reads its side files), its fingerprint compared again once loaded. `stand_in`: a
    copy used when the spec's file is not here (a run folder's own copy on a resume from another
    directory). `note` says that a record without side files checks the tokenizer file alone."""
    path = spec_file(spec)
    if path is not None and not path.is_file() and stand_in is not None and stand_in.is_file():
        spec, path = f"{spec.partition(':')[0]}:{stand_in}", stand_in
    fix = f"; {record.fix}" if record.fix else ""
    if path is not None and path.is_file():  # hashed before it is loaded: a replaced file may not load
        _check_fingerprint(path, sha256_file(path), record, fix)
        if spec.startswith("hf:") and record.side_sha256 is None:
            if note is not None:
                note(f"note: {record.where} records no {record.fields[1]} (written by an earlier version of sprout): "
                     f"only {path} is checked against it, not the files beside it")
        elif spec.startswith("hf:"):
            _check_sides(path, record, fix)
    try:
        tok = load_tokenizer(spec)
    except SproutError as exc:
        raise SproutError(f"{record.where}: the tokenizer {record.made}, {spec}, cannot be loaded ({exc})") from None
    _check_fingerprint(tok.file or spec, tok.fingerprint(), record, fix)
    return tok


def _check_fingerprint(named, got: str, record: Record, fix: str) -> None:
    want = str(record.fingerprint)
    if got != want:
        raise SproutError(f"{named}: sha256 does not match {record.fields[0]} in {record.where}; not the tokenizer "
                          f"{record.made} (sha256 {got[:12]}…, recorded {want[:12]}…: replaced, or another "
                          f"tokenizer's file){fix}")


def _check_sides(main: Path, record: Record, fix: str) -> None:
    now, was = hash_side_files(main, "hf"), record.side_sha256
    key = f"{record.fields[1]} in {record.where}"
    for name in sorted(set(now) | set(was)):
        side = main.parent / name
        if name not in was:
            raise SproutError(f"{side}: new beside {main.name}, not in {key}; not a file of the tokenizer "
                              f"{record.made}{fix}")
        if name not in now:
            raise SproutError(f"{side}: missing, but {key} records it, a file of the tokenizer {record.made}{fix}")
        if now[name] != was[name]:
            raise SproutError(f"{side}: sha256 does not match {key}; not the file of the tokenizer {record.made} "
                              f"(sha256 {now[name][:12]}…, recorded {str(was[name])[:12]}…){fix}")
