"""sprout.losses.dpo and sprout.losses.preference: every loss against values computed by hand
with `math`, on a 2-pair batch with distinct values; the newer DPO variants against TRL's
formulas on random tensors; the per-pair normaliser split over micro-batches and simulated
processes, and AOT's sort within each micro-batch; finiteness of the length-normalised losses
on empty and one-token responses; the loss_type combinator; the metric sums; a few gradient
steps."""

import math

import pytest
import torch
import torch.nn.functional as F

from sprout.errors import SproutError
from sprout.losses import dpo as D
from sprout.losses.loss_types import BATCH_COUPLED, PREFERENCE_LOSS_TYPES
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
    check(D.sigmoid_loss(c, r, BETA), [math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.75))])
    check(D.hinge_loss(c, r, BETA), [0.0, 1.75])  # max(0, 1 − βΔ)
    # per-token log-ratios: 1/4 − (−1/3) = 7/12 and −0.5/2 − 1/1 = −1.25; 1/(2β) = 1
    check(D.ipo_loss(c, r, t(LEN_C), t(LEN_R), BETA), [(7 / 12 - 1) ** 2, (-1.25 - 1) ** 2])


def test_robust_and_exo_pair():
    c, r, eps = t(C), t(R), 0.1
    z = [1.0, -0.75]
    check(D.robust_loss(c, r, BETA, eps), [(0.9 * -lsig(x) + 0.1 * lsig(-x)) / 0.8 for x in z])
    check(D.robust_loss(c, r, BETA, 0.0), [-lsig(x) for x in z])  # ε = 0 is DPO
    check(
        D.exo_pair_loss(c, r, BETA, eps),
        [sig(x) * (lsig(x) - math.log(0.9)) + sig(-x) * (lsig(-x) - math.log(0.1)) for x in z],
    )


def test_bco_nca_sppo():
    c, r = t(C), t(R)
    check(D.bco_pair_loss(c, r, BETA), [-lsig(0.5) - lsig(0.5), -lsig(-0.25) - lsig(-0.5)])
    check(
        D.nca_pair_loss(c, r, BETA),
        [-lsig(0.5) - 0.5 * lsig(-0.5) - 0.5 * lsig(0.5), -lsig(-0.25) - 0.5 * lsig(0.25) - 0.5 * lsig(-0.5)],
    )
    # (c − 1/(2β))² + (r + 1/(2β))² with 1/(2β) = 1
    check(D.sppo_hard_loss(c, r, BETA), [0.0, 1.5**2 + 2.0**2])


def test_apo_zero_apo_down_discopop():
    c, r = t(C), t(R)
    check(D.apo_zero_loss(c, r, BETA), [1 - sig(0.5) + sig(-0.5), 1 - sig(-0.25) + sig(0.5)])
    check(D.apo_down_loss(c, r, BETA), [sig(0.5) + 1 - sig(1.0), sig(-0.25) + 1 - sig(-0.75)])
    # w = σ(βΔ/τ) with τ = 0.05: σ(20) and σ(−15)
    check(
        D.discopop_loss(c, r, BETA, tau=0.05),
        [(1 - sig(20.0)) * -lsig(1.0) + sig(20.0) * math.exp(-1.0),
         (1 - sig(-15.0)) * -lsig(-0.75) + sig(-15.0) * math.exp(0.75)],
    )


def test_sigmoid_norm_divides_each_log_ratio_by_its_response_tokens():
    c, r = t(C), t(R)
    # c/|y_c| − r/|y_r|: 1/4 − (−1/3) = 7/12 and −0.5/2 − 1/1 = −1.25; β = 0.5 → 7/24 and −0.625
    check(D.sigmoid_norm_loss(c, r, t(LEN_C), t(LEN_R), BETA), [-lsig(7 / 24), -lsig(-0.625)])
    # equal lengths L: DPO with β/L; an empty response divides by 1, not 0
    check(D.sigmoid_norm_loss(c, r, t([2, 2]), t([2, 2]), BETA), [-lsig(0.5), -lsig(-0.375)])
    check(D.sigmoid_norm_loss(c, r, t([0, 1]), t([0, 1]), BETA), [-lsig(1.0), -lsig(-0.75)])


def test_aot_sorts_margins_and_aot_unpaired_sorts_log_ratios_by_hand():
    lc, lr, rc, rr, eps = t(LOGP_C), t(LOGP_R), t(REF_C), t(REF_R), 0.1

    def smoothed(z):  # −(1 − ε) log σ(z) − ε log σ(−z)
        return -(1 - eps) * lsig(z) - eps * lsig(-z)

    # aot: policy margins logp_c − logp_r = (2, −1), reference margins (0, 0.5). Sorted on their
    # own: (−1, 2) and (0, 0.5), so δ = (−1, 1.5), β δ = (−0.5, 0.75); pairing without the sort
    # would give Δ = (2, −1.5) instead.
    check(D.aot_loss(lc, lr, rc, rr, BETA, eps), [smoothed(-0.5), smoothed(0.75)])
    check(D.aot_loss(lc, lr, rc, rr, BETA, 0.0), [-lsig(-0.5), -lsig(0.75)])  # ε = 0: the logistic loss
    # aot_unpaired: c = (1, −0.5) sorted (−0.5, 1), r = (−1, 1) sorted (−1, 1): δ = (0.5, 0), β δ = (0.25, 0)
    check(D.aot_unpaired_loss(t(C), t(R), BETA, eps), [smoothed(0.25), math.log(2)])
    # one pair: no sort to speak of, DPO's loss with the label smoothed (β Δ = 1 for pair 1)
    one = D.aot_loss(lc[:1], lr[:1], rc[:1], rr[:1], BETA, eps)
    assert one.item() == pytest.approx(smoothed(1.0), rel=1e-12)
    # the batch's summed loss does not depend on the order of its pairs
    flip = D.aot_loss(lc.flip(0), lr.flip(0), rc.flip(0), rr.flip(0), BETA, eps)
    torch.testing.assert_close(flip, D.aot_loss(lc, lr, rc, rr, BETA, eps))


def trl_dpo_losses(loss_type, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                   chosen_mask, rejected_mask, beta, label_smoothing):
    """TRL 1.16's DPOTrainer._compute_loss branches for these loss types, as TRL writes them (the
    default reverse-KL divergence, so its scores are the log-ratios): its per-sequence loss [B]."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
    if loss_type == "sigmoid_norm":
        chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
        return -F.logsigmoid(beta * (chosen_avg_score - rejected_avg_score))
    if loss_type == "aot":
        logratios_sorted, _ = torch.sort(chosen_logps - rejected_logps, dim=0)
        ref_logratios_sorted, _ = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)
        delta = logratios_sorted - ref_logratios_sorted
    else:  # aot_unpaired
        chosen_logratios_sorted, _ = torch.sort(chosen_logratios, dim=0)
        rejected_logratios_sorted, _ = torch.sort(rejected_logratios, dim=0)
        delta = chosen_logratios_sorted - rejected_logratios_sorted
    return -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing


def random_pairs(n: int, seed: int):
    """n pairs of random summed log-probs (policy and reference) and response masks [n, 7] with
    0 to 7 tokens, as TRL's completion_mask holds them."""
    g = torch.Generator().manual_seed(seed)
    logps = [-10 * torch.rand(n, generator=g, dtype=torch.float64) for _ in range(4)]
    masks = [(torch.arange(7)[None, :] < torch.randint(0, 8, (n, 1), generator=g)).long() for _ in range(2)]
    return logps, masks


@pytest.mark.parametrize("loss_type", ["sigmoid_norm", "aot", "aot_unpaired"])
def test_new_variants_equal_trls_formulas_on_random_tensors(loss_type):
    for seed, beta, eps in ((0, 0.1, 0.0), (1, 0.5, 0.2), (2, 2.0, 0.5)):
        (lc, lr, rc, rr), (mc, mr) = random_pairs(9, seed)
        want = trl_dpo_losses(loss_type, lc, lr, rc, rr, mc, mr, beta, eps)
        got = P.preference_loss(loss_type, lc, lr, rc, rr, mc.sum(1), mr.sum(1), beta=beta, label_smoothing=eps)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the sort matters: on these tensors aot is not the label-smoothed DPO loss of each pair
    if loss_type == "aot":
        z = 0.5 * ((lc - rc) - (lr - rr))
        assert not torch.allclose(got.sum(), (-0.5 * F.logsigmoid(z) - 0.5 * F.logsigmoid(-z)).sum())


# ---- the per-pair normaliser, split over micro-batches and processes ------------------------------

PAIRS = 8


def _pair_batch():
    """Features of both sides of 8 pairs, fixed reference log-probs, response lengths (one empty),
    and the weights every process starts from."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, PAIRS, 3, generator=g, dtype=torch.float64)  # [chosen | rejected, pair, feature]
    ref = -4 * torch.rand(2, PAIRS, generator=g, dtype=torch.float64)
    lengths = torch.tensor([[6, 1, 3, 5, 2, 6, 4, 1], [2, 4, 0, 3, 6, 1, 5, 2]])
    w0 = torch.randn(3, generator=g, dtype=torch.float64)
    return feats, ref, lengths, w0


def _pair_losses(w, rows, loss_type):
    """Per-pair losses [len(rows)] of the pairs `rows`, with log-probs ≤ 0 that move with w."""
    feats, ref, lengths, _ = _pair_batch()
    logps = -F.softplus(feats[:, rows] @ w) * lengths[:, rows].clamp(min=1)
    return P.preference_loss(loss_type, logps[0], logps[1], ref[0, rows], ref[1, rows], lengths[0, rows],
                             lengths[1, rows], beta=0.5, label_smoothing=0.1)


def _pair_split(loss_type, processes, micro_batches):
    """Simulate `processes` × `micro_batches` as the loop runs them: each micro-batch's summed
    per-pair losses × world / the global batch's pairs, backward; then the processes' gradients
    averaged (DDP). Process p takes the p-th block of micro-batches, as data_loader.order does."""
    *_, w0 = _pair_batch()
    parts = list(torch.arange(PAIRS).tensor_split(processes * micro_batches))  # uneven when it must be
    grads, total = [], 0.0
    for p in range(processes):
        w = w0.clone().requires_grad_(True)  # each process holds its own replica
        for rows in parts[p * micro_batches:(p + 1) * micro_batches]:
            per_pair = _pair_losses(w, rows, loss_type)
            (per_pair.sum() * processes / PAIRS).backward()
            total += per_pair.sum().item()
        grads.append(w.grad)
    return total / PAIRS, torch.stack(grads).mean(0)


@pytest.mark.parametrize("loss_type", [name for name in PREFERENCE_LOSS_TYPES if name not in BATCH_COUPLED])
def test_per_pair_normalisation_does_not_depend_on_the_split(loss_type):
    one_loss, one_grad = _pair_split(loss_type, 1, 1)
    for processes, micro in ((1, 4), (2, 2), (1, 3), (2, 3)):  # (1, 3) and (2, 3): pairs 3,3,2 and 2,2,1,1,1,1
        loss, grad = _pair_split(loss_type, processes, micro)
        assert loss == pytest.approx(one_loss, rel=1e-12)
        torch.testing.assert_close(grad, one_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_type", sorted(BATCH_COUPLED))
def test_aot_sorts_within_each_micro_batch_whichever_process_runs_it(loss_type):
    """The same 4 micro-batches of 2 pairs on 1 process × 4, 2 × 2 or 4 × 1: the same loss and
    gradient, the mean of TRL's loss on each micro-batch; one sort over all 8 pairs differs."""
    four_loss, four_grad = _pair_split(loss_type, 1, 4)
    for processes, micro in ((2, 2), (4, 1)):
        loss, grad = _pair_split(loss_type, processes, micro)
        assert loss == pytest.approx(four_loss, rel=1e-12)
        torch.testing.assert_close(grad, four_grad, rtol=1e-10, atol=1e-12)
    feats, ref, lengths, w0 = _pair_batch()
    trl_means = []
    for rows in torch.arange(PAIRS).tensor_split(4):
        logps = -F.softplus(feats[:, rows] @ w0) * lengths[:, rows].clamp(min=1)
        masks = [(torch.arange(7)[None, :] < lengths[side, rows, None]).long() for side in (0, 1)]
        trl_means.append(trl_dpo_losses(loss_type, logps[0], logps[1], ref[0, rows], ref[1, rows], *masks,
                                        0.5, 0.1).mean().item())
    assert four_loss == pytest.approx(sum(trl_means) / 4, rel=1e-12)
    whole_loss, _ = _pair_split(loss_type, 1, 1)
    assert abs(whole_loss - four_loss) > 1e-3  # the cut into micro-batches changes the loss


def test_padding_pairs_never_enter_the_sort():
    """An eval batch's padding pair (pair_mask False) gets 0 from aot and leaves the sort of the
    real pairs as it is without it."""
    # a padding pair in the middle, its margin 8 against the reference's 0 (c = −1, r = −9)
    lc, lr, rc, rr = (t([a[0], pad, a[1]]) for a, pad in ((LOGP_C, -1.0), (LOGP_R, -9.0), (REF_C, 0.0), (REF_R, 0.0)))
    keep = torch.tensor([True, False, True])
    for loss_type, alone in (("aot", D.aot_loss(t(LOGP_C), t(LOGP_R), t(REF_C), t(REF_R), BETA, 0.1)),
                             ("aot_unpaired", D.aot_unpaired_loss(t(C), t(R), BETA, 0.1))):
        got = P.preference_loss(loss_type, lc, lr, rc, rr, beta=BETA, label_smoothing=0.1, pair_mask=keep)
        assert got[1].item() == 0.0
        torch.testing.assert_close(got[keep], alone)
        unmasked = P.preference_loss(loss_type, lc, lr, rc, rr, beta=BETA, label_smoothing=0.1)
        assert not torch.allclose(unmasked[keep], alone)  # the padding pair would have moved the sort


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


@pytest.mark.parametrize("loss_type", PREFERENCE_LOSS_TYPES)
def test_combinator_dispatches_each_name_to_its_function(loss_type):
    lc, lr, rc, rr, nc, nr = t(LOGP_C), t(LOGP_R), t(REF_C), t(REF_R), t(LEN_C), t(LEN_R)
    c, r = lc - rc, lr - rr
    direct = {
        "sigmoid": lambda: D.sigmoid_loss(c, r, BETA), "hinge": lambda: D.hinge_loss(c, r, BETA),
        "ipo": lambda: D.ipo_loss(c, r, nc, nr, BETA), "robust": lambda: D.robust_loss(c, r, BETA, 0.1),
        "exo_pair": lambda: D.exo_pair_loss(c, r, BETA, 0.1), "bco_pair": lambda: D.bco_pair_loss(c, r, BETA),
        "nca_pair": lambda: D.nca_pair_loss(c, r, BETA), "sppo_hard": lambda: D.sppo_hard_loss(c, r, BETA),
        "sigmoid_norm": lambda: D.sigmoid_norm_loss(c, r, nc, nr, BETA),
        "aot": lambda: D.aot_loss(lc, lr, rc, rr, BETA, 0.1), "aot_unpaired": lambda: D.aot_unpaired_loss(c, r, BETA, 0.1),
        "apo_zero": lambda: D.apo_zero_loss(c, r, BETA), "apo_down": lambda: D.apo_down_loss(c, r, BETA),
        "discopop": lambda: D.discopop_loss(c, r, BETA, 0.2), "sft": lambda: P.sft_loss(lc, nc),
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
        loss = D.sigmoid_loss(logp[:2] - ref[:2], logp[2:] - ref[2:], beta=0.1)
        m = P.preference_metric_sums(logp[:2], logp[2:], ref[:2], ref[2:], 0.1)
        margins.append(m["rewards/margins"][0].item() / 2)
        opt.zero_grad()
        (loss.sum() / 2).backward()
        opt.step()
    assert margins[0] == pytest.approx(0.0, abs=1e-6)
    assert margins[-1] > 0.1 and all(b > a for a, b in zip(margins, margins[1:]))
    assert m["rewards/accuracies"][0].item() == 2
