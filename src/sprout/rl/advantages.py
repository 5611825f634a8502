"""Advantages for the RL trainers: group-relative (GRPO, RLOO, Dr. GRPO) and PPO's GAE.

Group advantages take the rewards of the whole global batch, laid out prompt by prompt: the
`num_generations` completions of one prompt are adjacent (TRL's layout). Group and batch
stds are Bessel-corrected (as `torch.std` and TRL), eps = 1e-4 (TRL's). Each function's
docstring gives its formula: `group_advantages` (the weighted sum of the reward functions
first, TRL's `sum_then_normalize`), `normalize_then_sum` then `batch_normalize` (each function
normalised in its group first), `gae`, `masked_whiten`. Batch figures span every process: the
caller gathers the global batch (every rank's values in rank order) and passes it as `batch`,
so N processes compute what one does. `masked_whiten` normalises over the tensor it is given:
to whiten over every process, gather first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGES = ("grpo", "rloo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
MULTI_OBJECTIVE_AGGREGATION = ("sum_then_normalize", "normalize_then_sum")
DEFAULT_SCALE = {"grpo": "group", "rloo": "none", "dr_grpo": "none"}
STD_EPS = 1e-4


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages [N] and the figures trainers log (TRL's names)."""

    advantages: torch.Tensor
    frac_reward_zero_std: float  # share of groups with equal rewards
    reward_std: float  # mean over groups of the group std


def group_advantages(rewards: torch.Tensor, num_generations: int, advantage: str = "grpo",
                     scale_rewards: str | None = None, eps: float = STD_EPS) -> GroupAdvantages:
    """Group-relative advantages of `rewards` [N = groups × num_generations]. With G per group,
    group mean m_g and std s_g, batch std s_b:

        grpo     A_i = r_i - m_g, / (s_g + eps) (scale group, the default), / (s_b + eps) (batch)
        rloo     A_i = r_i - (sum_g - r_i) / (G - 1), divided the same way (default: none)
        dr_grpo  A_i = r_i - m_g (scale none only)

    `scale_rewards` None takes the estimator's default. `frac_reward_zero_std` is the share of
    groups whose rewards are all equal (every advantage 0), counted per group whatever the scale."""
    if advantage not in ADVANTAGES:
        raise ValueError(f"advantage must be one of {', '.join(ADVANTAGES)}, got {advantage!r}")
    scale = DEFAULT_SCALE[advantage] if scale_rewards is None else scale_rewards
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale!r}")
    if advantage == "dr_grpo" and scale != "none":
        raise ValueError(f"advantage dr_grpo divides by no std: scale_rewards must be none, got {scale!r}")
    if num_generations < 2 or rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be 1-D with a multiple of num_generations >= 2 entries, "
                         f"got shape {tuple(rewards.shape)} and num_generations {num_generations}")
    r = rewards.double().view(-1, num_generations)
    g = num_generations
    group_std = r.std(dim=1, keepdim=True)
    if advantage == "rloo":
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)
    else:
        adv = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (group_std + eps)
    elif scale == "batch":
        adv = adv / (rewards.double().std() + eps)
    zero = torch.isclose(group_std, torch.zeros_like(group_std))
    return GroupAdvantages(adv.reshape(-1).to(rewards.dtype), zero.double().mean().item(), group_std.mean().item())


def nan_mean_std(values: torch.Tensor, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, Bessel std) over the entries of `values` that are not NaN, along `dim` (kept), or
    over all of them; the std is NaN where fewer than two values are (TRL's nanstd)."""
    dims = tuple(range(values.dim())) if dim is None else (dim,)
    present = ~torch.isnan(values)
    count = present.sum(dim=dims, keepdim=True).to(values.dtype)
    mean = torch.where(present, values, 0).sum(dim=dims, keepdim=True) / count
    square = torch.where(present, (values - mean) ** 2, 0).sum(dim=dims, keepdim=True)
    std = torch.where(count > 1, square / (count - 1), torch.nan).sqrt()
    return mean, std


def normalize_then_sum(per_function: torch.Tensor, weights, num_generations: int,
                       eps: float = STD_EPS) -> torch.Tensor:
    """s_i = sum_k w_k (r_ik - m_gk) / (s_gk + eps) of `per_function` [N, F] (NaN where a
    function abstained), m_gk, s_gk the mean and Bessel std of function k over the completions of
    the group of `num_generations` it did not abstain on (an abstention, or a group with fewer
    than two values of k, adds 0); [N] float64, NaN where every function abstained. The batch
    step is `batch_normalize`."""
    if per_function.dim() != 2 or per_function.size(0) % num_generations or num_generations < 2:
        raise ValueError(f"per_function must be [groups × num_generations, functions] with num_generations >= 2, "
                         f"got shape {tuple(per_function.shape)} and num_generations {num_generations}")
    values = per_function.double().view(-1, num_generations, per_function.size(1))
    mean, std = nan_mean_std(values, dim=1)
    z = ((values - mean) / (std + eps)).view(per_function.shape)
    w = torch.as_tensor(weights, dtype=torch.float64)
    summed = torch.nansum(z * w, dim=1)
    return torch.where(torch.isnan(per_function).all(dim=1), torch.nan, summed)


def batch_normalize(values: torch.Tensor, batch: torch.Tensor, eps: float = STD_EPS) -> torch.Tensor:
    """(x - mean(batch)) / (std(batch) + eps) for each x of `values` (this rank's), with the mean
    and Bessel std over the non-NaN entries of `batch`, the global batch (every rank's values
    gathered); a NaN value comes out 0."""
    mean, std = nan_mean_std(batch.double())
    return torch.nan_to_num((values.double() - mean.reshape(())) / (std.reshape(()) + eps), nan=0.0)


def uniform_groups(values: torch.Tensor, num_generations: int) -> torch.Tensor:
    """[groups] bool: True where, in every column of `values` [N] or [N, F], the group's values
    that are not NaN are all equal (std 0 or fewer than two of them): a group that teaches
    nothing, its advantages 0."""
    v = values.double().reshape(values.size(0), -1)
    _, std = nan_mean_std(v.view(-1, num_generations, v.size(1)), dim=1)
    flat = torch.isnan(std) | torch.isclose(std, torch.zeros_like(std))
    return flat.all(dim=2).view(-1)


# ---- PPO ------------------------------------------------------------------------------

def token_rewards(scores: torch.Tensor, per_token_kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """PPO's per-token rewards [B, T]: -kl_coef × KL on every completion token, plus the
    sequence's score [B] on its last completion token (0 on masked positions)."""
    m = mask.to(per_token_kl.dtype)
    rewards = -kl_coef * per_token_kl * m
    lengths = mask.long().sum(dim=1)
    last = (mask.long().cumsum(dim=1) == lengths[:, None]) & mask.bool()  # the last masked position
    return rewards + last.to(rewards.dtype) * scores.to(rewards.dtype)[:, None]


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] by generalised advantage estimation, m_t the mask:
    delta_t = r_t + gamma m_{t+1} V_{t+1} - V_t, A_t = delta_t + gamma lam m_{t+1} A_{t+1}, so
    nothing is bootstrapped past the last completion token; returns A + V; masked positions 0."""
    m = mask.to(values.dtype)
    rewards, values = rewards * m, values * m
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    next_mask = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_mask * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_mask * next_adv) * m[:, t]
        advantages[:, t] = next_adv
        next_value, next_mask = values[:, t], m[:, t]
    return advantages, (advantages + values) * m


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked positions; Bessel-corrected (n / (n - 1)) when `unbiased`."""
    m = mask.to(values.dtype)
    n = m.sum()
    if unbiased and n < 2:
        raise ValueError(f"masked_var needs at least 2 masked values, got {int(n)}")
    var = masked_mean((values - masked_mean(values, mask)) ** 2, mask)
    return var * n / (n - 1) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - masked mean) / sqrt(masked var + 1e-8), the variance Bessel-corrected over the masked
    count; `shift_mean=False` adds the mean back; masked positions are 0."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)
