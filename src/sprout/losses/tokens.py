"""Loss math shared by every trainer: pure functions of logits and targets.

Losses are returned as *sums* together with the number of terms, never as means: the
training loop (`sprout.engine.trainer`) divides by the number of targets in the whole
accumulated global batch, across micro-batches and processes, so a run's gradient does
not depend on how the batch was split.

The cross-entropy is an autograd Function that keeps only each row's log-sum-exp and builds
the gradient (softmax minus one-hot) in one logits-sized tensor; with `overwrite_logits` it
writes that gradient into the logits' own memory, safe only when nothing reads the logits
after backward (the trainers compute every metric before backward).
"""

from __future__ import annotations

import torch


class _CrossEntropyRows(torch.autograd.Function):
    """Per-row NLL -log softmax(logits)[target] of logits [N, V] (float32), targets [N]."""

    @staticmethod
    def forward(ctx, logits, targets, overwrite_logits=False):
        rows = max(1, (1 << 22) // logits.size(-1))  # ~16 MB temporaries in logsumexp
        lse = torch.cat([chunk.logsumexp(dim=-1) for chunk in logits.split(rows)])
        ctx.save_for_backward(logits, targets, lse)
        ctx.overwrite_logits = overwrite_logits
        return lse - logits.gather(-1, targets[:, None]).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_nll):
        logits, targets, lse = ctx.saved_tensors
        # softmax * g, then - onehot * g; in the logits' memory when the caller allows it
        grad = logits.sub_(lse[:, None]) if ctx.overwrite_logits else torch.sub(logits, lse[:, None])
        grad.exp_().mul_(grad_nll[:, None])
        return grad.scatter_add_(-1, targets[:, None], -grad_nll[:, None]), None, None


def token_nll_sum(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None, *, overwrite_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood (nats) of `targets` under `logits`, and the count.

    logits [..., V] (any float dtype; computed in float32), targets [...] int64,
    mask [...] (bool or 0/1) selects the positions that count; None means all of them.
    overwrite_logits: the backward may reuse the logits' memory for their gradient; only
    for callers that never read `logits` after backward.
    Returns (nll_sum float32 scalar, n_targets int64 scalar).
    """
    logits, targets = logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)
    if mask is None:
        nll = _CrossEntropyRows.apply(logits, targets, overwrite_logits)
        return nll.sum(), torch.tensor(targets.numel(), device=logits.device)
    keep = mask.reshape(-1).bool()
    nll = _CrossEntropyRows.apply(logits, targets.masked_fill(~keep, 0), overwrite_logits)  # masked: any target
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


def sequence_logps(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, overwrite_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row summed log-probability of `targets` over the masked positions, and the count.

    logits [B, T, V] (any float dtype; computed in float32), targets [B, T] int64, mask
    [B, T] (bool or 0/1; 1 on the response tokens being scored). The same cross-entropy as
    `token_nll_sum` (one log-sum-exp per row, no log-softmax copy of the logits), kept per
    row instead of summed over the batch: log p(response | prompt) of each sequence, as the
    preference losses take it. A row with no masked position gets 0 and count 0.
    overwrite_logits: as in `token_nll_sum`.
    Returns (logp_sum float32 [B], n_tokens int64 [B]).
    """
    rows, width = targets.shape
    keep = mask.bool()
    flat = logits.reshape(-1, logits.size(-1)).float()
    nll = _CrossEntropyRows.apply(flat, targets.masked_fill(~keep, 0).reshape(-1), overwrite_logits)
    logp = torch.where(keep, -nll.view(rows, width), torch.zeros((), device=nll.device))
    return logp.sum(dim=-1), keep.sum(dim=-1)
