"""The packed-SFT HDF5 contract: `sft.h5` (train) and `sft_val.h5` (val) beside it, written
atomically and renamed into place together (`write_sft_files`); `SFTFile` reads one and refuses
anything else, naming the file (its docstring lists the datasets and attributes).

A row holds whole examples (`sprout.chat.render`) packed best fit (`sprout.prep.packing`), never
cut across rows (an over-long one is truncated at the row end or dropped), then padding.
loss_mask is 0 on role headers, system and user text, a BOS, the text after an eot (chatml's
newline) and padding. Models read row r as inputs `tokens[r, :-1]`, targets `tokens[r, 1:]`,
loss mask `loss_mask[r, 1:]`, with `segment_ids[r, :-1]` (attention never crosses an example)
and `position_ids[r, :-1]` (rotary positions). `prep_run_id` (`run_id_of`), the same in both
files of a pair, is the first 32 hex digits of the sha256 of the config, command and every
dataset's sha256 of both files, so a pair from two prep runs, or a file changed after prep, is
told apart (`sprout.formats.verify_inputs`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np

from sprout.atomic import AtomicH5
from sprout.errors import SproutError
from sprout.tokenizer_files import Record

FORMAT = "sprout-sft"
FORMAT_VERSION = 1
DATASETS = {"tokens": None, "loss_mask": np.dtype("uint8"),
            "segment_ids": np.dtype("uint16"), "position_ids": np.dtype("uint16")}
TOKEN_DTYPES = (np.dtype("uint16"), np.dtype("uint32"))
REQUIRED_ATTRS = ("format", "format_version", "split", "seq_len", "num_rows", "tokenizer_spec",
                  "tokenizer_name", "tokenizer_fingerprint", "vocab_size", "eot_id", "pad_id",
                  "template_version", "template", "counts", "sha256")
JSON_ATTRS = ("template", "counts", "config", "sha256", "held_out", "tokenizer_side_sha256")
CHUNK_ROWS = 64


class SFTFormatError(SproutError):
    """A file that does not follow the SFT contract; the message names the file."""


def conversation_spans(segment_ids) -> list[tuple[int, int]]:
    """[start, end) of each conversation packed in one row, from its segment ids (1, 2, ... k,
    then 0 on padding); a span that ends at the row's end may be cut short there."""
    seg = np.asarray(segment_ids)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]]).tolist()
    return [(a, b) for a, b in zip(starts, starts[1:] + [len(seg)]) if seg[a] != 0]


def val_path(path: str | os.PathLike) -> Path:
    """`runs/x/sft.h5` -> `runs/x/sft_val.h5`."""
    path = Path(path)
    return path.with_name(f"{path.stem}_val{path.suffix}")


def _sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _fill(f, arrays: dict, attrs: dict) -> None:
    shape = arrays["tokens"].shape
    if len(shape) != 2 or any(arrays[k].shape != shape for k in DATASETS):
        raise ValueError(f"all SFT arrays must share one (N, L) shape, got {[arrays[k].shape for k in DATASETS]}")
    attrs = {**attrs, "format": FORMAT, "format_version": FORMAT_VERSION, "num_rows": shape[0],
             "seq_len": shape[1], "sha256": {k: _sha256(arrays[k]) for k in DATASETS}}
    for name in DATASETS:
        f.create_dataset(name, data=arrays[name], chunks=(min(CHUNK_ROWS, max(shape[0], 1)), shape[1]),
                         maxshape=(None, shape[1]), fletcher32=True)
    for key, value in attrs.items():
        if value is None:
            continue
        f.attrs[key] = json.dumps(value) if key in JSON_ATTRS else value


def write_sft(path, arrays: dict, attrs: dict) -> None:
    """Atomically write the four (N, L) arrays and `attrs` (dicts are stored as JSON)."""
    write_sft_files([(path, arrays, attrs)])


def run_id_of(files: list[tuple[dict, dict]]) -> str:
    """The `prep_run_id` of files written together, `(attrs, {dataset: sha256})` each: the first
    32 hex digits of the sha256 of each file's config, command and split and of every dataset's
    sha256. The same inputs give the same id (the files' bytes stay reproducible); a reader
    recomputes it from what the files record (`sprout.formats.verify_inputs.verify_sft_pair`)."""
    h = hashlib.sha256()
    for attrs, digests in files:
        h.update(json.dumps([attrs.get(k) for k in ("config", "command", "split")], sort_keys=True, default=str).encode())
        for name in DATASETS:
            h.update(str(digests.get(name)).encode())
    return h.hexdigest()[:32]


def pair_run_id(files: list[tuple]) -> str:
    """`run_id_of` files about to be written, `(path, arrays, attrs)` each."""
    return run_id_of([(attrs, {name: _sha256(arrays[name]) for name in DATASETS}) for _, arrays, attrs in files])


def write_sft_files(files: list[tuple]) -> None:
    """Write several SFT files, `(path, arrays, attrs)` each, renaming them into place only
    once all are written, so a failure (a full disk) leaves every earlier file as it was.
    Every file gets the same `prep_run_id` (`pair_run_id`)."""
    outs = []
    run_id = pair_run_id(files)
    try:
        for path, arrays, attrs in files:
            outs.append(AtomicH5(path))
            _fill(outs[-1].file, arrays, {**attrs, "prep_run_id": run_id})
            outs[-1].check()
        for out in outs:
            out.file.close()
            out.check()
    except BaseException:
        for out in outs:
            out.abort()
        raise
    for out in outs:
        out.commit()


class SFTFile:
    """Read-only, validated view of one SFT file. Use as a context manager or `close()`.

    Datasets, all (N, L) with L = `seq_len`, chunked by rows and fletcher32-checksummed (a
    flipped byte fails on read):
        tokens        uint16 (vocab <= 65,536) | uint32   packed ids, `pad_id` in padding
        loss_mask     uint8 0/1   1 = a training target (assistant content and the eot closing it)
        segment_ids   uint16      1..k for the row's k documents, 0 on padding
        position_ids  uint16      0.. within each document (restart per document), 0 on padding
    Attributes: format "sprout-sft", format_version 1, split ("train"|"val"), seq_len, num_rows,
    tokenizer_spec, tokenizer_name, tokenizer_fingerprint (the sha256 of the tokenizer's file),
    vocab_size, eot_id, pad_id, template_version (e.g. `sprout-chat-v1`), command, prep_run_id;
    as JSON: tokenizer_side_sha256 (of an hf: tokenizer's side files,
    `sprout.tokenizer_files.side_files_sha256`; absent for the other kinds and in hf: files of an
    earlier version; `tokenizer_record`), template (role
    header ids, eot; for other chat formats also the format, the ids after each eot and the BOS),
    counts (per-source reads, drops by reason, dedup, split, packing totals), config (the
    resolved prep config), held_out (the held-out sets the prep excluded, `sprout.prep.held_out`;
    the SFT stage refuses a file without it), sha256 (per dataset over its C-order bytes:
    `SFTFile.verify`, `check_hashes`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise SFTFormatError(f"{self.path}: SFT file not found")
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as exc:
            raise SFTFormatError(f"{self.path}: not a readable HDF5 file ({exc})") from None
        try:
            self.attrs = self._read_attrs()
            self._check_datasets()
        except BaseException:
            self._f.close()
            raise

    def _fail(self, what: str):
        raise SFTFormatError(f"{self.path}: {what}")

    def _read_attrs(self) -> dict:
        raw = dict(self._f.attrs)
        missing = [k for k in REQUIRED_ATTRS if k not in raw]
        if raw.get("format") != FORMAT:
            self._fail(f"not a sprout SFT file (format attr {raw.get('format')!r}, expected {FORMAT!r})")
        if raw.get("format_version") != FORMAT_VERSION:
            self._fail(f"unsupported SFT format version {raw.get('format_version')!r} (expected {FORMAT_VERSION})")
        if missing:
            self._fail(f"missing attribute(s) {', '.join(missing)}")
        attrs = {}
        for key, value in raw.items():
            if isinstance(value, bytes):
                value = value.decode()
            if isinstance(value, np.generic):
                value = value.item()
            if key in JSON_ATTRS:
                try:
                    value = json.loads(value)
                except (TypeError, json.JSONDecodeError):
                    self._fail(f"attribute {key} is not valid JSON")
            attrs[key] = value
        return attrs

    def _check_datasets(self) -> None:
        n, length = self.attrs["num_rows"], self.attrs["seq_len"]
        for name, dtype in DATASETS.items():
            if name not in self._f or not isinstance(self._f[name], h5py.Dataset):
                self._fail(f"missing dataset {name!r}")
            ds = self._f[name]
            if ds.shape != (n, length):
                self._fail(f"dataset {name} has shape {ds.shape}, expected ({n}, {length}) from the attributes")
            ok = ds.dtype in TOKEN_DTYPES if dtype is None else ds.dtype == dtype
            if not ok:
                self._fail(f"dataset {name} has dtype {ds.dtype}, expected {dtype or 'uint16/uint32'}")

    @property
    def num_rows(self) -> int:
        return self.attrs["num_rows"]

    @property
    def seq_len(self) -> int:
        return self.attrs["seq_len"]

    def read(self, rows=None) -> dict:
        """The four arrays for `rows` (any order, repeats allowed; None = all rows)."""
        out = {}
        try:
            if rows is None:
                return {name: self._f[name][()] for name in DATASETS}
            rows = np.asarray(rows, dtype=np.int64)
            uniq, inverse = np.unique(rows, return_inverse=True)  # h5py wants increasing indices
            for name in DATASETS:
                ds = self._f[name]
                out[name] = ds[uniq][inverse] if uniq.size else np.zeros((0, self.seq_len), ds.dtype)
        except OSError as exc:  # fletcher32 mismatch, truncated file
            raise SFTFormatError(f"{self.path}: corrupted data ({exc})") from None
        return out

    def verify(self) -> dict:
        """Read everything and compare with the stored sha256 per dataset; returns the arrays."""
        arrays = self.read()
        for name in DATASETS:
            if _sha256(arrays[name]) != self.attrs["sha256"].get(name):
                self._fail(f"dataset {name} does not match its stored sha256 (corrupted or edited)")
        return arrays

    def _rows(self, names, start: int, stop: int) -> dict:
        try:
            return {name: np.ascontiguousarray(self._f[name][start:stop]) for name in names}
        except OSError as exc:  # fletcher32 mismatch, truncated file
            raise SFTFormatError(f"{self.path}: corrupted data ({exc})") from None

    def blocks(self, names=tuple(DATASETS), block_rows: int = 4096) -> Iterator[tuple[int, dict]]:
        """(first row, {name: rows}) for consecutive blocks of `block_rows` rows of the datasets
        `names` (memory stays flat)."""
        for start in range(0, self.num_rows, block_rows):
            yield start, self._rows(names, start, start + block_rows)

    def check_hashes(self, block_rows: int = 4096, progress=None, each_block=None) -> None:
        """Compare each dataset with its stored sha256, reading `block_rows` rows at a time;
        `progress(nbytes)` is called after each block, and `each_block(first_row, arrays)` with
        it when given (checks that ride on the same read)."""
        hashes = {name: hashlib.sha256() for name in DATASETS}
        for start, block in self.blocks(block_rows=block_rows):
            for name, rows in block.items():
                hashes[name].update(rows.tobytes())
                if progress is not None:
                    progress(rows.nbytes)
            if each_block is not None:
                each_block(start, block)
        for name, h in hashes.items():
            if h.hexdigest() != self.attrs["sha256"].get(name):
                self._fail(f"dataset {name} does not match its stored sha256 (corrupted or edited)")

    def rows_without_targets(self, block_rows: int = 4096) -> np.ndarray:
        """The rows whose loss mask trains no target (`loss_mask[r, 1:]` all 0), read `block_rows`
        rows at a time. Prep packs only examples with a trained token, so such a row is an edit."""
        ds, found = self._f["loss_mask"], []
        try:
            for start in range(0, self.num_rows, block_rows):
                block = ds[start : start + block_rows, 1:]
                found.append(start + np.flatnonzero(~block.any(axis=1)))
        except OSError as exc:  # fletcher32 mismatch, truncated file
            raise SFTFormatError(f"{self.path}: corrupted data ({exc})") from None
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def tokenizer_record(self) -> Record:
        """What the prep recorded of its tokenizer's files, which a trainer compares with the files
        now (`sprout.tokenizer_files.load_recorded`)."""
        sides = self.attrs.get("tokenizer_side_sha256")
        if sides is not None and not isinstance(sides, dict):
            self._fail("attribute tokenizer_side_sha256 is not an object of sha256 strings")
        return Record(self.attrs["tokenizer_fingerprint"], sides, str(self.path),
                      ("tokenizer_fingerprint", "tokenizer_side_sha256"))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "SFTFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
