"""95 % intervals for held-out figures, and for the change of a figure between two stages.

    lo, hi = wilson_interval(81, 263)                       # a rate: 81 successes of 263
    lo, hi = mean_interval([0.25, 1.0, 0.0, 0.5])           # the mean of per-problem scores in [0, 1]
    diff, lo, hi = paired_difference_interval(before, after)  # {problem id: score} of two stages
    mean, lo, hi = seeds_mean_interval([seed_a, seed_b, seed_c])   # {problem id: score} per seed
    diff, lo, hi = seeds_paired_difference_interval(before, [seed_a, seed_b, seed_c])
    diff, lo, hi = seeds_paired_difference_interval([before_a, before_b, before_c], [seed_a, seed_b, seed_c])
    excludes_zero(lo, hi)                                   # the change is real

Every interval says how far a mean over held-out problems could move on another draw of as
many problems; over several seeds, of problems and seeds together (`seeds_bootstrap_means`).
z = 1.96. Bootstraps are seeded (`numpy.random.default_rng`, PCG64): the same scores, resamples
and seed give the same interval; problems are taken in the order of their ids. No torch here.
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


def _problem_draws(n: int, resamples: int, seed: int):
    """(first resample, its indices) chunk by chunk: `resamples` rows of n problem indices drawn
    uniformly with replacement from `numpy.random.default_rng(seed)`, in chunks whose size is a
    function of n only, so the draws do not depend on the chunking otherwise."""
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK_VALUES // n)
    for start in range(0, resamples, rows):
        yield start, rng.integers(0, n, size=(min(rows, resamples - start), n))


def bootstrap_means(values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """The means of `resamples` resamples of `values`, each as many values drawn with
    replacement (indices uniform from `numpy.random.default_rng(seed)`)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError("bootstrap_means needs a non-empty list of values")
    means = np.empty(resamples, dtype=np.float64)
    for start, idx in _problem_draws(len(v), resamples, seed):
        means[start:start + len(idx)] = v[idx].mean(axis=1)
    return means


def seeds_bootstrap_means(scores: Sequence[Sequence[float]], *, resamples: int = RESAMPLES,
                          seed: int = SEED) -> np.ndarray:
    """The two-level bootstrap of the mean over S seeds and P problems of x[s][i] (seed s's
    score on problem i; every seed scored on the same P problems, in the same order).

    Resample b draws S seeds s*_1..s*_S uniformly with replacement (numpy's default_rng
    with entropy [seed, 1]), then P problems i*_1..i*_P uniformly with replacement, the same
    draw for every drawn seed (they were scored on the same problems; the draw is
    `bootstrap_means`' with this seed), and is the mean (1 / S P) Σ_j Σ_k x[s*_j][i*_k].
    With one seed, or seeds that score alike, these are `bootstrap_means`' means of one
    seed's scores."""
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError("seeds_bootstrap_means needs one non-empty list of scores per seed, all as long")
    n_seeds, n_problems = x.shape
    seed_rng = np.random.default_rng([seed, 1])
    means = np.empty(resamples, dtype=np.float64)
    for start, idx in _problem_draws(n_problems, resamples, seed):
        drawn = seed_rng.integers(0, n_seeds, size=(len(idx), n_seeds))
        counts = (drawn[:, :, None] == np.arange(n_seeds)).sum(axis=1)  # times each seed was drawn
        per_problem = counts @ x / n_seeds  # the drawn seeds' mean score on each problem
        means[start:start + len(idx)] = np.take_along_axis(per_problem, idx, axis=1).mean(axis=1)
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


def _by_seed(seeds: Sequence[Mapping[str, float]], what: str) -> tuple[list[str], list[list[float]]]:
    """(problem ids sorted, each seed's scores in that order); refused unless every seed has the same ids."""
    if not seeds or not seeds[0]:
        raise ValueError(f"{what} needs at least one seed with at least one problem")
    ids = sorted(seeds[0])
    for i, s in enumerate(seeds[1:], start=1):
        if set(s) != set(ids):
            raise ValueError(f"{what} needs the same problems for every seed, got {len(ids)} and {len(s)} "
                             f"({len(set(s) & set(ids))} shared) for seeds 0 and {i}")
    return ids, [[float(s[i]) for i in ids] for s in seeds]


def seeds_mean_interval(seeds: Sequence[Mapping[str, float]], *, z: float = Z95, resamples: int = RESAMPLES,
                        seed: int = SEED) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean over seeds of each seed's mean over problems ({problem id:
    score} per seed, the same ids in each), and the percentile interval of
    `seeds_bootstrap_means`: another draw of seeds and of problems together."""
    _, x = _by_seed(seeds, "seeds_mean_interval")
    mean = math.fsum(math.fsum(row) / len(row) for row in x) / len(x)
    lo, hi = percentile_interval(seeds_bootstrap_means(x, resamples=resamples, seed=seed), z)
    return mean, lo, hi


def seeds_paired_difference_interval(before: Mapping[str, float] | Sequence[Mapping[str, float]],
                                     after: Sequence[Mapping[str, float]], *, z: float = Z95,
                                     resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """(diff, lo, hi): the change to the mean over the seeds of `after` ({problem id: score}
    each, the same ids in all) from `before`: one stage's scores that every seed started from,
    or a list of one baseline per seed (each seed against its own earlier checkpoint). diff =
    mean over seeds s and problems i of d[s][i] = after[s][i] − before[s][i] (before[i] for a
    single baseline), with the percentile interval of `seeds_bootstrap_means` of d: a drawn
    seed brings its baseline, a drawn problem its baseline scores. With one seed it is
    `paired_difference_interval`."""
    one = isinstance(before, Mapping)
    baselines = [before] * len(after) if one else list(before)
    if len(baselines) != len(after):
        raise ValueError(f"seeds_paired_difference_interval needs one baseline per seed, got {len(baselines)} "
                         f"for {len(after)} seeds")
    for s, (b, a) in enumerate(zip(baselines, after)):
        if set(b) != set(a):
            raise ValueError(f"seeds_paired_difference_interval needs the same problems, got {len(b)} and "
                             f"{len(a)} ({len(set(b) & set(a))} shared){'' if one else f' for seed {s} and its baseline'}")
    ids, x = _by_seed(after, "seeds_paired_difference_interval")
    d = [[row[k] - float(b[i]) for k, i in enumerate(ids)] for row, b in zip(x, baselines)]
    diff = math.fsum(math.fsum(row) / len(row) for row in d) / len(d)
    lo, hi = percentile_interval(seeds_bootstrap_means(d, resamples=resamples, seed=seed), z)
    return diff, lo, hi


def excludes_zero(lo: float, hi: float) -> bool:
    """Whether the interval [lo, hi] of a change leaves out 0 (the change is real)."""
    return lo > 0.0 or hi < 0.0
