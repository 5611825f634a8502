"""Group advantages, GAE, whitening, KL estimators and KL controllers against hand-computed values."""

import math

import pytest
import torch

from sprout.rl.advantages import (batch_normalize, gae, group_advantages, masked_var, masked_whiten,
                                   normalize_then_sum, token_rewards, uniform_groups)
from sprout.rl.kl import AdaptiveKLController, FixedKLController, kl_estimate, kl_k1, kl_k2, kl_k3

# two groups of G = 3: the first has mean 2 and (Bessel) std 1, the second all equal
REWARDS = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
EPS = 1e-4


def test_grpo_group_scaling_by_hand():
    out = group_advantages(REWARDS, 3, "grpo")  # default scale_rewards for grpo: group
    want = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / torch.tensor([1 + EPS] * 3 + [EPS] * 3)
    torch.testing.assert_close(out.advantages, want)
    assert out.frac_reward_zero_std == 0.5 and out.reward_std == pytest.approx(0.5)


def test_grpo_batch_and_no_scaling_by_hand():
    batch_std = math.sqrt((2.5**2 + 1.5**2 + 0.5**2 + 3 * 1.5**2) / 5)  # all six rewards, mean 3.5
    out = group_advantages(REWARDS, 3, "grpo", "batch")
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 0, 1, 0, 0, 0]) / (batch_std + EPS))
    assert out.frac_reward_zero_std == 0.5  # still counted per group
    out = group_advantages(REWARDS, 3, "grpo", "none")
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 0, 1, 0, 0, 0]))


def test_rloo_leave_one_out_by_hand():
    # baselines of group 1: (6-1)/2 = 2.5, (6-2)/2 = 2, (6-3)/2 = 1.5
    out = group_advantages(REWARDS, 3, "rloo")
    torch.testing.assert_close(out.advantages, torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]))
    out = group_advantages(REWARDS, 3, "rloo", "group")
    torch.testing.assert_close(out.advantages[:3], torch.tensor([-1.5, 0.0, 1.5]) / (1 + EPS))


def test_dr_grpo_is_mean_centred_only():
    out = group_advantages(REWARDS, 3, "dr_grpo")
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 0, 1, 0, 0, 0]))
    with pytest.raises(ValueError, match="scale_rewards must be none"):
        group_advantages(REWARDS, 3, "dr_grpo", "group")


# ---- multi_objective_aggregation: normalize_then_sum, and the batch normaliser -----------------------------------
NAN = float("nan")
# two groups of G = 3, two reward functions (weights 1 and 0.5); in group 2 both abstain on the first completion
PER_FUNCTION = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 4.0], [NAN, NAN], [5.0, 2.0], [5.0, 4.0]])


def test_normalize_then_sum_by_hand():
    s = normalize_then_sum(PER_FUNCTION, [1.0, 0.5], 3)
    # group 1: f1 [1, 2, 3] mean 2, std 1 -> z [-1, 0, 1] / (1 + eps)
    #          f2 [0, 0, 4] mean 4/3, std sqrt((16 + 16 + 64) / 9 / 2) = 4/sqrt(3)
    #             -> z [-4/3, -4/3, 8/3] / (4/sqrt(3) + eps)
    z2 = torch.tensor([-4 / 3, -4 / 3, 8 / 3]) / (4 / math.sqrt(3) + EPS)
    group1 = torch.tensor([-1.0, 0.0, 1.0]) / (1 + EPS) + 0.5 * z2  # ≈ [-1.2887, -0.2887, 1.5773]
    # group 2: row 3 unscorable (NaN); f1 [5, 5] std 0 -> z 0; f2 [2, 4] mean 3, std sqrt(2) -> z ±1/(sqrt(2) + eps)
    group2 = torch.tensor([NAN, -0.5, 0.5]) / (math.sqrt(2) + EPS)  # ≈ [nan, -0.3535, 0.3535]
    torch.testing.assert_close(s, torch.cat([group1, group2]).double(), equal_nan=True)
    with pytest.raises(ValueError):
        normalize_then_sum(PER_FUNCTION, [1.0, 0.5], 4)


def test_batch_normalize_by_hand_leaves_nan_out():
    s = normalize_then_sum(PER_FUNCTION, [1.0, 0.5], 3)
    # each group's s sums to 0, so the batch mean (5 values, the NaN left out) is 0 and the Bessel std is
    # sqrt((1.2887² + 0.2887² + 1.5773² + 2 × 0.3535²) / 4) ≈ 1.05846
    std = math.sqrt(sum(v * v for v in s.tolist() if not math.isnan(v)) / 4)
    assert std == pytest.approx(1.05846, abs=1e-5)
    want = torch.nan_to_num(s / (std + EPS), nan=0.0)  # the unscorable completion gets advantage 0
    torch.testing.assert_close(batch_normalize(s, s), want)
    # RLOO's normalize_advantages: A = [-1.5, 0, 1.5, 0, 0, 0], mean 0, std sqrt(4.5 / 5)
    a = group_advantages(REWARDS, 3, "rloo").advantages
    torch.testing.assert_close(batch_normalize(a, a), (a / (math.sqrt(0.9) + EPS)).double())


def test_batch_normalize_of_each_rank_equals_the_whole_batch():
    """Each rank normalises its own rows by the gathered global batch: together the one-process result."""
    s = normalize_then_sum(PER_FUNCTION, [1.0, 0.5], 3)
    ranks = torch.cat([batch_normalize(part, s) for part in s.split(3)])
    assert torch.equal(ranks, batch_normalize(s, s))
    assert not torch.allclose(torch.cat([batch_normalize(part, part) for part in s.split(3)]), ranks)


def trl_nanstd(t, dim=None, keepdim=False):
    """TRL 1.16's trl.trainer.utils.nanstd, transcribed."""
    mean = torch.nanmean(t, dim=dim, keepdim=True)
    variance = torch.nanmean((t - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(t), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dim) if dim is not None else std.reshape(())


def test_normalize_then_sum_and_normalize_advantages_match_trls_formulas():
    g = torch.Generator().manual_seed(0)
    G, F = 4, 3
    per_function = torch.randint(0, 3, (24, F), generator=g).double()
    per_function[torch.rand(24, F, generator=g) < 0.2] = NAN  # abstentions
    per_function[5] = NAN  # an unscorable completion
    per_function[8:12, 1] = 2.0  # a function whose values agree within a group
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    # TRL 1.16 GRPOTrainer._generate_and_score_completions, multi_objective_aggregation == "normalize_then_sum"
    grouped = per_function.view(-1, G, F)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, F)
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = NAN
    trl = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (trl_nanstd(rewards) + 1e-4), nan=0.0)
    s = normalize_then_sum(per_function, weights.tolist(), G)
    # TRL's Bessel factor count / (count - 1) divides int64 tensors, so it is float32: agreement to ~1e-7
    torch.testing.assert_close(batch_normalize(s, s), trl, rtol=1e-6, atol=1e-7)
    # TRL 1.16 RLOOTrainer, normalize_advantages=True (on the leave-one-out advantages of summed rewards)
    totals = torch.randn(24, generator=g, dtype=torch.float64)
    a = group_advantages(totals, G, "rloo").advantages
    trl = (a - torch.nanmean(a)) / (trl_nanstd(a) + 1e-4)
    torch.testing.assert_close(batch_normalize(a, a), trl, rtol=1e-6, atol=1e-7)


def test_uniform_groups_by_hand():
    assert uniform_groups(REWARDS, 3).tolist() == [False, True]
    # equal totals (1 + 0 = 0 + 1) but functions that differ: uniform as one column, not per function
    per_fn = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert uniform_groups(per_fn.sum(1), 2).tolist() == [True]
    assert uniform_groups(per_fn, 2).tolist() == [False]
    one_value = torch.tensor([[NAN, 1.0], [3.0, 1.0]])  # f1 has one value in the group: nothing to normalise
    assert uniform_groups(one_value, 2).tolist() == [True]


@pytest.mark.parametrize("kwargs", [dict(num_generations=4), dict(num_generations=1), dict(num_generations=3, advantage="ppo"),
                                    dict(num_generations=3, scale_rewards="global")])
def test_group_advantages_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        group_advantages(REWARDS, **kwargs)


def test_gae_by_hand_with_the_end_of_a_completion():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0], [0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 100.0], [0.0, 0.0, 0.0, 0.0]])  # 9 and 100 are padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # row 0: t=2 is the last token, nothing bootstrapped: delta = 1 - 0.7 = 0.3
    #        t=1: delta = 0.9*0.7 - 0.6 = 0.03, A = 0.03 + 0.72*0.3 = 0.246
    #        t=0: delta = 0.9*0.6 - 0.5 = 0.04, A = 0.04 + 0.72*0.246 = 0.21712
    a0 = [0.21712, 0.246, 0.3, 0.0]
    # row 1: values 0, reward 1 at the end: A_t = (gamma*lam)^(3-t)
    a1 = [0.72**3, 0.72**2, 0.72, 1.0]
    torch.testing.assert_close(adv, torch.tensor([a0, a1]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0], a1]))


def test_gae_lambda_one_gives_discounted_returns():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.3, -0.2, 0.9]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.5, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0]]))
    torch.testing.assert_close(adv, ret - values)


def test_token_rewards_put_the_score_on_the_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.1, 0.1, 0.1, 0.1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    got = token_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(got, torch.tensor([[-0.05, -0.1, -0.15 + 2.0, 0.0], [-0.05, -0.05, -0.05, -0.05 - 1.0]]))


def test_masked_whiten_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # masked mean 2, Bessel variance (1 + 0 + 1) / 2 = 1
    assert masked_var(values, mask).item() == pytest.approx(1.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    torch.testing.assert_close(masked_whiten(values, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))
    with pytest.raises(ValueError):
        masked_var(values, torch.tensor([[1, 0, 0, 0]]))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # log r = log(1/2)
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - 1 + math.log(2))
    assert kl_estimate(logp, ref, "k3").item() == kl_k3(logp, ref).item()
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_in_exact_expectation():
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.2, 0.6])
    kl = (pi * (pi / ref).log()).sum()
    for fn in (kl_k1, kl_k3):
        torch.testing.assert_close((pi * fn(pi.log(), ref.log())).sum(), kl)
    assert (pi * kl_k2(pi.log(), ref.log())).sum() != pytest.approx(kl.item())  # k2 is biased


def test_adaptive_kl_controller_by_hand():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(current=5.4, n_steps=100)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000))
    restored = AdaptiveKLController(0.5, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed = FixedKLController(0.05)
    fixed.update(current=100.0, n_steps=10)
    assert fixed.value == 0.05
