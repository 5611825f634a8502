"""Verify a folder of pretraining tokens against its manifest (`scripts/verify_shards.py DIR`).

Checks, each failure reported as one line naming the file:
- the manifest is valid, and every .bin/.h5 file in the folder is listed in it;
- each .bin shard: header magic and version, file size against the token count
  (`sprout.formats.shards.read_header`), the dtype the manifest names, the token count and sha256
  the manifest lists; each .h5 file: the `sprout.formats.h5tokens` contract, sha256, attributes;
- every id is below the vocab size; end-of-text occurs (rate > 0) and ends each split;
- when both formats are present, the .bin shards and the .h5 file hold the same tokens;
- zero train/val overlap, twice: the documents found between end-of-text tokens in the val
  output never occur in the train output (an independent check on the tokens themselves),
  and the sidecar of dedup keys (`doc_hashes.npz`) holds no key in both splits.

What a trainer checks of its inputs at start is the part of this that proves the files are the
ones prep wrote: `sprout.formats.verify_data`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sprout.formats import manifest as mf
from sprout.atomic import sha256_file
from sprout.errors import SproutError
from sprout.formats.h5tokens import open_tokens_h5
from sprout.formats.shards import open_shard, read_header
from sprout.formats.verify_data import BLOCK


@dataclass
class _Scan:
    """Running per-split statistics over a token stream that may span several files."""

    eot: int
    vocab: int
    val_docs: set | None = None  # when scanning train: the val document hashes to look for
    docs: set = field(default_factory=set)
    tokens: int = 0
    eots: int = 0
    overlaps: int = 0
    last: int | None = None
    sha: object = field(default_factory=hashlib.sha256)  # of the ids, to compare bin with hdf5
    _carry: list = field(default_factory=list)

    def feed(self, arr: np.ndarray, where: str, failures: list[str]) -> None:
        if len(arr) == 0:
            return
        top = int(arr.max())
        if top >= self.vocab:
            bad = int(np.flatnonzero(arr >= self.vocab)[0])
            failures.append(f"{where}: token id {int(arr[bad])} at position {self.tokens + bad:,} is >= vocab size {self.vocab:,}")
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


def verify_dir(directory: str | Path) -> tuple[list[str], list[str]]:
    """(failures, notes). No failures means every check held."""
    directory = Path(directory)
    failures: list[str] = []
    notes: list[str] = []
    try:
        man = mf.read_manifest(directory)
    except SproutError as exc:
        return [str(exc)], notes
    tok = man["tokenizer"]
    vocab, eot, dtype = tok["vocab_size"], tok["eot_id"], np.dtype(man["token_dtype"])
    listed = {e["file"] for entries in man["shards"].values() for e in entries} | {e["file"] for e in man["hdf5"].values()}
    for p in sorted(directory.iterdir()):
        if p.suffix in (".bin", ".h5") and p.name not in listed:
            failures.append(f"{p}: not listed in {directory / mf.MANIFEST} (another dataset's or a stale file)")

    digests: dict = {}
    for kind in ("bin", "hdf5"):
        val_scan = _Scan(eot, vocab)
        for split in ("val", "train"):  # val first: train is then checked against its documents
            scan = val_scan if split == "val" else _Scan(eot, vocab, val_docs=val_scan.docs)
            entries = man["shards"].get(split, []) if kind == "bin" else [man["hdf5"][split]] if split in man["hdf5"] else []
            if not entries:
                continue
            for entry in entries:
                check = _check_bin if kind == "bin" else _check_h5
                check(directory / entry["file"], entry, man, dtype, scan, failures)
            first = directory / entries[0]["file"]
            _check_split(first, split, kind, man, scan, failures, notes)
            digests.setdefault(split, {})[kind] = (first, scan.sha.hexdigest())
    for split, by_kind in digests.items():
        if len(by_kind) == 2 and by_kind["bin"][1] != by_kind["hdf5"][1]:
            failures.append(f"{by_kind['hdf5'][0]}: holds different {split} tokens than the .bin shards")
    _check_sidecar(directory, man, failures)
    return failures, notes


def _check_bin(path: Path, entry: dict, man: dict, dtype: np.dtype, scan: _Scan, failures: list[str]) -> None:
    try:
        header = read_header(path)
    except SproutError as exc:
        failures.append(str(exc))
        return
    if header.dtype != dtype:
        failures.append(f"{path}: shard holds {header.dtype.name} ids but the manifest says {dtype.name}")
    if header.num_tokens != entry["num_tokens"]:
        failures.append(f"{path}: header says {header.num_tokens:,} tokens, manifest says {entry['num_tokens']:,}")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        failures.append(f"{path}: sha256 {digest[:16]}… does not match the manifest's {entry['sha256'][:16]}… (corrupted)")
    tokens = open_shard(path)
    for start in range(0, len(tokens), BLOCK):
        scan.feed(np.asarray(tokens[start : start + BLOCK]), str(path), failures)


def _check_h5(path: Path, entry: dict, man: dict, dtype: np.dtype, scan: _Scan, failures: list[str]) -> None:
    try:
        h5 = open_tokens_h5(path)
    except SproutError as exc:
        failures.append(str(exc))
        return
    try:
        if h5.tokens.dtype != dtype:
            failures.append(f"{path}: holds {h5.tokens.dtype.name} ids but the manifest says {dtype.name}")
        tok = man["tokenizer"]
        for attr, want in (("vocab_size", tok["vocab_size"]), ("eot_id", tok["eot_id"]),
                           ("tokenizer_fingerprint", tok["fingerprint"]), ("num_tokens", entry["num_tokens"])):
            if h5.attrs.get(attr) != want:
                failures.append(f"{path}: attribute {attr}={h5.attrs.get(attr)!r} but the manifest says {want!r}")
        sha = hashlib.sha256()
        for block in h5.iter_blocks(BLOCK):
            sha.update(block.astype(dtype.newbyteorder("<"), copy=False).tobytes())
            scan.feed(block, str(path), failures)
        if sha.hexdigest() != h5.attrs["tokens_sha256"]:
            failures.append(f"{path}: tokens do not match their tokens_sha256 attribute (corrupted)")
    finally:
        h5.close()
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        failures.append(f"{path}: sha256 {digest[:16]}… does not match the manifest's {entry['sha256'][:16]}… (corrupted)")


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
