"""KL between the policy and the reference, per token, and the controllers of its weight.

Tokens are sampled from the policy pi; KL(pi || ref) is estimated at each sampled token from
log r = log ref(x) - log pi(x) (Schulman, "Approximating KL divergence", 2020):

    k1 = -log r                unbiased, high variance, can be negative
    k2 = (log r)^2 / 2         biased, low variance, >= 0
    k3 = (r - 1) - log r       unbiased, low variance, >= 0 (TRL's GRPO KL term)

Normaliser: trainers sum a per-token estimate over completion tokens and divide by their
count (`objective/kl` in PPO is the per-sequence sum of k1, averaged over sequences).
`FixedKLController` keeps beta; `AdaptiveKLController` (Ziegler et al. 2019, TRL's) moves it
towards a target: e = clip(KL / target - 1, -0.2, 0.2), beta <- beta × (1 + e × n_steps / horizon).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_k1(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref per token."""
    return logps - ref_logps


def kl_k2(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k2 = (log ref - log pi)^2 / 2 per token."""
    return 0.5 * (ref_logps - logps) ** 2


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log ref - log pi) - (log ref - log pi) - 1 per token."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """The per-token KL estimate named by `estimator` (k1, k2 or k3)."""
    fns = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
    if estimator not in fns:
        raise ValueError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")
    return fns[estimator](logps, ref_logps)


class FixedKLController:
    """A constant KL weight."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """A KL weight steered towards `target` over `horizon` steps (module doc)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target} and {horizon}")
        super().__init__(init_kl_coef)
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current: float, n_steps: int) -> None:
        """Multiply beta by 1 + clip(current / target - 1, -0.2, 0.2) × n_steps / horizon."""
        error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
