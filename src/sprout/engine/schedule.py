"""Schedules as pure functions of the step: learning rate, sequence length, step budget.

- Learning rate: linear warmup to the peak, then either cosine decay to `min_ratio` × peak
  (nanoGPT), WSD, warmup-stable-decay (hold the peak, decay linearly to the minimum over
  the last `decay_frac` of the run; Hu et al. 2024 "MiniCPM", Hägele et al. 2024), or constant.
- Sequence length warmup: train on short windows first, doubling from `start` up to the
  final length over the first `warmup_frac` of the steps (e.g. 128 -> 256 -> 512 over the
  first 10%; Li et al. 2022, "The Stability-Efficiency Dilemma"). The global batch stays
  fixed in tokens, so short steps simply hold more rows.
- Chinchilla budget: train for `ratio` × parameters tokens (Hoffmann et al. 2022; ~20).

Being pure functions of the step, schedules need no state in a checkpoint: the step is enough.
"""

from __future__ import annotations

import math

from sprout.errors import SproutError

LR_KINDS = ("cosine", "wsd", "constant")


def lr_at(step: int, *, peak: float, total_steps: int, warmup_steps: int = 0, kind: str = "cosine",
          min_ratio: float = 0.1, decay_frac: float = 0.2) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if kind not in LR_KINDS:
        raise SproutError(f"unknown lr schedule {kind!r} (expected one of {', '.join(LR_KINDS)})")
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    low = peak * min_ratio
    if kind == "constant":
        return peak
    if kind == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return low + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - low)
    decay_start = max(warmup_steps, total_steps - round(decay_frac * total_steps))
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
    return peak + (low - peak) * progress


def warmup_warning(warmup_steps: int, total_steps: int) -> str | None:
    """A one-line warning when the lr warmup does not end before the run does (the peak lr is
    then never reached), else None."""
    if warmup_steps >= total_steps > 0:
        return (f"warning: optim.warmup_steps {warmup_steps} >= train.max_steps {total_steps}: the lr never "
                f"reaches its peak (it ends at {min(total_steps, warmup_steps) / warmup_steps:.0%} of optim.lr)")
    return None


def seq_len_stages(final: int, start: int) -> list[int]:
    """[start, 2*start, ...] below `final`, then `final`: e.g. (512, 128) -> [128, 256, 512]."""
    stages, t = [], start
    while 0 < t < final:
        stages.append(t)
        t *= 2
    return stages + [final]


def seq_len_at(step: int, *, total_steps: int, final: int, start: int = 128, warmup_frac: float = 0.1) -> int:
    """Sequence length for `step`: shorter stages share the first `warmup_frac` of the steps equally."""
    short = seq_len_stages(final, start)[:-1]
    warm = int(warmup_frac * total_steps)
    if not short or warm <= 0 or step >= warm:
        return final
    return short[step * len(short) // warm]


def chinchilla_steps(num_params: int, global_batch_tokens: int, ratio: float = 20.0) -> int:
    """Optimizer steps for a budget of `ratio` × `num_params` tokens (at least 1)."""
    return max(1, math.ceil(ratio * num_params / global_batch_tokens))
