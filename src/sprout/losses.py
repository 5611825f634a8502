"""Loss math shared by every trainer: pure functions of logits and targets.

Losses are returned as *sums* together with the number of terms, never as means: the
training loop (`sprout.train.loop`) divides by the number of targets in the whole
accumulated global batch, across micro-batches and processes, so a run's gradient does
not depend on how the batch was split (the normalisation nanoGPT-style loops get wrong
when micro-batches hold different numbers of trained tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_nll_sum(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood (nats) of `targets` under `logits`, and the count.

    logits [..., V] (any float dtype; computed in float32), targets [...] int64,
    mask [...] (bool or 0/1) selects the positions that count; None means all of them.
    Returns (nll_sum float32 scalar, n_targets int64 scalar).
    """
    logits, targets = logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)
    if mask is None:
        return F.cross_entropy(logits, targets, reduction="sum"), torch.tensor(targets.numel(), device=logits.device)
    nll = F.cross_entropy(logits, targets, reduction="none")
    keep = mask.reshape(-1).bool()
    return torch.where(keep, nll, torch.zeros_like(nll)).sum(), keep.sum()


def masked_correct_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How many masked positions the argmax of `logits` gets right (token accuracy × count).

    logits [..., V], targets [...], mask [...] (bool or 0/1). Ties go to the lowest id
    (torch.argmax). Returns an int64 scalar; divide by the mask count for the accuracy.
    """
    keep = mask.reshape(-1).bool()
    hits = logits.reshape(-1, logits.size(-1))[keep].argmax(dim=-1) == targets.reshape(-1)[keep]
    return hits.sum()


def masked_entropy_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked positions of the entropy (nats) of softmax(logits), in float32.

    Only the masked rows are materialised, so padding and prompt positions cost nothing.
    A confident model has entropy near 0; a uniform one over V ids has ln V.
    """
    keep = mask.reshape(-1).bool()
    logp = logits.reshape(-1, logits.size(-1))[keep].float().log_softmax(dim=-1)
    return torch.special.entr(logp.exp()).sum()
