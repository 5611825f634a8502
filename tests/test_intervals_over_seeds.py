"""The two-level bootstrap of sprout.evaluation.statistics (seeds, then problems): one seed, or
seeds that score alike, give the one-level bootstrap's interval exactly; the draws are the
estimator its docstring states; the interval covers a known mean about 95 % of the time on a
synthetic population of problems and seeds."""

import numpy as np
import pytest

from sprout.evaluation.statistics import (bootstrap_means, mean_interval, paired_difference_interval,
                                          percentile_interval, seeds_bootstrap_means, seeds_mean_interval,
                                          seeds_paired_difference_interval)


def scores_of(values, prefix="p"):
    return {f"{prefix}{i:03d}": v for i, v in enumerate(values)}


def test_one_seed_is_the_one_level_bootstrap():
    values = [c / 8 for c in (0, 1, 3, 8, 2, 0, 5, 4, 7, 1, 6, 6)]
    assert np.array_equal(seeds_bootstrap_means([values]), bootstrap_means(values))
    mean, lo, hi = seeds_mean_interval([scores_of(values)])
    assert mean == pytest.approx(sum(values) / len(values))
    assert (lo, hi) == percentile_interval(bootstrap_means(values)) == mean_interval(values)
    before = scores_of([c / 8 for c in (1, 1, 0, 8, 3, 2, 5, 2, 7, 0, 6, 4)])
    assert seeds_paired_difference_interval(before, [scores_of(values)]) == \
        paired_difference_interval(before, scores_of(values))


def test_seeds_that_score_alike_give_the_one_level_interval():
    values = [c / 8 for c in (0, 1, 3, 8, 2, 0, 5, 4, 7, 1)]
    assert np.array_equal(seeds_bootstrap_means([values] * 3), bootstrap_means(values))
    assert seeds_mean_interval([scores_of(values)] * 3)[1:] == percentile_interval(bootstrap_means(values))
    before = scores_of([0.5] * 10)
    assert seeds_paired_difference_interval(before, [scores_of(values)] * 3) == \
        paired_difference_interval(before, scores_of(values))


def test_the_draws_are_seeds_then_one_problem_draw_shared_by_them():
    x = np.array([[0.0, 0.25, 1.0, 0.5], [0.75, 0.5, 0.0, 1.0], [0.25, 0.25, 0.5, 0.0]])
    seed_rng, problem_rng = np.random.default_rng([5, 1]), np.random.default_rng(5)
    by_hand = []
    problems = problem_rng.integers(0, 4, size=(300, 4))
    seeds = seed_rng.integers(0, 3, size=(300, 3))
    for s, p in zip(seeds, problems):
        by_hand.append(np.mean([x[j][k] for j in s for k in p]))
    assert seeds_bootstrap_means(x, resamples=300, seed=5) == pytest.approx(by_hand, abs=1e-12)


def test_seeds_that_differ_widen_the_interval_and_the_mean_is_the_grand_mean():
    rnd = np.random.default_rng(0)
    base = rnd.integers(0, 9, size=60) / 8
    seeds = [scores_of(np.clip(base + shift, 0, 1)) for shift in (-0.25, 0.0, 0.25)]
    mean, lo, hi = seeds_mean_interval(seeds)
    assert mean == pytest.approx(np.mean([list(s.values()) for s in seeds]))
    one_lo, one_hi = mean_interval(list(seeds[1].values()))
    assert lo < mean < hi and hi - lo > one_hi - one_lo  # the seeds' spread is in the interval
    assert seeds_mean_interval(seeds) == (mean, lo, hi)  # deterministic: seed 0
    assert seeds_mean_interval(seeds, seed=1) != (mean, lo, hi)


def test_different_problems_are_refused():
    with pytest.raises(ValueError, match="same problems for every seed"):
        seeds_mean_interval([{"a": 1.0, "b": 0.0}, {"a": 1.0, "c": 0.0}])
    with pytest.raises(ValueError, match="same problems, got 2 and 1"):
        seeds_paired_difference_interval({"a": 1.0, "b": 0.0}, [{"a": 1.0}])
    with pytest.raises(ValueError, match="at least one seed"):
        seeds_mean_interval([])


def test_coverage_of_a_known_mean_over_problems_and_seeds():
    """A population of problems (difficulty p ~ U(0, 1)) and of seeds (each shifts every problem's
    chance by δ ~ N(0, 0.05)); 4 samples a problem. The mean over the population is 0.5; the
    interval over 60 drawn problems and 3 drawn seeds covers it about 95 % of the time."""
    rng = np.random.default_rng(11)
    trials, covered = 200, 0
    for _ in range(trials):
        p = rng.uniform(0, 1, size=60)
        x = [rng.binomial(4, np.clip(p + rng.normal(0, 0.05), 0, 1)) / 4 for _ in range(3)]
        lo, hi = percentile_interval(seeds_bootstrap_means(x, resamples=1000))
        covered += lo <= 0.5 <= hi
    assert 0.88 <= covered / trials <= 0.99, covered / trials


def test_one_baseline_per_seed():
    """Each seed against its own baseline: the seeds' differences d[s][i] = after[s][i] − before[s][i]
    bootstrapped over seeds and problems; one list entry per seed, or refused."""
    before = [{"a": 0.0, "b": 1.0, "c": 0.5}, {"a": 1.0, "b": 0.0, "c": 0.5}]
    after = [{"a": 1.0, "b": 1.0, "c": 0.75}, {"a": 1.0, "b": 0.5, "c": 0.5}]
    diff, lo, hi = seeds_paired_difference_interval(before, after)
    d = [[1.0, 0.0, 0.25], [0.0, 0.5, 0.0]]
    assert diff == pytest.approx(sum(map(sum, d)) / 6)
    assert (lo, hi) == percentile_interval(seeds_bootstrap_means(d))
    assert seeds_paired_difference_interval([before[0]], after[:1]) == seeds_paired_difference_interval(before[0],
                                                                                                         after[:1])
    with pytest.raises(ValueError, match="one baseline per seed, got 1 for 2"):
        seeds_paired_difference_interval(before[:1], after)
    with pytest.raises(ValueError, match="for seed 1 and its baseline"):
        seeds_paired_difference_interval([before[0], {"a": 1.0}], after)
