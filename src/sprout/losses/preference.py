"""Preference losses: the reward model's pairwise loss, the reference-free terms (the NLL on
chosen, SimPO, ORPO), the loss_type combinator over these and the DPO variants of
`sprout.losses.dpo`, and TRL's logged metrics. One pure function per loss.

Every loss returns PER-PAIR losses [B], never a mean. A trainer sums them and divides by the
number of pairs in the whole global batch (across micro-batches and processes): the rule of
`sprout.losses.tokens`, with pairs in place of target tokens. A normalisation *inside* a pair
is written in the function's docstring; "normaliser: none within the pair" means the formula
is used as is. The AOT variants sort over the batch they are given (`BATCH_COUPLED` in
`sprout.losses.loss_types`; see `sprout.losses.dpo.aot_loss`).

Inputs [B]: `chosen_logps`, `rejected_logps` (log p(response | prompt) summed over the response,
`sprout.losses.tokens.sequence_logps`), `ref_chosen_logps`, `ref_rejected_logps` (the frozen
reference's), `chosen_lengths`, `rejected_lengths` (token counts, clamped to ≥ 1 before dividing).
`preference_metric_sums` gives TRL's logged metrics as (sum, count) pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sprout.errors import SproutError
from sprout.losses.dpo import (
    aot_loss,
    aot_unpaired_loss,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    discopop_loss,
    exo_pair_loss,
    hinge_loss,
    ipo_loss,
    nca_pair_loss,
    response_tokens,
    robust_loss,
    sigmoid_loss,
    sigmoid_norm_loss,
    sppo_hard_loss,
)
from sprout.losses.loss_types import PREFERENCE_LOSS_TYPES, REFERENCE_FREE
from sprout.losses.tokens import logits_at, row_sums


# -----------------------------------------------------------------------------------------
# reward model


def reward_pair_loss(
    r_chosen: torch.Tensor,
    r_rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    center_rewards_coefficient: float = 0.0,
) -> torch.Tensor:
    """Bradley–Terry loss of a scalar reward model, per pair (TRL's RewardTrainer).

        loss = −log σ(r_c − r_r − m) + coef · (r_c + r_r)²

    r_chosen, r_rejected [B]: the model's scores of the two responses. margin m [B] (or a
    float): how much better the chosen response is known to be (Llama 2, Touvron et al. 2023,
    arXiv:2307.09288); None means 0. center_rewards_coefficient: pulls the pair's summed
    reward to 0 so scores stay centred (Eisenstein et al. 2023, arXiv:2312.09244).
    Normaliser: none within the pair. Returns [B].
    """
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (r_chosen + r_rejected) ** 2
    return loss


# -----------------------------------------------------------------------------------------
# terms on the policy's own log-probs: the NLL on chosen, SimPO, ORPO


def sft_loss(chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """NLL of the chosen response (RPO, Pang et al. 2024, arXiv:2404.19733): −logp_c / |y_c|.

    Normaliser: a per-token mean within the pair (length clamped to ≥ 1, so an empty response
    gives 0), so each pair weighs the same whatever its length. TRL's DPOTrainer instead takes
    one token mean over all chosen tokens of the batch; the two agree when lengths are equal.
    Returns [B].
    """
    return -chosen_logps / response_tokens(chosen_lengths)


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
    gamma: float,
) -> torch.Tensor:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, Eq. 6), reference-free:

        loss = −log σ(β (logp_c/|y_c| − logp_r/|y_r|) − γ)

    γ = `simpo_gamma`, the target reward margin (TRL's CPOTrainer writes it as γ/β inside the
    bracket; the same thing). Normaliser: each log-prob is a per-token mean within its own
    sequence (length clamped to ≥ 1). Returns [B].
    """
    avg_c = chosen_logps / response_tokens(chosen_lengths)
    avg_r = rejected_logps / response_tokens(rejected_lengths)
    return -F.logsigmoid(beta * (avg_c - avg_r) - gamma)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x ≤ 0, accurate near 0 and far from it, finite everywhere.

    Mächler's split: log(−expm1(x)) for x > −ln 2 (where 1 − exp(x) cancels) and
    log1p(−exp(x)) below. x is first clamped to ≤ −ε (ε = the dtype's machine epsilon), so
    x = 0, a probability of exactly 1, gives log ε ≈ −16 (float32) and a zero gradient
    instead of −∞ and ∓∞; each branch sees only inputs where it and its gradient are finite.
    """
    x = x.clamp(max=-torch.finfo(x.dtype).eps)
    near = x > -math.log(2)
    x_near = torch.where(near, x, torch.full_like(x, -1.0))
    x_far = torch.where(near, torch.full_like(x, -1.0), x)
    return torch.where(near, torch.log(-torch.expm1(x_near)), torch.log1p(-torch.exp(x_far)))


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it already is: log1mexp's ε cut-off is too coarse in half precision."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    lam: float,
) -> torch.Tensor:
    """ORPO (Hong et al. 2024, arXiv:2403.07691, Eqs. 4–7), reference-free:

        a = logp/|y| (per-token mean log-prob),   log odds(y) = a − log(1 − exp(a))
        loss = −a_c − λ · log σ(log odds(y_c) − log odds(y_r))

    the NLL of the chosen response plus λ times the odds-ratio term; λ is TRL's ORPOConfig
    `beta`. Normaliser: per-token means within each sequence (length clamped to ≥ 1), for
    both the NLL and the odds; computed in at least float32. log(1 − exp(a)) is `log1mexp`, finite (value and gradient)
    when a response is empty or certain (a = 0). Returns [B].
    """
    avg_c = _at_least_float32(chosen_logps) / response_tokens(chosen_lengths)
    avg_r = _at_least_float32(rejected_logps) / response_tokens(rejected_lengths)
    log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
    return -avg_c - lam * F.logsigmoid(log_odds)


# -----------------------------------------------------------------------------------------
# loss_type by name, combined with loss_weights (TRL's DPOConfig semantics)

_NEEDS_LENGTHS = frozenset({"sigmoid_norm", "ipo", "sft", "simpo", "orpo"})


def loss_type_list(loss_type: str | Sequence[str]) -> list[str]:
    """`loss_type` as a list: a single name or a list of names, as DPOConfig accepts."""
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


def check_preference_options(
    loss_type: str | Sequence[str],
    loss_weights: Sequence[float] | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
) -> None:
    """Raise SproutError (one line naming the field) for options no loss can run with."""
    types = loss_type_list(loss_type)
    if not types:
        raise SproutError("loss_type: empty; give at least one of " + ", ".join(PREFERENCE_LOSS_TYPES))
    unknown = [t for t in types if t not in PREFERENCE_LOSS_TYPES]
    if unknown:
        raise SproutError(f"loss_type: unknown {unknown[0]!r}; expected one of " + ", ".join(PREFERENCE_LOSS_TYPES))
    if loss_weights is not None and len(loss_weights) != len(types):
        raise SproutError(f"loss_weights: {len(loss_weights)} weights for {len(types)} loss types {types}")
    if not beta > 0:
        raise SproutError(f"beta: must be > 0, got {beta}")
    if "robust" in types and not 0 <= label_smoothing < 0.5:
        raise SproutError(f"label_smoothing: the robust loss needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    if "exo_pair" in types and not 0 < label_smoothing < 1:
        raise SproutError(
            f"label_smoothing: the exo_pair loss needs 0 < label_smoothing < 1 (1e-3 in the EXO paper), "
            f"got {label_smoothing}"
        )
    if "discopop" in types and not discopop_tau > 0:
        raise SproutError(f"discopop_tau: must be > 0, got {discopop_tau}")


def preference_loss(
    loss_type: str | Sequence[str],
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    *,
    loss_weights: Sequence[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    simpo_gamma: float = 0.5,
    pair_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_k w_k · loss_k per pair, for the named variants `loss_type` and weights `loss_weights`.

    loss_type: one name of PREFERENCE_LOSS_TYPES or a list of them; loss_weights: one weight per name,
    default 1.0 each (TRL's DPOConfig). `beta` is each variant's β (ORPO's λ, as in TRL's
    ORPOConfig); `label_smoothing` is the ε of robust, exo_pair, aot and aot_unpaired. The
    reference log-probs may be None when every variant is in REFERENCE_FREE; the lengths are
    needed by sigmoid_norm, ipo, sft, simpo and orpo. pair_mask [B] (bool, optional): pairs
    where it is False (an eval batch's padding) are left out of the BATCH_COUPLED variants'
    sort and get 0 from them; the per-pair variants ignore it (the caller drops those pairs).
    Normaliser: each variant's own (see its function); none across pairs, except the sort of
    the BATCH_COUPLED variants, which couples the pairs given (entry k: the k-th sorted
    position). Returns [B].
    """
    check_preference_options(
        loss_type, loss_weights, beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau
    )
    types = loss_type_list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if not REFERENCE_FREE.issuperset(types) and (ref_chosen_logps is None or ref_rejected_logps is None):
        raise ValueError(f"loss_type {types} needs the reference log-probs")
    if _NEEDS_LENGTHS.intersection(types) and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"loss_type {types} needs the response lengths")
    c = r = None
    if ref_chosen_logps is not None and ref_rejected_logps is not None:
        c, r = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    keep = None if pair_mask is None else torch.as_tensor(pair_mask, device=chosen_logps.device).bool()

    def over_real_pairs(loss_fn, *per_pair: torch.Tensor) -> torch.Tensor:
        """loss_fn(*per_pair, beta, label_smoothing) over the real pairs alone, 0 at the padding ones."""
        if keep is None:
            return loss_fn(*per_pair, beta, label_smoothing)
        out = loss_fn(*(x[keep] for x in per_pair), beta, label_smoothing)
        return torch.zeros(keep.shape, dtype=out.dtype, device=out.device).index_put((keep,), out)

    variants = {
        "sigmoid": lambda: sigmoid_loss(c, r, beta),
        "sigmoid_norm": lambda: sigmoid_norm_loss(c, r, chosen_lengths, rejected_lengths, beta),
        "hinge": lambda: hinge_loss(c, r, beta),
        "ipo": lambda: ipo_loss(c, r, chosen_lengths, rejected_lengths, beta),
        "robust": lambda: robust_loss(c, r, beta, label_smoothing),
        "exo_pair": lambda: exo_pair_loss(c, r, beta, label_smoothing),
        "bco_pair": lambda: bco_pair_loss(c, r, beta),
        "nca_pair": lambda: nca_pair_loss(c, r, beta),
        "sppo_hard": lambda: sppo_hard_loss(c, r, beta),
        "aot": lambda: over_real_pairs(aot_loss, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps),
        "aot_unpaired": lambda: over_real_pairs(aot_unpaired_loss, c, r),
        "apo_zero": lambda: apo_zero_loss(c, r, beta),
        "apo_down": lambda: apo_down_loss(c, r, beta),
        "discopop": lambda: discopop_loss(c, r, beta, discopop_tau),
        "sft": lambda: sft_loss(chosen_logps, chosen_lengths),
        "simpo": lambda: simpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta, simpo_gamma),
        "orpo": lambda: orpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta),
    }
    total = torch.zeros_like(chosen_logps, dtype=torch.float32)
    for name, weight in zip(types, weights):
        total = total + weight * variants[name]()
    return total


# -----------------------------------------------------------------------------------------
# implicit rewards and logged metrics (TRL's names), as sums with their counts


def implicit_rewards(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards β(logp − ref_logp) of the chosen and rejected responses, detached.

    Without reference log-probs (None), β·logp of the log-probs given, as TRL's CPO/ORPO
    trainers log for their reference-free losses (they pass per-token means). Returns two [B].
    """
    with torch.no_grad():
        if ref_chosen_logps is None or ref_rejected_logps is None:
            return beta * chosen_logps.float(), beta * rejected_logps.float()
        return beta * (chosen_logps - ref_chosen_logps).float(), beta * (rejected_logps - ref_rejected_logps).float()


def mean_logit_sums(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, Σ over masked positions of the mean logit over the vocabulary: the numerator of
    TRL's logits/chosen and logits/rejected (divide by the masked count). mask [B, T], logits at
    every position [B, T, V] or at the masked ones only ([1, K, V], `sprout.losses.tokens.logits_at`);
    no gradient, float32, [B]. Allocates only a [B, T] tensor."""
    with torch.no_grad():
        kept, flat = logits_at(logits, mask)
        return row_sums(kept.mean(dim=-1, dtype=torch.float32), flat, mask.shape)


def preference_metric_sums(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    beta: float,
    *,
    chosen_logit_sums: torch.Tensor | None = None,
    rejected_logit_sums: torch.Tensor | None = None,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """TRL's DPO metrics of one batch as {name: (sum, count)}; the metric is Σsum / Σcount.

    Per pair (count = B): rewards/chosen = β(logp_c − ref_c), rewards/rejected = β(logp_r −
    ref_r) (β·logp when the references are None, see `implicit_rewards`), rewards/margins =
    their difference, rewards/accuracies = 1 if rewards/chosen > rewards/rejected strictly, so a
    tie counts as wrong; logps/chosen, logps/rejected = the summed response log-probs.
    Per token (count = response tokens), only when the logit sums and lengths are given:
    logits/chosen, logits/rejected = the mean over the vocabulary of the logits, averaged over
    response tokens (`mean_logit_sums` gives the sums). Sums are detached float32 scalars,
    counts int64 scalars, so a trainer adds them over micro-batches and all-reduces them.
    """
    with torch.no_grad():
        rc, rr = implicit_rewards(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
        pairs = torch.tensor(rc.numel(), device=rc.device)
        out = {
            "rewards/chosen": (rc.sum(), pairs),
            "rewards/rejected": (rr.sum(), pairs),
            "rewards/margins": ((rc - rr).sum(), pairs),
            "rewards/accuracies": ((rc > rr).float().sum(), pairs),
            "logps/chosen": (chosen_logps.detach().float().sum(), pairs),
            "logps/rejected": (rejected_logps.detach().float().sum(), pairs),
        }
        for side, sums, lengths in (("chosen", chosen_logit_sums, chosen_lengths),
                                    ("rejected", rejected_logit_sums, rejected_lengths)):
            if sums is not None and lengths is not None:
                out[f"logits/{side}"] = (sums.detach().float().sum(), torch.as_tensor(lengths).long().sum())
        return out
