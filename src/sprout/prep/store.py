"""On-disk plumbing for `sprout.prep.pretrain`: spilled per-source documents, streaming split writers
and the document-key sidecar.

Memory in the pipeline must not grow with the input (`benchmarks/prep_throughput.py` measures
peak RSS at 1x and 10x), so everything per token, and everything per document that is not needed at the
moment, lives in temporary files:
- `SourceStore`: one source's tokens, per-document token counts (uint32) and 16-byte dedup
  keys, appended as chunks come back from the workers; read back by positioned reads (a
  memory map would keep every page it touched in this process's RSS).
- `SplitWriter`: .bin shards whose sizes are known up front (header first, payload
  streamed, sha256 on the fly) and/or an HDF5 file, for one split.
- `write_key_sidecar`: `doc_hashes.npz` with each split's keys, streamed source by source.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import zipfile
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np

from sprout.atomic import atomic_write, sha256_file, write_error
from sprout.errors import SproutError
from sprout.formats.h5tokens import H5TokenWriter, h5_name
from sprout.prep.keys import KEY_DTYPE
from sprout.formats.shards import encode_header, shard_name

READ_DOCS = 1 << 16  # documents per block when reading keys back (1 MiB)


class SourceStore:
    """One source's documents, spilled to three temporary files."""

    def __init__(self, tmpdir: Path, index: int, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.paths = {kind: tmpdir / f"source{index}.{kind}" for kind in ("tokens", "lengths", "keys")}
        self._files = {}
        for kind, path in self.paths.items():
            try:
                self._files[kind] = open(path, "wb")
            except OSError as exc:
                raise write_error(path, exc) from None
        self.counts: Counter = Counter()
        self.n_docs = 0
        self._offsets: np.ndarray | None = None

    def append(self, tokens: np.ndarray, lengths: np.ndarray, keys: np.ndarray, counts: Counter) -> None:
        for kind, data in (("tokens", tokens), ("lengths", lengths.astype(np.uint32)),
                           ("keys", np.ascontiguousarray(keys, dtype=np.uint8))):
            try:
                self._files[kind].write(data.tobytes())
            except OSError as exc:
                raise write_error(self.paths[kind], exc) from None
        self.counts.update(counts)
        self.n_docs += len(lengths)

    def finish(self) -> None:
        for kind, f in self._files.items():
            try:
                f.close()
            except OSError as exc:
                raise write_error(self.paths[kind], exc) from None
        self.lengths = np.fromfile(self.paths["lengths"], dtype=np.uint32)

    def key_half(self, half: str) -> np.ndarray:
        """The "hi" or "lo" uint64 half of every document's key, read block by block."""
        out = np.empty(self.n_docs, dtype=np.uint64)
        for start in range(0, self.n_docs, READ_DOCS):
            block = np.fromfile(self.paths["keys"], dtype=KEY_DTYPE, count=min(READ_DOCS, self.n_docs - start),
                                offset=start * KEY_DTYPE.itemsize)
            out[start : start + len(block)] = block[half]
        return out

    def iter_key_rows(self, ids: np.ndarray) -> Iterator[np.ndarray]:
        """Full 16-byte keys (rows of uint8) of documents `ids` (ascending), block by block."""
        bounds = np.searchsorted(ids, np.arange(0, self.n_docs + READ_DOCS, READ_DOCS))
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if lo < hi:
                start = b * READ_DOCS
                block = np.fromfile(self.paths["keys"], dtype=np.uint8, count=min(READ_DOCS, self.n_docs - start) * 16,
                                    offset=start * 16).reshape(-1, 16)
                yield block[ids[lo:hi] - start]

    def key_rows(self, ids: np.ndarray) -> np.ndarray:
        rows = list(self.iter_key_rows(ids))
        return np.concatenate(rows) if rows else np.zeros((0, 16), dtype=np.uint8)

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Tokens of documents `ids`, concatenated: one positioned read per document, straight
        into the output array."""
        if self._offsets is None:
            self._offsets = np.cumsum(self.lengths, dtype=np.int64) - self.lengths
        lens, starts = self.lengths[ids], self._offsets[ids]
        out = np.empty(int(lens.sum()), dtype=self.dtype)
        view, item, pos = memoryview(out).cast("B"), self.dtype.itemsize, 0
        with open(self.paths["tokens"], "rb", buffering=0) as f:
            for start, n in zip(starts.tolist(), lens.tolist()):
                if os.preadv(f.fileno(), [view[pos * item : (pos + n) * item]], start * item) != n * item:
                    raise SproutError(f"{self.paths['tokens']}: temporary token file is shorter than expected")
                pos += n
        return out


class SplitWriter:
    """Streams one split into .bin shards of `shard_tokens` (the last one shorter) and/or one
    HDF5 file. The split's total is known from the plan, so each shard's header is written
    first and its payload streamed after it: memory does not grow with the shard size."""

    def __init__(self, out: Path, dataset: str, split: str, dtype: np.dtype, shard_tokens: int, fmt: str,
                 total_tokens: int) -> None:
        self.out, self.dataset, self.split, self.dtype = out, dataset, split, dtype
        n_shards = -(-total_tokens // shard_tokens) if fmt in ("bin", "both") else 0
        self.sizes = [min(shard_tokens, total_tokens - i * shard_tokens) for i in range(n_shards)]
        self.shards: list[dict] = []
        self._ctx = self._file = self._sha = None
        self._left = 0
        self.h5 = H5TokenWriter(out / h5_name(dataset, split), dtype) if fmt in ("hdf5", "both") else None
        self.num_tokens, self.max_token_id = 0, -1

    def write(self, tokens: np.ndarray) -> None:
        self.num_tokens += len(tokens)
        if len(tokens):
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        if self.h5 is not None:
            self.h5.append(tokens)
        while self.sizes and len(tokens):
            if self._file is None:
                self._open_shard()
            take = min(len(tokens), self._left)
            payload = tokens[:take].astype(self.dtype, copy=False).tobytes()
            try:
                self._file.write(payload)
            except OSError as exc:
                raise write_error(self.out / self.shards[-1]["file"], exc) from None
            self._sha.update(payload)
            if take:
                self.shards[-1]["max_token_id"] = max(self.shards[-1]["max_token_id"], int(tokens[:take].max()))
            self._left -= take
            tokens = tokens[take:]
            if self._left == 0:
                self._ctx.__exit__(None, None, None)  # fsync + rename into place
                self.shards[-1]["sha256"] = self._sha.hexdigest()
                self._ctx = self._file = None

    def _open_shard(self) -> None:
        index = len(self.shards)
        if index >= len(self.sizes):
            raise RuntimeError(f"{self.split}: more tokens than planned")
        name = shard_name(self.dataset, self.split, index)
        self._left = self.sizes[index]
        self._ctx = atomic_write(self.out / name, "wb")
        self._file = self._ctx.__enter__()
        header = encode_header(self._left, self.dtype)
        try:
            self._file.write(header)
        except OSError as exc:
            raise write_error(self.out / name, exc) from None
        self._sha = hashlib.sha256(header)
        self.shards.append({"file": name, "num_tokens": self._left, "sha256": None, "max_token_id": -1})

    def close(self, attrs: dict) -> tuple[list, dict | None]:
        """Finish; returns (shard entries, HDF5 entry or None) for the manifest."""
        if self._file is not None or len(self.shards) != len(self.sizes):
            raise RuntimeError(f"{self.split}: fewer tokens than planned")
        h5 = None
        if self.h5 is not None:
            tokens_sha = self.h5.close(dict(attrs, split=self.split))
            path = self.out / h5_name(self.dataset, self.split)
            h5 = {"file": path.name, "num_tokens": self.num_tokens, "sha256": sha256_file(path),
                  "tokens_sha256": tokens_sha, "max_token_id": self.max_token_id}
        return self.shards, h5

    def abort(self) -> None:
        if self._ctx is not None:
            with contextlib.suppress(Exception):  # the write error itself is already on its way up
                self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)  # removes the temp file
        if self.h5 is not None:
            self.h5.abort()


def write_key_sidecar(path: Path, stores: list[SourceStore], splits: dict[str, list[np.ndarray]]) -> None:
    """`doc_hashes.npz`: one (N, 16) uint8 array per split, the keys of its documents
    (`splits[split][source]`: ascending document ids), streamed block by block into the
    archive; np.load reads it as usual."""
    with atomic_write(path, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
        for split, ids_per_source in splits.items():
            n = sum(len(ids) for ids in ids_per_source)
            info = zipfile.ZipInfo(f"{split}.npy", date_time=(1980, 1, 1, 0, 0, 0))  # no clock: same bytes every run
            with zf.open(info, "w", force_zip64=True) as member:
                header = {"descr": "|u1", "fortran_order": False, "shape": (n, 16)}
                np.lib.format.write_array_header_1_0(member, header)
                for store, ids in zip(stores, ids_per_source):
                    for rows in store.iter_key_rows(ids):
                        member.write(rows.tobytes())
