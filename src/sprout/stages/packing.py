"""Padding-free forwards and token-budget micro-batches of the post-training stages (DPO, reward, PPO, GRPO).

`PackedRows(mask)` lays a padded micro-batch's sequences (each row's real tokens one contiguous
span) into rows no wider than the longest sequence, with segment and position ids per sequence,
so through the model's segment-masked attention each sequence computes what it computes alone;
`unpack` puts each value back where the padded batch has it, so per-sequence sums add the same
terms in the same order. `loss_forward` computes logits at a batch's loss positions alone,
padded or packed, in the padded batch's order. The loss maths stay in `sprout.losses`.

`budget_slices` cuts a process's units (pairs, completions) of one optimizer step into
micro-batches of at most `max_units`, or within a token budget (`batch.micro_batch_tokens`).
Invariant: every process runs as many micro-batches (gradient sync and FSDP forwards are
collectives): all take the largest count, a process with fewer halving its largest micro-batch.
The loss normaliser is untouched: the loop divides by the whole global batch's targets.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from sprout.errors import SproutError
from sprout.losses.tokens import loss_positions
from sprout.model.heads import padding_inputs


class PackedRows:
    """The packed layout of the padded micro-batch whose real tokens `mask` [S, T] marks (module doc)."""

    def __init__(self, mask: torch.Tensor):
        m = mask.bool()
        S, T = m.shape
        lengths = m.sum(dim=1).cpu().numpy()
        first = m.int().argmax(dim=1)  # each sequence's first column (0 for an empty one)
        last = T - 1 - m.flip(1).int().argmax(dim=1)
        if bool(((last - first + 1).cpu().numpy() != lengths)[lengths > 0].any()):
            raise ValueError("PackedRows: a row's real tokens are not one contiguous span")
        W = max(1, int(lengths.max()))
        free: list[int] = []           # tokens left in each row
        row, start, segment = (np.zeros(S, dtype=np.int64) for _ in range(3))  # each sequence's place
        for i in np.argsort(-lengths, kind="stable"):
            r = next((r for r, f in enumerate(free) if f >= lengths[i]), len(free))
            if r == len(free):
                free.append(W)
            row[i], start[i], free[r] = r, W - free[r], free[r] - lengths[i]
        for r in range(len(free)):  # 1, 2, ... in placement (column) order within each row
            members = np.flatnonzero(row == r)
            segment[members[np.argsort(start[members], kind="stable")]] = np.arange(1, len(members) + 1)
        dev = mask.device
        offset = torch.arange(T, device=dev)[None, :] - first[:, None]  # position within its sequence
        dest = torch.as_tensor(row * W + start, device=dev)[:, None] + offset
        self.mask, self.rows, self.width = m, len(free), W
        self.index = torch.where(m, dest, torch.zeros((), dtype=dest.dtype, device=dev))  # [S, T] into R * W
        self.flat = dest[m]                     # the packed place of each real token, in the padded order
        self.segment_ids = self.pack(torch.as_tensor(segment, device=dev)[:, None].expand(S, T))
        self.position_ids = self.pack(offset)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, T, ...] of the padded batch as [R, W, ...]: its real positions only, 0 on the tails."""
        out = x.new_zeros((self.rows * self.width,) + tuple(x.shape[2:]))
        out[self.flat] = x[self.mask]
        return out.view(self.rows, self.width, *x.shape[2:])

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """y [R, W, ...] as the padded batch's [S, T, ...]: each real position's value, 0 elsewhere
        (differentiable)."""
        rest = tuple(y.shape[2:])
        out = y.reshape((self.rows * self.width,) + rest)[self.index]
        keep = self.mask.view(self.mask.shape + (1,) * len(rest))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def forward(self, model, input_ids: torch.Tensor, **kwargs):
        """`model` on the packed rows of `input_ids` [S, T]."""
        return model(self.pack(input_ids), segment_ids=self.segment_ids, position_ids=self.position_ids, **kwargs)


# ---- logits at the loss positions -------------------------------------------------------------
def loss_forward(model, batch: dict, padding_free: bool = False) -> torch.Tensor:
    """The logits [1, K, V] of a micro-batch of padded rows (`input_ids`, `segment_ids`,
    `position_ids`, `attention_mask`) at its `loss_mask`'s K positions only, in
    `sprout.losses.tokens.loss_positions` order (what the masked losses of `sprout.losses.tokens`
    take): the model on the padded rows, or `padding_free` on `PackedRows` of the real tokens
    (the loss positions lie among them), either way with the lm_head run at those K places alone
    (`logits_to_keep`)."""
    mask = batch["loss_mask"]
    if padding_free:
        rows = PackedRows(batch["attention_mask"])
        kept = rows.index.reshape(-1)[loss_positions(mask)]  # each loss position's packed place
        return rows.forward(model, batch["input_ids"], logits_to_keep=kept)
    return model(batch["input_ids"], segment_ids=batch["segment_ids"], position_ids=batch["position_ids"],
                 logits_to_keep=loss_positions(mask))


class CompletionRows:
    """The forward of a micro-batch of left-padded prompts + right-padded completions (the RL
    stages'): its input is each prompt and completion but the last token; the completion's L
    tokens are predicted at the input's last L columns. Padded, the model runs on the padded rows
    (`padding_inputs`) with logits of the last L columns kept; `padding_free`, on `PackedRows`
    with logits kept at just the real positions of those columns (a LongTensor `logits_to_keep`)."""

    def __init__(self, batch: dict, padding_free: bool = False):
        completion = batch["completion_ids"]
        self.L = completion.shape[1]
        self.ids = torch.cat([batch["prompt_ids"], completion], dim=1)[:, :-1]
        self.mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)[:, :-1].bool()
        self.rows = PackedRows(self.mask) if padding_free else None
        if self.rows is None:
            self.targets = completion                      # [S, L]
        else:
            self.kept = self.mask[:, -self.L:]             # [S, L]: the real positions predicting a completion token
            self.targets = completion[self.kept]           # [K]

    def forward(self, model, **kwargs) -> torch.Tensor:
        """The kept logits: [S, L, V] padded, [1, K, V] packed."""
        if self.rows is None:
            segments, positions = padding_inputs(self.mask)
            return model(self.ids, segment_ids=segments, position_ids=positions, logits_to_keep=self.L, **kwargs)
        return self.rows.forward(model, self.ids, logits_to_keep=self.rows.index[:, -self.L:][self.kept], **kwargs)

    def completion(self, values: torch.Tensor) -> torch.Tensor:
        """Per-kept-position values ([S, L] padded, [1, K] packed) as [S, L] (packed: 0 off the kept positions)."""
        if self.rows is None:
            return values
        out = torch.zeros(self.kept.shape, dtype=values.dtype, device=values.device)
        return out.masked_scatter(self.kept, values.reshape(-1))

    def completion_of_all(self, values: torch.Tensor) -> torch.Tensor:
        """Values at every input position ([S, T] padded, [R, W] packed) at the completion's L columns [S, L]."""
        return (values if self.rows is None else self.rows.unpack(values))[:, -self.L:]


# ---- micro-batches by a token budget ------------------------------------------------------------
def padded_cost(lengths: np.ndarray) -> Callable[[int, int], int]:
    """cost(i, j) of units i..j-1 padded: rows × the longest sequence, `lengths` [n, k] (k sequences a unit)."""
    return lambda i, j: int(lengths[i:j].size * lengths[i:j].max())


def packed_cost(lengths: np.ndarray) -> Callable[[int, int], int]:
    """cost(i, j) of units i..j-1 packed: their sequences' tokens, `lengths` [n, k]."""
    csum = np.r_[0, np.cumsum(lengths.sum(axis=1))]
    return lambda i, j: int(csum[j] - csum[i])


def split_to(slices: list[slice], count: int) -> list[slice]:
    """`slices` cut further until there are `count`: the one with the most units halved (the
    first of equals; its first half the larger). Each keeps its units' order."""
    out = list(slices)
    while len(out) < count:
        k = max(range(len(out)), key=lambda i: (out[i].stop - out[i].start, -i))
        s = out[k]
        if s.stop - s.start < 2:
            raise ValueError(f"cannot cut {sum(x.stop - x.start for x in slices)} units into {count} micro-batches")
        mid = s.start + (s.stop - s.start + 1) // 2
        out[k:k + 1] = [slice(s.start, mid), slice(mid, s.stop)]
    return out


def agreed_count(accelerator, count: int) -> int:
    """The largest `count` of any process (every process calls)."""
    if accelerator is None or accelerator.num_processes == 1:
        return count
    t = torch.tensor([count], dtype=torch.long, device=accelerator.device)
    return int(accelerator.gather(t).max())


def budget_slices(n: int, max_units: int, budget: int = 0, cost: Callable[[int, int], int] | None = None,
                  accelerator=None, unit: str = "units", what: str = "batch.micro_batch_tokens") -> list[slice]:
    """This process's `n` units in micro-batches (module doc): `max_units` each when `budget` is 0;
    else consecutive units, at most `max_units`, while cost(first, end) <= budget, then cut to the
    count every process agrees on. A unit alone over the budget is refused (the configs' checks
    keep every possible unit within it)."""
    if not budget:
        return [slice(i, min(i + max_units, n)) for i in range(0, n, max_units)]
    out, i = [], 0
    while i < n:
        if cost(i, i + 1) > budget:
            raise SproutError(f"{what} {budget}: one of the {unit} has {cost(i, i + 1)} tokens; raise {what}")
        j = i + 1
        while j < n and j - i < max_units and cost(i, j + 1) <= budget:
            j += 1
        out.append(slice(i, j))
        i = j
    return split_to(out, agreed_count(accelerator, len(out)))
