"""95 % intervals for held-out figures, and for the change of a figure between two stages.

    lo, hi = wilson_interval(81, 263)                       # a rate: 81 successes of 263
    lo, hi = mean_interval([0.25, 1.0, 0.0, 0.5])           # the mean of per-problem scores in [0, 1]
    diff, lo, hi = paired_difference_interval(before, after)  # {problem id: score} of two stages
    excludes_zero(lo, hi)                                   # the change is real

Every interval is about the problems: the figures are means over held-out problems, and the
interval says how far the mean could move on another draw of as many problems (a problem's
own sampling noise is part of its score). z = 1.96 throughout. Bootstraps are seeded
(numpy's PCG64 via `numpy.random.default_rng`): the same scores, resamples and seed give the
same interval; problems are taken in the order of their ids. No torch here.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Mapping, Sequence

import numpy as np

Z95 = 1.96  # the normal quantile of a two-sided 95 % interval
RESAMPLES = 10_000  # bootstrap resamples
SEED = 0  # bootstrap seed
_CHUNK_VALUES = 1 << 21  # resampled values drawn per numpy call (memory, not the result)


def wilson_interval(successes: int | float, n: int | float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of the rate p = successes / n: centre ± half with
    centre = (p + z²/2n) / (1 + z²/n), half = z / (1 + z²/n) · √(p (1 − p) / n + z²/4n²),
    inside [0, 1], lo = 0 at 0/n and hi = 1 at n/n; (0.0, 1.0) when n is 0."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p, z2 = successes / n, z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def bootstrap_means(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """The means of `resamples` resamples of `values`, each as many values drawn with
    replacement (indices uniform from `numpy.random.default_rng(seed)`)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError("bootstrap_means needs a non-empty list of values")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK_VALUES // len(v))  # a function of len(v) only: the draws do not depend on it otherwise
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, rows):
        m = min(rows, resamples - start)
        means[start:start + m] = v[rng.integers(0, len(v), size=(m, len(v)))].mean(axis=1)
    return means


def percentile_interval(samples: np.ndarray, z: float = Z95) -> tuple[float, float]:
    """The Φ(−z) and Φ(z) quantiles of `samples` (2.5 % and 97.5 % for z = 1.96)."""
    tail = NormalDist().cdf(-z)
    lo, hi = np.percentile(samples, [100.0 * tail, 100.0 * (1.0 - tail)])
    return float(lo), float(hi)


def mean_interval(scores: Sequence[float], *, z: float = Z95, resamples: int = RESAMPLES,
                  seed: int = SEED) -> tuple[float, float]:
    """The interval of the mean of per-problem scores in [0, 1]: Wilson of (sum, count) when
    every score is 0 or 1, else the percentile bootstrap of the mean over problems (drawn with
    replacement, as many as there are); (0.0, 1.0) for no scores."""
    values = [float(s) for s in scores]
    if any(not 0.0 <= s <= 1.0 for s in values):
        raise ValueError("mean_interval needs scores in [0, 1]")
    if all(s in (0.0, 1.0) for s in values):
        return wilson_interval(int(sum(values)), len(values), z)
    return percentile_interval(bootstrap_means(values, resamples=resamples, seed=seed), z)


def paired_difference_interval(a: Mapping[str, float], b: Mapping[str, float], *, z: float = Z95,
                               resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """(mean(b) − mean(a), lo, hi) over the problems of `a` and `b` ({problem id: score}, the
    same ids in both): the percentile bootstrap of mean(d), d_i = b_i − a_i, over problems, so
    both stages' scores of a drawn problem come together and what they share cancels."""
    if set(a) != set(b):
        shared = len(set(a) & set(b))
        raise ValueError(f"paired_difference_interval needs the same problems, got {len(a)} and {len(b)} "
                         f"({shared} shared)")
    if not a:
        raise ValueError("paired_difference_interval needs at least one problem")
    ids = sorted(a)
    d = [float(b[i]) - float(a[i]) for i in ids]
    diff = math.fsum(d) / len(d)
    lo, hi = percentile_interval(bootstrap_means(d, resamples=resamples, seed=seed), z)
    return diff, lo, hi


def excludes_zero(lo: float, hi: float) -> bool:
    """Whether the interval [lo, hi] of a change leaves out 0 (the change is real)."""
    return lo > 0.0 or hi < 0.0
