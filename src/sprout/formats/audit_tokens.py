"""The full audit of a folder of pretraining tokens, behind `scripts/verify_shards.py DIR`.

`verify_dir` runs the rules a trainer checks at start (`sprout.formats.verify_inputs`: every
`.bin`/`.h5` file listed, each listed file's contract, count, sha256 and largest id, ids below
the vocab size) in mode "full" on every file, one line per failing file, then checks the
tokens themselves, each failure one line naming the file:
- each split holds the token count `splits` records, has end-of-text (rate > 0) and ends with it;
- when both formats are present, the .bin shards and the .h5 file hold the same tokens;
- zero train/val overlap, twice: the documents between end-of-text tokens in the val output
  never occur in the train output, and the sidecar of dedup keys (`doc_hashes.npz`) holds no
  key in both splits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sprout.atomic import sha256_file
from sprout.errors import SproutError
from sprout.formats import manifest as mf
from sprout.formats.verify_inputs import TOKEN_SUFFIXES, check_content, check_file, check_listed, token_blocks


@dataclass
class _Scan:
    """Running per-split statistics over a token stream that may span several files."""

    eot: int
    val_docs: set | None = None  # when scanning train: the val document hashes to look for
    docs: set = field(default_factory=set)
    tokens: int = 0
    eots: int = 0
    overlaps: int = 0
    last: int | None = None
    sha: object = field(default_factory=hashlib.sha256)  # of the ids, to compare bin with hdf5
    _carry: list = field(default_factory=list)

    def feed(self, arr: np.ndarray) -> None:
        if len(arr) == 0:
            return
        ends = np.flatnonzero(arr == self.eot)
        start = 0
        for end in ends:  # one iteration per document
            h = hashlib.md5()
            for piece in self._carry:
                h.update(piece)
            h.update(arr[start:end].tobytes())
            self._carry = []
            digest = h.digest()
            if self.val_docs is None:
                self.docs.add(digest)
            elif digest in self.val_docs:
                self.overlaps += 1
            start = int(end) + 1
        if start < len(arr):
            self._carry.append(arr[start:].tobytes())
        self.sha.update(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
        self.tokens += len(arr)
        self.eots += len(ends)
        self.last = int(arr[-1])


def _passes(failures: list[str], rule, *args) -> bool:
    """Run one rule of `sprout.formats.verify_inputs`; its SproutError becomes a failure line."""
    try:
        rule(*args)
    except SproutError as exc:
        failures.append(str(exc))
        return False
    return True


def verify_dir(directory: str | Path) -> tuple[list[str], list[str]]:
    """(failures, notes). No failures means every check held."""
    directory = Path(directory)
    notes: list[str] = []
    try:
        man = mf.read_manifest(directory)
    except SproutError as exc:
        return [str(exc)], notes
    failures: list[str] = []
    for p in sorted(directory.iterdir()):
        if p.suffix in TOKEN_SUFFIXES:
            _passes(failures, check_listed, p, man)
    eot = man["tokenizer"]["eot_id"]
    digests: dict = {}
    for kind in ("bin", "hdf5"):
        val_scan = _Scan(eot)
        for split in ("val", "train"):  # val first: train is then checked against its documents
            scan = val_scan if split == "val" else _Scan(eot, val_docs=val_scan.docs)
            entries = man["shards"].get(split, []) if kind == "bin" else [man["hdf5"][split]] if split in man["hdf5"] else []
            if not entries:
                continue
            for entry in entries:
                path = directory / entry["file"]
                if _passes(failures, check_file, path, entry, man):
                    _passes(failures, check_content, path, entry, man, "full")
                    for block in token_blocks(path):
                        scan.feed(block)
            first = directory / entries[0]["file"]
            _check_split(first, split, kind, man, scan, failures, notes)
            digests.setdefault(split, {})[kind] = (first, scan.sha.hexdigest())
    for split, by_kind in digests.items():
        if len(by_kind) == 2 and by_kind["bin"][1] != by_kind["hdf5"][1]:
            failures.append(f"{by_kind['hdf5'][0]}: holds different {split} tokens than the .bin shards")
    _check_sidecar(directory, man, failures)
    return failures, notes


def _check_split(first: Path, split: str, kind: str, man: dict, scan: _Scan, failures: list[str], notes: list[str]) -> None:
    want = man["splits"].get(split, {}).get("tokens")
    if want is not None and scan.tokens != want:
        failures.append(f"{first}: {split} {kind} output holds {scan.tokens:,} tokens, manifest splits.{split} says {want:,}")
    if scan.tokens and scan.eots == 0:
        failures.append(f"{first}: {split} {kind} output has no end-of-text token (id {scan.eot}); eot rate is 0")
    elif scan.tokens and scan.last != scan.eot:
        failures.append(f"{first}: {split} {kind} output does not end with end-of-text (truncated document)")
    if scan.overlaps:
        failures.append(f"{first}: {scan.overlaps:,} {split} document(s) also occur in the val {kind} output (train/val overlap)")
    if scan.tokens:
        rate = scan.eots / scan.tokens
        notes.append(f"{split} {kind}: {scan.tokens:,} tokens, {scan.eots:,} documents, eot rate {rate:.4f}")


def _check_sidecar(directory: Path, man: dict, failures: list[str]) -> None:
    path = directory / man["doc_hashes"].get("file", mf.SIDECAR)
    if not path.is_file():
        failures.append(f"{path}: document-hash sidecar missing")
        return
    if sha256_file(path) != man["doc_hashes"].get("sha256"):
        failures.append(f"{path}: sha256 does not match the manifest (corrupted)")
        return
    with np.load(path) as data:
        train, val = (np.ascontiguousarray(data[k]).view(np.dtype("V16")).ravel() for k in ("train", "val"))
    both = int(np.isin(val, train).sum())
    if both:
        failures.append(f"{path}: {both:,} document key(s) are in both train and val (train/val overlap)")
