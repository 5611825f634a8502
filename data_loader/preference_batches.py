"""Batches of preference pairs (`sprout.formats.preference_pairs`) for reward-model and DPO trainers.

Every pair is rendered once, at construction, by `sprout.formats.preference_tokens` (what
`scripts/check_loss_mask.py` checks) in the tokenizer's chat format (`template_version`); `counts`
says how many (pairs_read, pairs, dropped_too_long, truncated, prompt_turns_dropped). A micro-batch
of B pairs has 2B rows, the chosen sides then the rejected sides of the same pairs in the same
order (pair i is rows i and B+i), right-padded with `pad_id` to its longest row; its tensors are
listed in `PreferenceLoader`'s docstring. Nothing is normalised here. Training order:
`data_loader.order` over the kept pairs. `eval_batches()` walks the pairs in file order once, rank
k taking pairs k, k+W, ...; every rank is padded to ceil(N/W) pairs with copies of pair 0
(`pair_mask` False, loss_mask 0), so every rank runs the same number of forwards (FSDP) and every
pair counts exactly once.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from data_loader.order import EpochOrder
from sprout.chat_formats import format_for
from sprout.errors import SproutError
from sprout.formats.preference_tokens import TRUNCATIONS, tokenize_preferences


class PreferenceLoader(EpochOrder):
    """Shuffled, rank-sliced, resumable micro-batches of preference pairs from one JSONL file.

    A micro-batch of B pairs (T <= seq_len):
        input_ids        int64   (2B, T)  the whole side: prompt, response, its eot, then padding
        targets          int64   (2B, T)  targets[:, t] = input_ids[:, t+1]; the last column is padding
        loss_mask        bool    (2B, T)  True where targets[:, t] is a response token (final assistant
                                          content or the eot closing it); never prompt, header or padding
        attention_mask   bool    (2B, T)  True on real tokens
        segment_ids      int64   (2B, T)  1 on real tokens, 0 on padding
        position_ids     int64   (2B, T)  0, 1, ... over real tokens, 0 on padding
        response_lengths int64   (2B,)    response tokens per row (= loss_mask.sum(1)), eot included
        end_index        int64   (2B,)    index of the eot closing the response, the row's last real
                                          token: a reward model reads its score there
        pair_mask        bool    (B,)     False for the padding pairs of `eval_batches` (count nothing)
        margin           float32 (B,)     the record's margin, 0.0 when it has none
        pair_index       int64   (B,)     the pair's index in `pairs` (file order of the kept pairs)
    """

    def __init__(self, path, tok, batch_size: int, seq_len: int, *, truncation: str = "drop", seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if truncation not in TRUNCATIONS:
            raise SproutError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
        self.seq_len, self.truncation, self.batch_size = seq_len, truncation, batch_size
        self.pad_id = tok.pad_id if tok.pad_id is not None else tok.eot_id
        self.template_version = format_for(tok).version  # the chat format the pairs are rendered in
        found = tokenize_preferences(path, tok, seq_len, truncation)
        self.pairs, self.counts = found.pairs, found.counts
        self.dropped, self.truncated = found.dropped, found.truncated
        self.num_pairs = len(self.pairs)
        if self.num_pairs == 0:
            raise SproutError(f"{path}: no pair fits seq_len {seq_len} "
                              f"({self.counts['pairs_read']} read, {self.counts['dropped_too_long']} too long)")
        self._pack()
        super().__init__(path, self.num_pairs, batch_size, seed=seed, rank=rank, world_size=world_size,
                         shuffle=shuffle, unit="pairs", keys=("step", "num_pairs", "global_batch"))

    def _pack(self) -> None:
        """All 2N sides in one flat array: side j of pair i is row i (chosen) or N + i (rejected)."""
        sides = [p.chosen for p in self.pairs] + [p.rejected for p in self.pairs]
        masks = [p.chosen_mask for p in self.pairs] + [p.rejected_mask for p in self.pairs]
        self._lengths = np.array([len(s) for s in sides], dtype=np.int64)
        self._starts = np.r_[0, np.cumsum(self._lengths)[:-1]].astype(np.int64)
        self._tokens = np.concatenate(sides)
        self._masks = np.concatenate(masks)
        self._margins = np.array([p.margin or 0.0 for p in self.pairs], dtype=np.float32)

    # ---- batches ----------------------------------------------------------------------

    def collate(self, pair_idx: np.ndarray, real: np.ndarray | None = None) -> dict:
        """The micro-batch of these pairs (indices into `pairs`); `real` False marks padding pairs."""
        pair_idx = np.asarray(pair_idx, dtype=np.int64)
        b = len(pair_idx)
        real = np.ones(b, dtype=bool) if real is None else np.asarray(real, dtype=bool)
        rows = np.r_[pair_idx, pair_idx + self.num_pairs]
        lengths = self._lengths[rows]
        width = int(lengths.max())
        col = np.arange(width)
        inside = col[None, :] < lengths[:, None]
        at = np.where(inside, self._starts[rows][:, None] + col[None, :], 0)
        tokens = np.where(inside, self._tokens[at], self.pad_id)
        response = inside & (self._masks[at] != 0) & np.r_[real, real][:, None]
        loss_mask = np.zeros_like(response)
        loss_mask[:, :-1] = response[:, 1:]
        targets = np.full_like(tokens, self.pad_id)
        targets[:, :-1] = tokens[:, 1:]
        return {
            "input_ids": torch.from_numpy(tokens),
            "targets": torch.from_numpy(targets),
            "loss_mask": torch.from_numpy(loss_mask),
            "attention_mask": torch.from_numpy(inside),
            "segment_ids": torch.from_numpy(inside.astype(np.int64)),
            "position_ids": torch.from_numpy(np.where(inside, col[None, :], 0)),
            "response_lengths": torch.from_numpy(response.sum(axis=1).astype(np.int64)),
            "end_index": torch.from_numpy(lengths - 1),
            "pair_mask": torch.from_numpy(real),
            "margin": torch.from_numpy(self._margins[pair_idx]),
            "pair_index": torch.from_numpy(pair_idx),
        }

    def side_lengths(self, pair_idx: np.ndarray) -> np.ndarray:
        """Tokens of each side of these pairs (indices into `pairs`): [n, 2] (chosen, rejected)."""
        pair_idx = np.asarray(pair_idx, dtype=np.int64)
        return np.stack([self._lengths[pair_idx], self._lengths[pair_idx + self.num_pairs]], axis=1)

    def next_batch(self) -> dict:
        return self.collate(self.next(f"{self.batch_size} x {self.world_size} ranks"))

    def __iter__(self) -> Iterator[dict]:
        while True:
            yield self.next_batch()

    def eval_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's eval pairs in file order, padded to ceil(N/W): (indices, real)."""
        per_rank = math.ceil(self.num_pairs / self.world_size)
        slots = self.rank + self.world_size * np.arange(per_rank)
        real = slots < self.num_pairs
        return np.where(real, slots, 0), real

    def eval_batches(self) -> Iterator[dict]:
        idx, real = self.eval_pairs()
        for i in range(0, len(idx), self.batch_size):
            yield self.collate(idx[i:i + self.batch_size], real[i:i + self.batch_size])
