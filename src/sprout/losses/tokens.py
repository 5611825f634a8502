"""Loss math shared by every trainer: pure functions of logits and targets.

Losses are returned as *sums* together with the number of terms, never as means: the
training loop (`sprout.engine.trainer`) divides by the number of targets in the whole
accumulated global batch, across micro-batches and processes, so a run's gradient does
not depend on how the batch was split.

The cross-entropy is an autograd Function that keeps only each row's log-sum-exp and builds
the gradient (softmax minus one-hot) in one logits-sized tensor; with `overwrite_logits` it
writes that gradient into the logits' own memory, safe only when nothing reads the logits
after backward (the trainers compute every metric before backward).

Every masked function takes logits at every position or at the masked positions only
(`loss_positions` into the model's `logits_to_keep`; `logits_at` tells them apart): a loss that
reads K of B * T positions runs the lm_head, the log-sum-exp and its backward on K rows.
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


def loss_positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions a loss reads: flat places [K] (int64) of the 1s of `mask` [B, T] (bool or 0/1)
    in the flattened [B * T] batch, row-major; what `Transformer.forward`'s `logits_to_keep`
    takes, so that the lm_head and the log-sum-exp run at these K positions only."""
    return mask.reshape(-1).nonzero().squeeze(-1)


def logits_at(logits: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [K, V] at the masked positions, their `loss_positions` [K]) of a batch with mask
    [B, T]. `logits` come either at every position (any [..., V] of B * T rows, e.g. [B, T, V]) or
    at the masked ones only, in `loss_positions` order (e.g. [1, K, V] from `logits_to_keep`).
    The two are told apart by the row count: K = B * T only when every position is masked, and
    then both mean the same rows in the same order."""
    flat = loss_positions(mask)
    logits = logits.reshape(-1, logits.size(-1))
    return (logits[flat] if logits.size(0) == mask.numel() else logits), flat


def row_sums(values: torch.Tensor, flat: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Per-row sums [B] of values [K] at the flat places `flat` (`loss_positions`) of a [B, T]
    batch: the values put in a zero [B, T] (each place once: no accumulation), each row summed.
    The same additions in the same order as a masked sum over every position, deterministic on
    every device (no atomics); differentiable in `values`."""
    rows, width = shape
    full = values.new_zeros(rows * width).scatter(0, flat, values)
    return full.view(rows, width).sum(dim=-1)


def _masked_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                overwrite_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(nll [K] at the masked positions, their `loss_positions` [K]); logits as `logits_at` takes
    them. At every position the cross-entropy runs on every row (masked ones with target 0) so
    that `overwrite_logits` reuses the logits' own memory, then is read at the masked rows."""
    flat = loss_positions(mask)
    logits, targets = logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)
    if logits.size(0) == mask.numel():
        every = targets.masked_fill(~mask.reshape(-1).bool(), 0)
        return _CrossEntropyRows.apply(logits, every, overwrite_logits)[flat], flat
    return _CrossEntropyRows.apply(logits, targets[flat], overwrite_logits), flat


def token_nll_sum(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None, *, overwrite_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood (nats) of `targets` under `logits`, and the count.

    targets [...] int64; mask [...] (bool or 0/1) selects the positions that count, None means
    all of them. logits (any float dtype; computed in float32): [..., V] at every position, or,
    with a mask, [..., V] at the masked positions only (`logits_at`; the lm_head run there alone
    via `loss_positions`). Either way the sum runs over the K masked positions in row-major
    order: the same terms as a masked sum over every position, added in another order (equal
    to float rounding).
    overwrite_logits: the backward may reuse the logits' memory for their gradient; only
    for callers that never read `logits` after backward.
    Returns (nll_sum float32 scalar, n_targets int64 scalar).
    """
    if mask is None:
        logits, targets = logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)
        nll = _CrossEntropyRows.apply(logits, targets, overwrite_logits)
        return nll.sum(), torch.tensor(targets.numel(), device=logits.device)
    nll, flat = _masked_nll(logits, targets, mask, overwrite_logits)
    return nll.sum(), torch.tensor(flat.numel(), device=nll.device)


def masked_correct_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How many masked positions the argmax of `logits` gets right (token accuracy × count).

    logits [..., V] at every position or at the masked ones only (`logits_at`), targets [...],
    mask [...] (bool or 0/1). Ties go to the lowest id (torch.argmax). Returns an int64 scalar;
    divide by the mask count for the accuracy.
    """
    kept, flat = logits_at(logits, mask)
    return (kept.argmax(dim=-1) == targets.reshape(-1)[flat]).sum()


def masked_entropy_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked positions of the entropy (nats) of softmax(logits), in float32.

    logits [..., V] at every position or at the masked ones only (`logits_at`); only the masked
    rows are materialised, so padding and prompt positions cost nothing. A confident model has
    entropy near 0; a uniform one over V ids has ln V.
    """
    logp = logits_at(logits, mask)[0].float().log_softmax(dim=-1)
    return torch.special.entr(logp.exp()).sum()


def sequence_logps(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *, overwrite_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row summed log-probability of `targets` over the masked positions, and the count.

    targets [B, T] int64, mask [B, T] (bool or 0/1; 1 on the response tokens being scored),
    logits (any float dtype; computed in float32) at every position [B, T, V] or at the masked
    ones only ([1, K, V] in `loss_positions` order, `logits_at`). The same cross-entropy as
    `token_nll_sum` (one log-sum-exp per kept row, no log-softmax copy of the logits), summed
    per row (`row_sums`: the additions of a masked sum over the whole row): log p(response |
    prompt) of each sequence, as the preference losses take it. A row with no masked position
    gets 0 and count 0.
    overwrite_logits: as in `token_nll_sum`.
    Returns (logp_sum float32 [B], n_tokens int64 [B]).
    """
    nll, flat = _masked_nll(logits, targets, mask, overwrite_logits)
    return row_sums(-nll, flat, mask.shape), mask.bool().sum(dim=-1)
