"""Policy-gradient losses for PPO and GRPO: per-token terms, then one normaliser per loss_type.

Each per-token term ([B, T]; `mask` is 1 on completion tokens) states its formula in its own
docstring. `aggregate` returns (loss_sum, denominator) of one micro-batch so the normalisation
is exact over the GLOBAL batch (every micro-batch on every process); l is the per-token loss,
L_i = sum_t m_it, clamped to 1 (an empty row adds 0 to the sum and 1 to grpo's rows):

    grpo, sapo         sum_i (sum_t l_it m_it) / L_i   over the global batch's rows
    bnpo, dapo, cispo  sum_i sum_t l_it m_it           over the global batch's completion tokens
    dr_grpo            sum_i sum_t l_it m_it           over its rows × max_completion_length

A trainer (`sprout.engine.trainer`) sums `denominator` over all its micro-batches before any
forward, all-reduces it to D, and runs backward on loss_sum × world_size / D. Metrics are
(sum, count) pairs: clip ratios per completion token (per sequence when the weights are per
sequence), `kl` and `entropy` per completion token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprout.losses.loss_types import IMPORTANCE_SAMPLING, POLICY_LOSS_TYPES, SEQUENCE_MEAN_LOSS_TYPES


# ---- per-token terms -------------------------------------------------------------------

def importance_log_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """Log importance weights. `token`: log pi - log pi_old [B, T]; `sequence` (GSPO): its
    masked mean over the sequence, `sequence_sum`: its masked sum, each [B, 1] for every token."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        m = mask.to(log_ratio.dtype)
        return ((log_ratio * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)).unsqueeze(-1)
    if level == "sequence_sum":
        return (log_ratio * mask.to(log_ratio.dtype)).sum(dim=-1, keepdim=True)
    raise ValueError(f"importance_sampling must be one of {', '.join(IMPORTANCE_SAMPLING)}, got {level!r}")


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def clipped_surrogate(log_weights: torch.Tensor, advantages: torch.Tensor, epsilon: float = 0.2,
                      epsilon_high: float | None = None, delta: float | None = None,
                      dual_clip: float | None = None) -> torch.Tensor:
    """-min(rho' A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) per token, rho = exp(log_weights),
    rho' = min(rho, delta) when delta is set, epsilon_high defaulting to epsilon; dual_clip c > 1
    bounds a negative advantage's loss by -c A. advantages [B] or [B, T]."""
    adv = _per_token(advantages)
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(log_weights)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.min(unclipped * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.min(loss, -dual_clip * adv), loss)
    return loss


def cispo_surrogate(log_weights: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor,
                    epsilon_high: float) -> torch.Tensor:
    """CISPO per token: -sg(min(rho, epsilon_high)) × A × log pi(y_t), rho = exp(log_weights)
    ([B, T], or [B, 1] per sequence), logps [B, T], advantages [B] or [B, T]. The capped
    weight carries no gradient: d/dlog pi = -min(rho, epsilon_high) A. Normaliser (loss_type
    cispo): the completion tokens of the global batch, as dapo."""
    weight = torch.clamp(torch.exp(log_weights), max=epsilon_high).detach()
    return -weight * _per_token(advantages) * logps


def sapo_surrogate(log_weights: torch.Tensor, advantages: torch.Tensor, temperature_pos: float = 1.0,
                   temperature_neg: float = 1.05) -> torch.Tensor:
    """SAPO per token: -(4 / tau) sigmoid(tau (rho - 1)) × A, rho = exp(log_weights), tau =
    temperature_pos where A > 0, else temperature_neg (TRL's sapo_temperature_pos/_neg).
    d/drho = -4 s (1 - s) A with s the sigmoid: -A at rho = 1, fading away from it.
    Normaliser (loss_type sapo): each sequence's token mean, then the mean over the global
    batch's sequences, as grpo."""
    adv = _per_token(advantages)
    tau = torch.where(adv > 0, temperature_pos, temperature_neg).to(log_weights.dtype)
    return -torch.sigmoid(tau * (torch.exp(log_weights) - 1)) * 4 / tau * adv


def bias_corrected_kl(per_token_kl: torch.Tensor, log_weights: torch.Tensor) -> torch.Tensor:
    """The per-token KL estimate × rho, rho = exp(log_weights) ([B, T], or [B, 1] broadcast
    over a sequence), with rho's gradient: an estimate of the current policy's KL from tokens
    of the sampling policy; rho's gradient adds k × grad log pi even on-policy. Normalised with
    the loss it enters."""
    return per_token_kl * torch.exp(log_weights)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_range_value: float) -> torch.Tensor:
    """Per-token clipped value loss 0.5 max((V - R)^2, (clip(V, V_old ± c) - R)^2)."""
    clipped = torch.clamp(values, old_values - clip_range_value, old_values + clip_range_value)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) [..., V] at each position [...], in float32 or wider."""
    logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# ---- normalisers -----------------------------------------------------------------------

def _check(loss_type: str, max_completion_length: int | None) -> None:
    if loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(POLICY_LOSS_TYPES)}, got {loss_type!r}")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type dr_grpo needs max_completion_length")


def denominator(mask: torch.Tensor, loss_type: str, max_completion_length: int | None = None) -> torch.Tensor:
    """This micro-batch's share of the global denominator (int64), from the mask alone."""
    _check(loss_type, max_completion_length)
    rows = torch.tensor(mask.size(0), device=mask.device)
    if loss_type in SEQUENCE_MEAN_LOSS_TYPES:
        return rows
    if loss_type == "dr_grpo":
        return rows * int(max_completion_length)
    return mask.long().sum()


def sequence_mean_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """grpo, sapo: sum over rows of each row's masked token mean."""
    m = mask.to(per_token.dtype)
    return ((per_token * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)).sum()


def token_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bnpo, dapo, cispo, dr_grpo: sum over masked tokens."""
    return (per_token * mask.to(per_token.dtype)).sum()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
              max_completion_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, denominator) of a per-token loss for `loss_type` (the module's table)."""
    _check(loss_type, max_completion_length)
    total = sequence_mean_sum(per_token, mask) if loss_type in SEQUENCE_MEAN_LOSS_TYPES \
        else token_sum(per_token, mask)
    return total, denominator(mask, loss_type, max_completion_length)


# ---- the policy loss -------------------------------------------------------------------

def _metric_weights(log_weights: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, count) of a ratio metric: per completion token, or per row when the weights
    are per sequence ([B, 1])."""
    if log_weights.size(-1) == 1:  # sequence level: one value per row
        return torch.ones_like(log_weights), torch.tensor(log_weights.size(0), device=log_weights.device)
    return mask.to(log_weights.dtype), mask.long().sum()


def clip_ratio_sums(log_weights: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    epsilon: float = 0.2, epsilon_high: float | None = None) -> dict[str, tuple]:
    """TRL's clip fractions as (sum, count): per completion token, or per sequence when
    the weights are per sequence ([B, 1])."""
    adv = _per_token(advantages)
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(log_weights.detach())
    is_low = (ratio < 1 - epsilon) & (adv < 0)
    is_high = (ratio > 1 + high) & (adv > 0)
    weight, count = _metric_weights(ratio, mask)
    return {"clip_ratio/low_mean": ((is_low * weight).sum(), count),
            "clip_ratio/high_mean": ((is_high * weight).sum(), count),
            "clip_ratio/region_mean": (((is_low | is_high) * weight).sum(), count)}


def cispo_clip_ratio_sums(log_weights: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                          epsilon_high: float) -> dict[str, tuple]:
    """TRL's cispo_clip_ratio as (sum, count): the share where rho > epsilon_high with A > 0,
    per completion token (per sequence at the sequence level)."""
    ratio = torch.exp(log_weights.detach())
    capped = (ratio > epsilon_high) & (_per_token(advantages) > 0)
    weight, count = _metric_weights(ratio, mask)
    return {"cispo_clip_ratio": ((capped * weight).sum(), count)}


@dataclass
class PolicyLoss:
    """A micro-batch's loss sum, its denominator share and its metrics as (sum, count)."""

    loss_sum: torch.Tensor
    denominator: torch.Tensor
    metrics: dict[str, tuple]


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                loss_type: str = "dapo", max_completion_length: int | None = None, epsilon: float = 0.2,
                epsilon_high: float | None = None, delta: float | None = None, importance_sampling: str = "token",
                dual_clip: float | None = None, sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                per_token_kl: torch.Tensor | None = None, beta: float = 0.0, use_bias_correction_kl: bool = False,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                per_token_value_loss: torch.Tensor | None = None, vf_coef: float = 0.0) -> PolicyLoss:
    """The per-token loss surrogate + beta × KL - entropy_coef × entropy
    + vf_coef × value loss, normalised by `loss_type` (`aggregate`).

    The surrogate: `clipped_surrogate` (grpo, bnpo, dapo, dr_grpo), `cispo_surrogate` with
    the cap epsilon_high (None: epsilon, as TRL) or `sapo_surrogate`. logps, old_logps, mask
    [B, T]; advantages [B] (GRPO) or [B, T] (PPO); per_token_kl (e.g. `sprout.rl.kl.kl_k3`),
    entropy (`token_entropy`), per_token_value_loss (`value_loss`) [B, T], each optional and
    carrying its own gradient; with use_bias_correction_kl the KL is `bias_corrected_kl`."""
    _check(loss_type, max_completion_length)
    log_w = importance_log_weights(logps, old_logps, mask, importance_sampling)
    high = epsilon if epsilon_high is None else epsilon_high
    if loss_type == "cispo":
        per_token = cispo_surrogate(log_w, logps, advantages, high)
        metrics = cispo_clip_ratio_sums(log_w, advantages, mask, high)
    elif loss_type == "sapo":
        per_token = sapo_surrogate(log_w, advantages, sapo_temperature_pos, sapo_temperature_neg)
        metrics = {}
    else:
        per_token = clipped_surrogate(log_w, advantages, epsilon, epsilon_high, delta, dual_clip)
        metrics = clip_ratio_sums(log_w, advantages, mask, epsilon, epsilon_high)
    tokens = mask.long().sum()
    m = mask.to(per_token.dtype)
    if per_token_kl is not None:
        if use_bias_correction_kl:
            per_token_kl = bias_corrected_kl(per_token_kl, log_w)
        metrics["kl"] = ((per_token_kl.detach() * m).sum(), tokens)
        if beta:
            per_token = per_token + beta * per_token_kl
    if entropy is not None:
        metrics["entropy"] = ((entropy.detach() * m).sum(), tokens)
        if entropy_coef:
            per_token = per_token - entropy_coef * entropy
    if per_token_value_loss is not None and vf_coef:
        per_token = per_token + vf_coef * per_token_value_loss
    loss_sum, denom = aggregate(per_token, mask, loss_type, max_completion_length)
    return PolicyLoss(loss_sum, denom, metrics)


def value_only_loss(per_token_value_loss: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor,
                    vf_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, denominator) of PPO's value warm-up: vf_coef × the per-token value loss summed
    over the completion tokens, over the completion tokens (dapo's normaliser, as in
    `policy_loss`). `logps` enter as 0 × their sum: every parameter they depend on gets an exact
    zero gradient, not none, so a distributed backward sees every parameter used."""
    m = mask.to(per_token_value_loss.dtype)
    loss_sum = vf_coef * (per_token_value_loss * m).sum() + 0.0 * (logps * m).sum()
    return loss_sum, denominator(mask, "dapo")
