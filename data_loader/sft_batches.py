"""Batches of packed SFT rows (`sprout.formats.packed_sft`) for the trainer.

Each batch is a dict of torch tensors, shifted by one for next-token prediction (row r of the file):

    input_ids     tokens[r, :-1]        int64 (B, L-1)
    targets       tokens[r, 1:]         int64
    loss_mask     loss_mask[r, 1:]      bool  (True = this target is trained)
    segment_ids   segment_ids[r, :-1]   int64 (attention only within a segment; 0 = padding)
    position_ids  position_ids[r, :-1]  int64 (rotary positions, restart per document)

Training order: `data_loader.order` (seeded per epoch, W*B rows a step, rank k taking the
k-th block of B; the state dict (epoch, step) resumes exactly).

`eval_batches()` walks the rows in file order once, rank k taking rows k, k+W, k+2W, ...,
the last batch possibly smaller.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from data_loader.order import EpochOrder
from sprout.formats.packed_sft import SFTFile


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


class SFTLoader(EpochOrder):
    """Shuffled, rank-sliced, resumable batches over one packed SFT file."""

    def __init__(self, path, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True):
        self.file = SFTFile(path)
        self.attrs, self.batch_size, self.num_rows = self.file.attrs, batch_size, self.file.num_rows
        super().__init__(self.file.path, self.num_rows, batch_size, seed=seed, rank=rank, world_size=world_size,
                         shuffle=shuffle, unit="rows", keys=("step", "num_rows", "global_batch"))

    @property
    def seq_len(self) -> int:
        return self.file.seq_len

    def next_batch(self) -> dict:
        return shift(self.file.read(self.next(f"{self.batch_size} x {self.world_size} ranks")))

    def __iter__(self) -> Iterator[dict]:
        while True:
            yield self.next_batch()

    def eval_batches(self) -> Iterator[dict]:
        rows = np.arange(self.rank, self.num_rows, self.world_size)
        for i in range(0, len(rows), self.batch_size):
            yield shift(self.file.read(rows[i:i + self.batch_size]))

    def close(self) -> None:
        self.file.close()
