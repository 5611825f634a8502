"""DPO and its variants against a reference model, one pure function each (TRL's DPOTrainer).

Inputs are per-pair tensors [B]: the policy's summed response log-probs and the frozen
reference's, and for the length-normalised variants the response token counts. Most variants
use the log-ratios c = chosen_logps − ref_chosen_logps, r = rejected_logps − ref_rejected_logps
and Δ = c − r.

Every function returns PER-PAIR losses [B], never a mean; a trainer sums them and divides by
the pairs of the whole global batch. A normalisation *inside* a pair (a log-ratio divided by
its response's token count) is written in the function's docstring; "normaliser: none within
the pair" means the formula is used as is. The exception is AOT (`aot_loss`,
`aot_unpaired_loss`): it sorts over the batch it is given, so its entry k belongs to the k-th
sorted position, not to pair k; its docstring says what that means for accumulation and processes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def response_tokens(lengths: torch.Tensor) -> torch.Tensor:
    """Response token counts as floats clamped to ≥ 1: the divisor of every per-token mean of the
    preference losses, so an empty response (log-prob 0, length 0) has per-token log-prob 0, not 0/0."""
    return torch.as_tensor(lengths).float().clamp(min=1.0)


def per_token_margin(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor,
                     chosen_lengths: torch.Tensor, rejected_lengths: torch.Tensor) -> torch.Tensor:
    """c/|y_c| − r/|y_r|: each summed log-ratio divided by its response's token count
    (`response_tokens`, at least 1), the margin of IPO and sigmoid_norm. Returns [B]."""
    return chosen_logratios / response_tokens(chosen_lengths) - rejected_logratios / response_tokens(rejected_lengths)


def sigmoid_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, Eq. 7): −log σ(β Δ), Δ = c − r.

    Normaliser: none within the pair (c and r are sums over response tokens). Returns [B].
    """
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))


def sigmoid_norm_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Length-normalised DPO (the form Tülu 3 trains with, Lambert et al. 2024, arXiv:2411.15124):

        loss = −log σ(β (c/|y_c| − r/|y_r|))

    Normaliser: each log-ratio (policy minus reference log-prob, both summed over the same
    response tokens) is divided by its own response's token count |y| (eot included, clamped
    to ≥ 1), a per-token mean within each sequence, as TRL's `sigmoid_norm` divides
    `chosen_scores` and `rejected_scores` by their completion-token counts; nothing else is
    scaled (β is not). Per pair, so the global per-pair mean is exact under accumulation and
    processes. Returns [B].
    """
    delta = per_token_margin(chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths)
    return -F.logsigmoid(beta * delta)


def hinge_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """Hinge loss of RSO/SLiC (Liu et al. 2023, arXiv:2309.06657): max(0, 1 − β Δ).

    Normaliser: none within the pair. Returns [B].
    """
    return torch.relu(1 - beta * (chosen_logratios - rejected_logratios))


def ipo_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """IPO (Azar et al. 2023, arXiv:2310.12036, Eq. 17): (c/|y_c| − r/|y_r| − 1/(2β))².

    β is the paper's τ. Normaliser: each log-ratio is divided by its response's token count
    (clamped to ≥ 1), a per-token mean within each sequence, as TRL does (the squared loss
    would otherwise grow with response length). Returns [B].
    """
    delta = per_token_margin(chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths)
    return (delta - 1 / (2 * beta)) ** 2


def robust_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, label_smoothing: float
) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024, arXiv:2403.00409), for labels flipped with probability ε:

        loss = ((1 − ε)·(−log σ(β Δ)) − ε·(−log σ(−β Δ))) / (1 − 2ε),   0 ≤ ε < 1/2

    an unbiased estimate of the clean-label DPO loss; ε = `label_smoothing`, ε = 0 is DPO.
    Normaliser: none within the pair. Returns [B].
    """
    z = beta * (chosen_logratios - rejected_logratios)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def exo_pair_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, label_smoothing: float
) -> torch.Tensor:
    """EXO for pairs (Ji et al. 2024, arXiv:2402.00856, Eq. 16): KL(q ‖ p) over {chosen, rejected},

        q = (σ(β Δ), σ(−β Δ)),   p = (1 − ε, ε)
        loss = σ(βΔ)(log σ(βΔ) − log(1 − ε)) + σ(−βΔ)(log σ(−βΔ) − log ε),   0 < ε < 1

    ε = `label_smoothing` (the paper uses 1e-3). Normaliser: none within the pair. Returns [B].
    """
    z = beta * (chosen_logratios - rejected_logratios)
    eps = label_smoothing
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - math.log(eps)
    )


def bco_pair_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """BCO on pairs (Jung et al. 2024, arXiv:2404.04656): −log σ(β c) − log σ(−β r).

    Each response is classified on its own (chosen → reward above 0, rejected → below), as
    TRL's DPOTrainer does; the paper's running reward shift δ is not applied.
    Normaliser: none within the pair. Returns [B].
    """
    return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)


def nca_pair_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """NCA on pairs (Chen et al. 2024, arXiv:2402.05369):

        loss = −log σ(β c) − ½ log σ(−β c) − ½ log σ(−β r)

    which, unlike DPO, keeps the chosen response's likelihood from falling.
    Normaliser: none within the pair. Returns [B].
    """
    zc, zr = beta * chosen_logratios, beta * rejected_logratios
    return -F.logsigmoid(zc) - 0.5 * F.logsigmoid(-zc) - 0.5 * F.logsigmoid(-zr)


def sppo_hard_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """SPPO with hard labels (Wu et al. 2024, arXiv:2405.00675, Eq. 4.7 with P = 1 for the winner
    and 0 for the loser): (c − 1/(2β))² + (r + 1/(2β))².

    Normaliser: none within the pair. Returns [B].
    """
    half = 0.5 / beta
    return (chosen_logratios - half) ** 2 + (rejected_logratios + half) ** 2


def smoothed_sigmoid(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """−(1 − ε) log σ(z) − ε log σ(−z): the logistic loss with the label smoothed by ε (AOT's)."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def aot_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float,
) -> torch.Tensor:
    """AOT, paired (Melnyk et al. 2024, arXiv:2406.05882): the policy's margins should dominate
    the reference's in distribution, compared quantile by quantile through a sort over the batch:

        m_i = logp_c,i − logp_r,i,   m⁰_i = ref_c,i − ref_r,i   (margins of pair i)
        δ_k = m_(k) − m⁰_(k)         (the k-th smallest of each, each sorted on its own)
        loss_k = −(1 − ε) log σ(β δ_k) − ε log σ(−β δ_k)

    ε = `label_smoothing` (0: the plain logistic loss). With B = 1 it is DPO's loss with ε.

    The sort couples the pairs of the batch given: entry k belongs to the k-th sorted position,
    not to pair k, and every entry depends on every pair. Normaliser: the caller sums the B
    entries and divides by B, so the loss of one batch is the mean over its sorted positions,
    TRL's definition. A trainer calls it once per micro-batch, so the sort is taken over each
    micro-batch alone, as TRL sorts within its per-device micro-batch: the step's loss (every
    micro-batch's summed entries over the pairs of the global batch) is the mean of the
    micro-batches' own losses when they hold equal numbers of pairs. It does not depend on which
    process or accumulation step runs a micro-batch, but it does depend on how the global batch
    is cut into micro-batches: one sort over 8 pairs is not the mean of two sorts over 4. Returns [B].
    """
    margins, _ = torch.sort(chosen_logps - rejected_logps, dim=0)
    ref_margins, _ = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)
    return smoothed_sigmoid(beta * (margins - ref_margins), label_smoothing)


def aot_unpaired_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, label_smoothing: float
) -> torch.Tensor:
    """AOT, unpaired (Melnyk et al. 2024, arXiv:2406.05882): the chosen log-ratios should dominate
    the rejected ones in distribution, the two sets sorted on their own (the pairing is not used):

        δ_k = c_(k) − r_(k)   (the k-th smallest chosen and the k-th smallest rejected log-ratio)
        loss_k = −(1 − ε) log σ(β δ_k) − ε log σ(−β δ_k)

    ε = `label_smoothing` (0: the plain logistic loss). With B = 1 it is DPO's loss with ε.
    The sort couples the pairs of the batch given, with `aot_loss`'s consequences: entry k is
    the k-th sorted position; normaliser the mean over the batch's positions (TRL's), sorted
    within each micro-batch, so the step's loss is the mean of the micro-batches' losses and
    depends on the cut into micro-batches, not on the processes. Returns [B].
    """
    chosen_sorted, _ = torch.sort(chosen_logratios, dim=0)
    rejected_sorted, _ = torch.sort(rejected_logratios, dim=0)
    return smoothed_sigmoid(beta * (chosen_sorted - rejected_sorted), label_smoothing)


def apo_zero_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266, Eq. 7): (1 − σ(β c)) + σ(β r).

    Raises the chosen likelihood and lowers the rejected one, each against the reference; for
    chosen responses better than the model's own. Normaliser: none within the pair. Returns [B].
    """
    return (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)


def apo_down_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266, Eq. 8): σ(β c) + (1 − σ(β Δ)).

    Lowers both likelihoods, the rejected one more; for chosen responses worse than the
    model's own. Normaliser: none within the pair. Returns [B].
    """
    delta = chosen_logratios - rejected_logratios
    return torch.sigmoid(beta * chosen_logratios) + (1 - torch.sigmoid(beta * delta))


def discopop_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, tau: float = 0.05
) -> torch.Tensor:
    """DiscoPOP, the log-ratio modulated loss (Chris Lu et al. 2024, arXiv:2406.08414, Eq. 5):

        z = β Δ,   w = σ(z / τ),   loss = (1 − w)·(−log σ(z)) + w·exp(−z)

    a blend of the logistic (DPO) and exponential losses; τ = `discopop_tau`, 0.05 in the paper.
    Normaliser: none within the pair. Returns [B].
    """
    z = beta * (chosen_logratios - rejected_logratios)
    w = torch.sigmoid(z / tau)
    return (1 - w) * -F.logsigmoid(z) + w * torch.exp(-z)
