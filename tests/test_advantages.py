"""Group advantages, GAE, whitening, KL estimators and KL controllers against hand-computed values."""

import math

import pytest
import torch

from sprout.rl.advantages import gae, group_advantages, masked_var, masked_whiten, token_rewards
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
