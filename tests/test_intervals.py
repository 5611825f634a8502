"""The interval maths of sprout.evaluation.statistics against hand-computed cases: Wilson intervals
from the closed form (and the published 81/263 example), bootstraps drawn by hand with the
same generator, paired differences whose answer is known, the same seed giving the same
interval."""

import math
import random
from statistics import NormalDist

import numpy as np
import pytest

from sprout.evaluation.statistics import (Z95, bootstrap_means, excludes_zero, mean_interval, paired_difference_interval,
                                 percentile_interval, wilson_interval)


def wilson_by_hand(s: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = s / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize("s, n", [(0, 10), (5, 10), (10, 10), (81, 263), (1, 3)])
def test_wilson_is_the_closed_form(s, n):
    assert wilson_interval(s, n) == pytest.approx(wilson_by_hand(s, n), abs=1e-12)


def test_wilson_edges_and_known_values():
    assert wilson_interval(0, 10) == (0.0, pytest.approx(1.96**2 / (10 + 1.96**2)))  # 0/n: lo exactly 0
    assert wilson_interval(10, 10) == (pytest.approx(10 / (10 + 1.96**2)), 1.0)  # n/n: hi exactly 1
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # symmetric about 1/2
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)  # Newcombe (1998)'s example
    assert wilson_interval(0, 0) == (0.0, 1.0)  # no trials: no information
    lo, hi = wilson_interval(5, 10, z=2.576)  # a wider level is wider
    assert lo < 0.2366 and hi > 0.7634
    for bad in ((11, 10), (-1, 10), (0, -1)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_bootstrap_means_are_the_hand_drawn_resamples():
    values = [0.0, 0.25, 0.5, 1.0]
    rng = np.random.default_rng(3)
    by_hand = np.asarray(values)[rng.integers(0, 4, size=(500, 4))].mean(axis=1)
    assert np.array_equal(bootstrap_means(values, resamples=500, seed=3), by_hand)
    tail = NormalDist().cdf(-Z95)  # 0.025 for z = 1.96
    assert tail == pytest.approx(0.025, abs=1e-4)
    assert percentile_interval(by_hand) == tuple(np.percentile(by_hand, [100 * tail, 100 * (1 - tail)]))


def test_mean_interval_is_wilson_for_zero_one_scores_and_a_seeded_bootstrap_otherwise():
    assert mean_interval([1, 0, 1, 1, 0]) == wilson_interval(3, 5)
    assert mean_interval([0.0] * 8) == wilson_interval(0, 8)
    assert mean_interval([]) == (0.0, 1.0)
    assert mean_interval([0.5] * 6) == (0.5, 0.5)  # every resample has the same mean
    scores = [c / 8 for c in (0, 1, 3, 8, 2, 0, 5, 4, 7, 1)]
    lo, hi = mean_interval(scores)
    assert lo < sum(scores) / len(scores) < hi and 0.0 <= lo and hi <= 1.0
    assert mean_interval(scores) == (lo, hi)  # the same seed, the same interval
    assert not np.array_equal(bootstrap_means(scores, seed=1), bootstrap_means(scores, seed=0))  # another seed
    assert (lo, hi) == percentile_interval(bootstrap_means(scores, resamples=10_000, seed=0))
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        mean_interval([0.5, 1.5])


def test_every_problem_improving_by_one_is_a_degenerate_real_change():
    before = {f"p{i}": 0.0 for i in range(30)}
    after = {f"p{i}": 1.0 for i in range(30)}
    assert paired_difference_interval(before, after) == (1.0, 1.0, 1.0)
    assert excludes_zero(1.0, 1.0)
    assert paired_difference_interval(after, before) == (-1.0, -1.0, -1.0)


def test_identical_stages_change_nothing():
    scores = {f"p{i}": (i % 5) / 4 for i in range(40)}
    diff, lo, hi = paired_difference_interval(scores, dict(scores))
    assert (diff, lo, hi) == (0.0, 0.0, 0.0) and not excludes_zero(lo, hi)


def test_a_known_sign_and_the_pairing():
    """Four problems in five gain a quarter, the fifth loses one (or stays at 0): the change
    is positive and real, its interval narrow though the problems' scores spread from 0 to 1."""
    rnd = random.Random(0)
    before = {f"p{i}": rnd.choice([0.0, 0.25, 0.5, 0.75]) for i in range(50)}
    after = {k: v + (0.25 if i % 5 else -0.25 + 0.25 * (v == 0.0)) for i, (k, v) in enumerate(before.items())}
    d = [after[k] - before[k] for k in before]
    diff, lo, hi = paired_difference_interval(before, after)
    assert diff == pytest.approx(sum(d) / len(d)) and diff > 0
    assert 0 < lo < diff < hi and excludes_zero(lo, hi)
    assert hi - lo < 0.15
    # the same seed, the same interval, whatever the order of the mappings
    shuffled = dict(sorted(after.items(), key=lambda kv: rnd.random()))
    assert paired_difference_interval(before, shuffled) == (diff, lo, hi)
    assert paired_difference_interval(before, after, seed=7) != (diff, lo, hi)


def test_a_noisy_change_is_not_significant():
    before = {f"p{i}": 0.5 for i in range(40)}
    after = {f"p{i}": 0.5 + (0.25 if i % 2 else -0.25) + (0.25 if i == 0 else 0.0) for i in range(40)}
    diff, lo, hi = paired_difference_interval(before, after)
    assert diff == pytest.approx(0.25 / 40) and lo < 0 < hi and not excludes_zero(lo, hi)


def test_different_problems_are_refused():
    with pytest.raises(ValueError, match="same problems, got 2 and 2 \\(1 shared\\)"):
        paired_difference_interval({"a": 1.0, "b": 0.0}, {"a": 1.0, "c": 0.0})
    with pytest.raises(ValueError, match="at least one problem"):
        paired_difference_interval({}, {})


def test_excludes_zero():
    assert excludes_zero(0.01, 0.2) and excludes_zero(-0.2, -0.01)
    assert not excludes_zero(0.0, 0.2) and not excludes_zero(-0.1, 0.1) and not excludes_zero(0.0, 0.0)
