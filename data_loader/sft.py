"""Batches of packed SFT rows (`sprout.formats.sft`) for the trainer.

Each batch is a dict of torch tensors, shifted by one for next-token prediction (row r of the file):

    input_ids     tokens[r, :-1]        int64 (B, L-1)
    targets       tokens[r, 1:]         int64
    loss_mask     loss_mask[r, 1:]      bool  (True = this target is trained)
    segment_ids   segment_ids[r, :-1]   int64 (attention only within a segment; 0 = padding)
    position_ids  position_ids[r, :-1]  int64 (rotary positions, restart per document)

Training order: epoch e visits all rows in the permutation drawn from
`numpy.random.default_rng([seed, e])`. With `world_size` W and per-rank `batch_size` B,
step s of an epoch uses permuted rows [s*W*B, (s+1)*W*B), of which rank k takes the k-th
block of B, so ranks never share a row; the tail that does not fill W*B rows is skipped
(it comes first in another epoch's permutation). The state dict (epoch, step) gives an
exact resume, and is the same on every rank; since the order depends only on the global
batch W*B, a run may resume with another W for the same global batch.

`eval_batches()` walks the rows in file order once, rank k taking rows k, k+W, k+2W, ...,
the last batch possibly smaller.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from sprout.errors import SproutError
from sprout.formats.sft import SFTFile


def shift(arrays: dict) -> dict:
    """The model-facing batch from (B, L) numpy rows (see the module docstring)."""
    as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a).astype(np.int64))  # noqa: E731
    return {
        "input_ids": as_long(arrays["tokens"][:, :-1]),
        "targets": as_long(arrays["tokens"][:, 1:]),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(arrays["loss_mask"][:, 1:]) != 0),
        "segment_ids": as_long(arrays["segment_ids"][:, :-1]),
        "position_ids": as_long(arrays["position_ids"][:, :-1]),
    }


class SFTLoader:
    """Shuffled, rank-sliced, resumable batches over one packed SFT file."""

    def __init__(self, path, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True):
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size/rank/world_size: {batch_size}/{rank}/{world_size}")
        self.file = SFTFile(path)
        self.path = self.file.path
        self.attrs = self.file.attrs
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.shuffle = shuffle
        self.num_rows = self.file.num_rows
        self.steps_per_epoch = self.num_rows // (batch_size * world_size)
        self.epoch, self.step = 0, 0
        self._perm_epoch, self._perm = None, None

    @property
    def seq_len(self) -> int:
        return self.file.seq_len

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.num_rows) if self.shuffle else np.arange(self.num_rows)
            self._perm_epoch = epoch
        return self._perm

    def rows_for(self, epoch: int, step: int) -> np.ndarray:
        """The file rows this rank reads at (epoch, step)."""
        g = self.batch_size * self.world_size
        start = step * g + self.rank * self.batch_size
        return self._order(epoch)[start:start + self.batch_size]

    def next_batch(self) -> dict:
        if self.steps_per_epoch == 0:
            raise SproutError(f"{self.path}: {self.num_rows} rows cannot fill one global batch of "
                              f"{self.batch_size} x {self.world_size} ranks")
        rows = self.rows_for(self.epoch, self.step)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return shift(self.file.read(rows))

    def __iter__(self) -> Iterator[dict]:
        while True:
            yield self.next_batch()

    def eval_batches(self) -> Iterator[dict]:
        rows = np.arange(self.rank, self.num_rows, self.world_size)
        for i in range(0, len(rows), self.batch_size):
            yield shift(self.file.read(rows[i:i + self.batch_size]))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "num_rows": self.num_rows,
                "global_batch": self.global_batch}

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_rows", "global_batch"):
            if state.get(key) != getattr(self, key):
                raise SproutError(f"{self.path}: cannot resume: saved loader {key}={state.get(key)} "
                                  f"but this run has {getattr(self, key)}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    def close(self) -> None:
        self.file.close()
