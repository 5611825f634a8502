"""sprout.losses.preference: every loss against values computed by hand with `math`, on a
2-pair batch with distinct values; finiteness of the length-normalised losses on empty and
one-token responses; the loss_type combinator; the metric sums; a few gradient steps."""

import math

import pytest
import torch

from sprout.errors import SproutError
from sprout.losses import preference as P
from sprout.losses.tokens import sequence_logps


def lsig(x: float) -> float:
    """log σ(x) = −log(1 + e^−x)."""
    return -math.log1p(math.exp(-x))


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Two pairs. Pair 1: log-ratios c = −4 − (−5) = 1, r = −6 − (−5) = −1, Δ = 2.
#            Pair 2: c = −3 − (−2.5) = −0.5, r = −2 − (−3) = 1, Δ = −1.5.
LOGP_C, LOGP_R = [-4.0, -3.0], [-6.0, -2.0]
REF_C, REF_R = [-5.0, -2.5], [-5.0, -3.0]
LEN_C, LEN_R = [4, 2], [3, 1]
C, R = [1.0, -0.5], [-1.0, 1.0]
BETA = 0.5  # β c = (0.5, −0.25), β r = (−0.5, 0.5), β Δ = (1, −0.75)


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def check(got: torch.Tensor, expected: list[float]):
    assert got.shape == (2,)
    torch.testing.assert_close(got, t(expected), rtol=1e-12, atol=1e-12)


def test_reward_pair_loss_margin_and_centering():
    rc, rr = t([2.0, -1.0]), t([0.5, 0.5])
    check(P.reward_pair_loss(rc, rr), [-lsig(1.5), -lsig(-1.5)])
    # margin 1 on the first pair; centring adds 0.01 (r_c + r_r)² = 0.01 · (6.25, 0.25)
    got = P.reward_pair_loss(rc, rr, margin=t([1.0, 0.0]), center_rewards_coefficient=0.01)
    check(got, [-lsig(0.5) + 0.0625, -lsig(-1.5) + 0.0025])


def test_sigmoid_hinge_ipo():
    c, r = t(C), t(R)
    check(P.sigmoid_loss(c, r, BETA), [math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.75))])
    check(P.hinge_loss(c, r, BETA), [0.0, 1.75])  # max(0, 1 − βΔ)
    # per-token log-ratios: 1/4 − (−1/3) = 7/12 and −0.5/2 − 1/1 = −1.25; 1/(2β) = 1
    check(P.ipo_loss(c, r, t(LEN_C), t(LEN_R), BETA), [(7 / 12 - 1) ** 2, (-1.25 - 1) ** 2])


def test_robust_and_exo_pair():
    c, r, eps = t(C), t(R), 0.1
    z = [1.0, -0.75]
    check(P.robust_loss(c, r, BETA, eps), [(0.9 * -lsig(x) + 0.1 * lsig(-x)) / 0.8 for x in z])
    check(P.robust_loss(c, r, BETA, 0.0), [-lsig(x) for x in z])  # ε = 0 is DPO
    check(
        P.exo_pair_loss(c, r, BETA, eps),
        [sig(x) * (lsig(x) - math.log(0.9)) + sig(-x) * (lsig(-x) - math.log(0.1)) for x in z],
    )


def test_bco_nca_sppo():
    c, r = t(C), t(R)
    check(P.bco_pair_loss(c, r, BETA), [-lsig(0.5) - lsig(0.5), -lsig(-0.25) - lsig(-0.5)])
    check(
        P.nca_pair_loss(c, r, BETA),
        [-lsig(0.5) - 0.5 * lsig(-0.5) - 0.5 * lsig(0.5), -lsig(-0.25) - 0.5 * lsig(0.25) - 0.5 * lsig(-0.5)],
    )
    # (c − 1/(2β))² + (r + 1/(2β))² with 1/(2β) = 1
    check(P.sppo_hard_loss(c, r, BETA), [0.0, 1.5**2 + 2.0**2])


def test_apo_zero_apo_down_discopop():
    c, r = t(C), t(R)
    check(P.apo_zero_loss(c, r, BETA), [1 - sig(0.5) + sig(-0.5), 1 - sig(-0.25) + sig(0.5)])
    check(P.apo_down_loss(c, r, BETA), [sig(0.5) + 1 - sig(1.0), sig(-0.25) + 1 - sig(-0.75)])
    # w = σ(βΔ/τ) with τ = 0.05: σ(20) and σ(−15)
    check(
        P.discopop_loss(c, r, BETA, tau=0.05),
        [(1 - sig(20.0)) * -lsig(1.0) + sig(20.0) * math.exp(-1.0),
         (1 - sig(-15.0)) * -lsig(-0.75) + sig(-15.0) * math.exp(0.75)],
    )


def test_sft_simpo_orpo():
    lc, lr, nc, nr = t(LOGP_C), t(LOGP_R), t(LEN_C), t(LEN_R)
    check(P.sft_loss(lc, nc), [4 / 4, 3 / 2])
    # per-token means: chosen (−1, −1.5), rejected (−2, −2); β = 2, γ = 0.5
    check(P.simpo_loss(lc, lr, nc, nr, beta=2.0, gamma=0.5), [-lsig(2 * 1.0 - 0.5), -lsig(2 * 0.5 - 0.5)])

    def log_odds(a):
        return a - math.log(1 - math.exp(a))

    expected = [-ac - 0.1 * lsig(log_odds(ac) - log_odds(ar)) for ac, ar in ((-1.0, -2.0), (-1.5, -2.0))]
    check(P.orpo_loss(lc, lr, nc, nr, lam=0.1), expected)


def test_log1mexp_is_accurate_where_the_naive_form_is_not_and_finite_at_zero():
    for x in (-1e-6, -1e-3, -0.5, -0.69, -0.7, -1.0, -5.0, -40.0):
        ours = P.log1mexp(torch.tensor(x, dtype=torch.float32)).item()
        assert ours == pytest.approx(math.log(-math.expm1(x)), rel=1e-5)
    naive = torch.log(1 - torch.exp(torch.tensor(-1e-6))).item()  # 1 − exp(x) cancels in float32
    assert abs(naive - math.log(-math.expm1(-1e-6))) > 1e-3
    x = torch.tensor([0.0, -1e-12, -1e-3, -50.0], requires_grad=True)
    y = P.log1mexp(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    eps = torch.finfo(torch.float32).eps
    assert y[0].item() == pytest.approx(math.log(eps), rel=1e-4)  # a certain response: log ε, not −∞
    assert x.grad[0].item() == 0.0 and x.grad[2].item() == pytest.approx(math.exp(-1e-3) / math.expm1(-1e-3), rel=1e-4)


@pytest.mark.parametrize("loss_type", ["sft", "simpo", "orpo"])
def test_length_normalised_losses_are_finite_for_empty_and_one_token_responses(loss_type):
    # pair 1: both responses empty (log-prob 0, length 0); pair 2: one token each, the chosen
    # one certain (log-prob exactly 0); pair 3: one token, log-prob just below 0
    lc = torch.tensor([0.0, 0.0, -1e-12], requires_grad=True)
    lr = torch.tensor([0.0, -2.0, -1e-9], requires_grad=True)
    nc, nr = torch.tensor([0, 1, 1]), torch.tensor([0, 1, 1])
    loss = P.preference_loss(loss_type, lc, lr, chosen_lengths=nc, rejected_lengths=nr, beta=2.0)
    loss.sum().backward()
    assert loss.shape == (3,) and torch.isfinite(loss).all()
    assert torch.isfinite(lc.grad).all()
    assert (lr.grad is None) == (loss_type == "sft")  # sft reads only the chosen response
    assert loss_type == "sft" or torch.isfinite(lr.grad).all()


def test_combinator_weights_names_and_reference_free():
    kw = dict(chosen_logps=t(LOGP_C), rejected_logps=t(LOGP_R), ref_chosen_logps=t(REF_C), ref_rejected_logps=t(REF_R),
              chosen_lengths=t(LEN_C), rejected_lengths=t(LEN_R), beta=BETA)
    sig_loss = [-lsig(1.0), -lsig(-0.75)]
    check(P.preference_loss("sigmoid", **kw), sig_loss)
    check(P.preference_loss(["sigmoid"], **kw), sig_loss)
    # MPO-style mix: 1.0 · sigmoid + 0.5 · sft, sft = (1, 1.5)
    check(P.preference_loss(["sigmoid", "sft"], loss_weights=[1.0, 0.5], **kw), [sig_loss[0] + 0.5, sig_loss[1] + 0.75])
    check(P.preference_loss(["sigmoid", "hinge"], **kw), [sig_loss[0] + 0.0, sig_loss[1] + 1.75])  # default weights 1
    # reference-free variants run without reference log-probs
    free = {k: v for k, v in kw.items() if not k.startswith("ref_")}
    check(P.preference_loss("sft", **free), [1.0, 1.5])
    with pytest.raises(ValueError, match="reference"):
        P.preference_loss("sigmoid", **free)


@pytest.mark.parametrize("loss_type", P.LOSS_TYPES)
def test_combinator_dispatches_each_name_to_its_function(loss_type):
    lc, lr, rc, rr, nc, nr = t(LOGP_C), t(LOGP_R), t(REF_C), t(REF_R), t(LEN_C), t(LEN_R)
    c, r = lc - rc, lr - rr
    direct = {
        "sigmoid": lambda: P.sigmoid_loss(c, r, BETA), "hinge": lambda: P.hinge_loss(c, r, BETA),
        "ipo": lambda: P.ipo_loss(c, r, nc, nr, BETA), "robust": lambda: P.robust_loss(c, r, BETA, 0.1),
        "exo_pair": lambda: P.exo_pair_loss(c, r, BETA, 0.1), "bco_pair": lambda: P.bco_pair_loss(c, r, BETA),
        "nca_pair": lambda: P.nca_pair_loss(c, r, BETA), "sppo_hard": lambda: P.sppo_hard_loss(c, r, BETA),
        "apo_zero": lambda: P.apo_zero_loss(c, r, BETA), "apo_down": lambda: P.apo_down_loss(c, r, BETA),
        "discopop": lambda: P.discopop_loss(c, r, BETA, 0.2), "sft": lambda: P.sft_loss(lc, nc),
        "simpo": lambda: P.simpo_loss(lc, lr, nc, nr, BETA, 0.3), "orpo": lambda: P.orpo_loss(lc, lr, nc, nr, BETA),
    }[loss_type]()
    got = P.preference_loss(loss_type, lc, lr, rc, rr, nc, nr, beta=BETA, label_smoothing=0.1, discopop_tau=0.2,
                            simpo_gamma=0.3)
    torch.testing.assert_close(got, direct.to(got.dtype))


@pytest.mark.parametrize("options, field", [
    (dict(loss_type="dpo"), "loss_type: unknown 'dpo'"),
    (dict(loss_type=[]), "loss_type: empty"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "loss_weights: 1 weights for 2"),
    (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing: the robust loss"),
    (dict(loss_type="exo_pair", label_smoothing=0.0), "label_smoothing: the exo_pair loss"),
    (dict(loss_type="ipo", beta=0.0), "beta: must be > 0"),
    (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau: must be > 0"),
])
def test_bad_options_are_one_line_errors_naming_the_field(options, field):
    with pytest.raises(SproutError, match=field):
        P.check_preference_options(**options)


def test_metric_sums_with_counts_and_ties_count_as_wrong():
    m = P.preference_metric_sums(t(LOGP_C), t(LOGP_R), t(REF_C), t(REF_R), BETA)
    # rewards β c = (0.5, −0.25), β r = (−0.5, 0.5); pair 1 right, pair 2 wrong
    expected = {"rewards/chosen": 0.25, "rewards/rejected": 0.0, "rewards/margins": (0.5 + 0.5) + (-0.25 - 0.5),
                "rewards/accuracies": 1.0, "logps/chosen": -7.0, "logps/rejected": -8.0}
    assert set(m) == set(expected)
    for name, value in expected.items():
        total, count = m[name]
        assert total.item() == pytest.approx(value, abs=1e-12) and count.item() == 2 and count.dtype == torch.int64
    # a tie (equal rewards) is not an accurate pair; without references the reward is β·logp
    tie = P.preference_metric_sums(t([-2.0]), t([-2.0]), None, None, BETA)
    assert tie["rewards/accuracies"][0].item() == 0.0 and tie["rewards/chosen"][0].item() == -1.0

    # logits/*: mean logit over the vocabulary, summed over response tokens, counted in tokens
    logits = t([[[1.0, 3.0], [0.0, 4.0], [9.0, 9.0]], [[-2.0, 0.0], [5.0, 5.0], [6.0, 8.0]]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    sums = P.mean_logit_sums(logits, mask)
    assert sums.tolist() == [2.0 + 2.0, 5.0 + 7.0]
    m = P.preference_metric_sums(t(LOGP_C), t(LOGP_R), t(REF_C), t(REF_R), BETA, chosen_logit_sums=sums,
                                 rejected_logit_sums=sums.flip(0), chosen_lengths=mask.sum(-1),
                                 rejected_lengths=torch.tensor([5, 1]))
    assert m["logits/chosen"][0].item() == 16.0 and m["logits/chosen"][1].item() == 4
    assert m["logits/rejected"][0].item() == 16.0 and m["logits/rejected"][1].item() == 6


def test_gradient_steps_on_the_sigmoid_loss_widen_the_margin():
    """A policy started at the reference (margin 0) trained on −log σ(βΔ) must come to prefer
    the chosen responses: the mean reward margin grows and every pair becomes accurate."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 7, requires_grad=True)  # rows 0, 1 chosen; 2, 3 rejected
    targets = torch.randint(0, 7, (4, 6))
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        ref, _ = sequence_logps(logits, targets, mask)
    opt = torch.optim.SGD([logits], lr=0.5)
    margins = []
    for _ in range(30):
        logp, _ = sequence_logps(logits, targets, mask)
        loss = P.sigmoid_loss(logp[:2] - ref[:2], logp[2:] - ref[2:], beta=0.1)
        m = P.preference_metric_sums(logp[:2], logp[2:], ref[:2], ref[2:], 0.1)
        margins.append(m["rewards/margins"][0].item() / 2)
        opt.zero_grad()
        (loss.sum() / 2).backward()
        opt.step()
    assert margins[0] == pytest.approx(0.0, abs=1e-6)
    assert margins[-1] > 0.1 and all(b > a for a, b in zip(margins, margins[1:]))
    assert m["rewards/accuracies"][0].item() == 2
