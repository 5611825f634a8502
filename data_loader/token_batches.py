"""Token loaders for pretraining over 1-D token arrays: the memmaps of `.bin` shards
(`sprout.formats.shards`) or the `tokens` dataset of an HDF5 file (`sprout.formats.h5tokens`).

- `TokenStream`: the sources in order, wrapping from the last back to the first
  (parameter-golf's TokenStream). No randomness.
- `DistributedTokenLoader`: each call takes one contiguous chunk of `world * (rows*T + 1)` tokens
  from the stream and gives rank r its r-th span (parameter-golf's), so micro-step a of rank r
  reads chunk a*world + r: 1 process with 2 micro-steps sees exactly the tokens of 2 with 1.
- `RandomWindowSampler`: nanoGPT's `get_batch`: windows of T+1 tokens at uniformly random offsets
  from a seeded generator shared by all ranks, each rank keeping its slice of the global draw.
Loaders return int64 torch tensors `(inputs, targets)` of shape [rows, T], targets shifted by
one; `state_dict()` (shard, offset, RNG state), kept in a checkpoint's meta.json, and
`load_state_dict()` resume exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from sprout.errors import SproutError
from sprout.formats.shards import list_shards, open_shard

TokenSource = Sequence[int]  # anything 1-D with len() and slicing: np.memmap, h5py.Dataset


def open_h5_tokens(path: str | os.PathLike):
    """The validated 1-D `tokens` dataset of a pretraining HDF5 file (`sprout.formats.h5tokens`)."""
    from sprout.formats.h5tokens import open_tokens

    return open_tokens(path)


def open_token_sources(path: str | os.PathLike, split: str) -> list[TokenSource]:
    """The token arrays of one split: `.bin` shards in a folder, or an HDF5 file.

    For HDF5, `path` is the training file `<dataset>_train.h5`; the other split is read
    from its sibling `<dataset>_<split>.h5` (the `sprout.formats.h5tokens` naming).
    """
    path = Path(path)
    if path.suffix in (".h5", ".hdf5"):
        if not path.name.endswith(f"_train{path.suffix}"):
            raise SproutError(f"{path}: expected an HDF5 training file named <dataset>_train{path.suffix}")
        return [open_h5_tokens(path.with_name(path.name[: -len(f"train{path.suffix}")] + split + path.suffix))]
    shards = list_shards(path, split)
    if not shards:
        raise SproutError(f"{path}: no {split} shards (*_{split}_NNNNNN.bin) in this folder")
    return [open_shard(p) for p in shards]


def read_tokens(sources: Sequence[TokenSource], max_tokens: int | None = None) -> np.ndarray:
    """The first `max_tokens` tokens of the concatenated sources, as int64 (for eval sets)."""
    parts, left = [], max_tokens if max_tokens is not None else sum(len(s) for s in sources)
    for src in sources:
        if left <= 0:
            break
        part = np.asarray(src[: min(left, len(src))])
        parts.append(part)
        left -= len(part)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _rows(span: np.ndarray, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A span of rows*T + 1 tokens -> (inputs, targets), each [rows, T]."""
    t = torch.from_numpy(span.astype(np.int64, copy=False))
    return t[:-1].view(rows, seq_len), t[1:].view(rows, seq_len)


class TokenStream:
    """The sources read in order, wrapping around forever; position = (shard, offset)."""

    def __init__(self, sources: Sequence[TokenSource]):
        self.sources = [s for s in sources if len(s) > 0]
        if not self.sources:
            raise SproutError("token stream has no tokens (all sources are empty)")
        self.shard, self.offset = 0, 0

    def _advance(self, n: int, keep: bool) -> list[np.ndarray]:
        parts = []
        while n > 0:
            src = self.sources[self.shard]
            k = min(n, len(src) - self.offset)
            if keep:
                parts.append(np.asarray(src[self.offset : self.offset + k]))
            self.offset += k
            n -= k
            if self.offset == len(src):
                self.shard, self.offset = (self.shard + 1) % len(self.sources), 0
        return parts

    def take(self, n: int) -> np.ndarray:
        """The next n tokens (int64), crossing and wrapping shard boundaries as needed."""
        return np.concatenate(self._advance(n, keep=True)).astype(np.int64)

    def skip(self, n: int) -> None:
        """Advance n tokens without reading them."""
        self._advance(n, keep=False)

    def state_dict(self) -> dict:
        return {"shard": self.shard, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        shard, offset = int(state["shard"]), int(state["offset"])
        if not (0 <= shard < len(self.sources) and 0 <= offset < len(self.sources[shard])):
            raise SproutError(f"loader state {state} does not fit this data ({len(self.sources)} shards)")
        self.shard, self.offset = shard, offset


class DistributedTokenLoader:
    """Per-rank disjoint spans of one shared stream (as parameter-golf's DistributedTokenLoader)."""

    kind = "sequential"

    def __init__(self, sources: Sequence[TokenSource], rank: int = 0, world_size: int = 1):
        self.stream = TokenStream(sources)
        self.rank, self.world_size = rank, world_size

    def next_batch(self, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = rows * seq_len + 1
        self.stream.skip(self.rank * span)
        local = self.stream.take(span)
        self.stream.skip((self.world_size - 1 - self.rank) * span)
        return _rows(local, rows, seq_len)

    def state_dict(self) -> dict:
        return {"kind": self.kind, **self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.kind, state)
        self.stream.load_state_dict(state)


class RandomWindowSampler:
    """nanoGPT-style random windows of T+1 tokens, seeded; ranks split each global draw."""

    kind = "random"

    def __init__(self, sources: Sequence[TokenSource], seed: int = 0, rank: int = 0, world_size: int = 1):
        self.sources = [s for s in sources if len(s) > 0]
        self.lengths = np.array([len(s) for s in self.sources], dtype=np.int64)
        self.rank, self.world_size = rank, world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        windows = np.maximum(self.lengths - seq_len, 0)  # start offsets with T+1 tokens left
        if windows.sum() == 0:
            raise SproutError(f"no source holds {seq_len + 1} tokens for one window")
        cum = np.cumsum(windows)
        # random() takes exactly one 64-bit draw per value, so drawing rows twice equals
        # drawing 2*rows once: the windows do not depend on how ranks split the batch.
        u = self.rng.random(self.world_size * rows)[self.rank * rows : (self.rank + 1) * rows]
        flat = np.minimum((u * cum[-1]).astype(np.int64), cum[-1] - 1)
        src_idx = np.searchsorted(cum, flat, side="right")
        starts = flat - (cum[src_idx] - windows[src_idx])
        span = np.stack([np.asarray(self.sources[s][o : o + seq_len + 1]) for s, o in zip(src_idx, starts)])
        t = torch.from_numpy(span.astype(np.int64))
        return t[:, :-1], t[:, 1:]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.kind, state)
        self.rng.bit_generator.state = state["rng"]


def _check_kind(kind: str, state: dict) -> None:
    if state.get("kind", kind) != kind:
        raise SproutError(f"loader state is for a {state.get('kind')!r} loader, this run uses {kind!r}")


def eval_rows(tokens: np.ndarray, seq_len: int, rank: int = 0, world_size: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping eval windows of a token array, this rank's contiguous share of them.

    Row i covers inputs tokens[i*T : (i+1)*T] and targets one to the right; ranks take
    disjoint row ranges, so summing over ranks covers every row exactly once.
    """
    n_rows = max(0, (len(tokens) - 1) // seq_len)
    lo, hi = rank * n_rows // world_size, (rank + 1) * n_rows // world_size
    if hi == lo:
        empty = torch.zeros(0, seq_len, dtype=torch.int64)
        return empty, empty
    return _rows(tokens[lo * seq_len : hi * seq_len + 1], hi - lo, seq_len)
