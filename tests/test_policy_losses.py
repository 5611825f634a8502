"""Policy losses by hand (clipping, dual clip, GSPO, RLOO's summed ratio, CISPO, SAPO, the
bias-corrected KL, value clip, entropy), each loss_type's normaliser split over micro-batches and
simulated processes, TRL's formulas on the same tensors, and pass@k by enumeration."""

import itertools
import math

import pytest
import torch

from sprout.losses.policy import (aggregate, bias_corrected_kl, cispo_clip_ratio_sums, cispo_surrogate,
                                  clip_ratio_sums, clipped_surrogate, denominator, importance_log_weights,
                                  policy_loss, sapo_surrogate, token_entropy, value_loss)
from sprout.evaluation.evaluate import mean_pass_at_k, pass_at_k
from sprout.rl.kl import kl_k3

RATIOS = torch.tensor([[0.5, 1.1, 1.5, 3.0]])


def test_clip_and_clip_higher_by_hand():
    log_w = RATIOS.log()
    pos = clipped_surrogate(log_w, torch.tensor([1.0]), epsilon=0.2, epsilon_high=0.28)
    # A = +1: -min(rho, clip(rho, 0.8, 1.28))
    torch.testing.assert_close(pos, torch.tensor([[-0.5, -1.1, -1.28, -1.28]]))
    neg = clipped_surrogate(log_w, torch.tensor([-1.0]), epsilon=0.2, epsilon_high=0.28)
    # A = -1: -min(-rho, -clip(rho)) = max(rho, clip(rho))
    torch.testing.assert_close(neg, torch.tensor([[0.8, 1.1, 1.5, 3.0]]))
    sym = clipped_surrogate(log_w, torch.tensor([1.0]), epsilon=0.2)  # epsilon_high defaults to epsilon
    torch.testing.assert_close(sym, torch.tensor([[-0.5, -1.1, -1.2, -1.2]]))


def test_delta_bounds_the_unclipped_ratio():
    neg = clipped_surrogate(RATIOS.log(), torch.tensor([-1.0]), epsilon=0.2, epsilon_high=0.28, delta=2.0)
    torch.testing.assert_close(neg, torch.tensor([[0.8, 1.1, 1.5, 2.0]]))  # rho 3 -> 2


def test_dual_clip_by_hand():
    log_w = torch.tensor([[5.0, 5.0, 0.5]]).log()
    adv = torch.tensor([[-2.0, 2.0, -2.0]])
    got = clipped_surrogate(log_w, adv, epsilon=0.2, dual_clip=3.0)
    # A=-2, rho=5: max(10, 2.4) = 10, bounded by -c A = 6; A=+2: -min(10, 2.4) = -2.4; A=-2, rho=.5: max(1, 1.6) = 1.6
    torch.testing.assert_close(got, torch.tensor([[6.0, -2.4, 1.6]]))
    with pytest.raises(ValueError):
        clipped_surrogate(log_w, adv, dual_clip=1.0)


def test_gspo_sequence_ratio_by_hand():
    logps = torch.tensor([[0.1, 0.3, 5.0], [0.2, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    log_w = importance_log_weights(logps, old, mask, "sequence")
    torch.testing.assert_close(log_w, torch.tensor([[0.2], [0.2]]))  # (0.1+0.3)/2; 0.2/1; the 5.0 is padding
    # one loss per sequence [B, 1], broadcast to its tokens by the normaliser; d/dlogp_t = -A exp(0.2) / 2
    per_token = clipped_surrogate(log_w, torch.tensor([1.0, 1.0]), epsilon=0.5)
    torch.testing.assert_close(per_token, torch.full((2, 1), -math.exp(0.2)))
    s, d = aggregate(per_token, mask, "dapo")
    assert s.item() == pytest.approx(-3 * math.exp(0.2)) and d.item() == 3  # every token of each sequence
    per_token = clipped_surrogate(log_w, torch.tensor([1.0, 1.0]), epsilon=0.5)
    per_token[0, 0].backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-math.exp(0.2) / 2] * 2 + [0.0], [0.0] * 3]))
    torch.testing.assert_close(importance_log_weights(logps, old, mask, "token"), logps)
    with pytest.raises(ValueError):
        importance_log_weights(logps, old, mask, "group")


def test_rloo_summed_sequence_ratio_by_hand():
    logps = torch.tensor([[0.1, 0.3, 5.0], [0.2, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    log_w = importance_log_weights(logps, old, mask, "sequence_sum")
    torch.testing.assert_close(log_w, torch.tensor([[0.4], [0.2]]))  # 0.1 + 0.3 (GSPO's mean: 0.2); 0.2; 5.0 is padding
    per_token = clipped_surrogate(log_w, torch.tensor([1.0, -1.0]), epsilon=0.5)
    # A = +1, rho = e^0.4 ≈ 1.49 < 1.5: -rho; A = -1, rho = e^0.2: max(rho, clip(rho)) = rho
    torch.testing.assert_close(per_token, torch.tensor([[-math.exp(0.4)], [math.exp(0.2)]]))
    s, d = aggregate(per_token, mask, "grpo")  # loss_type grpo: each sequence once, as TRL's RLOO
    assert s.item() == pytest.approx(-math.exp(0.4) + math.exp(0.2)) and d.item() == 2
    per_token[0, 0].backward()  # d/dlogp_t = -A exp(0.4) for every token of the sequence (no 1/L)
    torch.testing.assert_close(logps.grad, torch.tensor([[-math.exp(0.4)] * 2 + [0.0], [0.0] * 3]))
def test_cispo_by_hand():
    logps = torch.tensor([[-1.0, -2.0, -0.5, -1.0]], requires_grad=True)
    log_w = RATIOS.log().requires_grad_(True)
    per_token = cispo_surrogate(log_w, logps, torch.tensor([2.0]), epsilon_high=2.0)
    # weights min(rho, 2) = 0.5, 1.1, 1.5, 2.0 (3.0 capped); loss -w A log pi with A = 2:
    # -0.5·2·(-1) = 1.0, -1.1·2·(-2) = 4.4, -1.5·2·(-0.5) = 1.5, -2·2·(-1) = 4.0
    torch.testing.assert_close(per_token, torch.tensor([[1.0, 4.4, 1.5, 4.0]]))
    per_token.sum().backward()
    # d/dlog pi = -w A = -1.0, -2.2, -3.0, -4.0; the weight is a constant: no gradient through it
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, -2.2, -3.0, -4.0]]))
    assert log_w.grad is None
    m = cispo_clip_ratio_sums(RATIOS.log(), torch.tensor([2.0]), torch.ones(1, 4), epsilon_high=2.0)
    assert [x.item() for x in m["cispo_clip_ratio"]] == [1, 4]  # only rho 3 > 2 (with A > 0)
    neg = cispo_clip_ratio_sums(RATIOS.log(), torch.tensor([-2.0]), torch.ones(1, 4), epsilon_high=2.0)
    assert neg["cispo_clip_ratio"][0].item() == 0  # A < 0: never counted, as TRL


def test_sapo_by_hand():
    # A = +1, tau_pos = 1: -4 sigmoid(rho - 1); sigmoid(-0.5) = 0.377541, sigmoid(0.1) = 0.524979,
    # sigmoid(0.5) = 0.622459, sigmoid(2) = 0.880797 -> -1.51016, -2.09992, -2.48984, -3.52319
    pos = sapo_surrogate(RATIOS.log(), torch.tensor([1.0]), temperature_pos=1.0, temperature_neg=2.0)
    torch.testing.assert_close(pos, torch.tensor([[-1.51016, -2.09992, -2.48984, -3.52319]]), atol=1e-5, rtol=0)
    # A = -1, tau_neg = 2: +(4/2) sigmoid(2 (rho - 1)); sigmoid(-1) = 0.268941, sigmoid(0.2) = 0.549834,
    # sigmoid(1) = 0.731059, sigmoid(4) = 0.982014 -> 0.53788, 1.09967, 1.46212, 1.96403
    neg = sapo_surrogate(RATIOS.log(), torch.tensor([-1.0]), temperature_pos=1.0, temperature_neg=2.0)
    torch.testing.assert_close(neg, torch.tensor([[0.53788, 1.09967, 1.46212, 1.96403]]), atol=1e-5, rtol=0)
    # gradient in log rho: -4 s (1 - s) A rho. At rho = 1 (s = 1/2) it is -A, the plain
    # surrogate's; at rho = 3 with tau 1, s = sigmoid(2): -4 · 0.880797 · 0.119203 · 3 = -1.25992 (not -3)
    log_w = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    sapo_surrogate(log_w, torch.tensor([1.0])).sum().backward()
    torch.testing.assert_close(log_w.grad, torch.tensor([[-1.0, -1.25992]]), atol=1e-5, rtol=0)
    assert sapo_surrogate(torch.zeros(1, 1), torch.tensor([0.0])).item() == 0.0  # A = 0 uses tau_neg: 0 all the same


def test_bias_corrected_kl_by_hand():
    torch.testing.assert_close(bias_corrected_kl(torch.tensor([[0.1, 0.2]]), torch.tensor([[0.5, 2.0]]).log()),
                               torch.tensor([[0.05, 0.4]]))  # 0.1 × 0.5, 0.2 × 2
    # On-policy (old = the detached log-probs) the ratio is 1 but carries a gradient. log pi = 0,
    # log ref = ln 2 (r = 2): k3 = 2 - ln 2 - 1 = 0.306853, the loss value either way (A = 0 leaves
    # only beta × KL). d k3 / dlog pi = 1 - r = -1; corrected, + k3 × d rho / dlog pi = k3:
    # -1 + 0.306853 = -0.693147 = -ln 2 (the k1 estimate log pi - log ref).
    grads, values = [], []
    for corrected in (False, True):
        logps = torch.zeros(1, 1, requires_grad=True)
        ref = torch.full((1, 1), math.log(2.0))
        out = policy_loss(logps, logps.detach(), torch.zeros(1), torch.ones(1, 1), per_token_kl=kl_k3(logps, ref),
                          beta=1.0, use_bias_correction_kl=corrected)
        out.loss_sum.backward()
        grads.append(logps.grad.item())
        values.append(out.loss_sum.item())
        assert out.metrics["kl"][0].item() == pytest.approx(1 - math.log(2.0), rel=1e-6)
    assert values == pytest.approx([1 - math.log(2.0)] * 2, rel=1e-6)
    assert grads == pytest.approx([-1.0, -math.log(2.0)], rel=1e-6)


def test_value_loss_clip_by_hand():
    v, old, ret = torch.tensor([1.0, 1.0, 0.6]), torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 0.0, 2.0])
    # clip(V) = 0.7, 0.7, 0.6: max((1-2)^2, 1.3^2) = 1.69; max(1, 0.49) = 1; inside the range: 1.4^2 = 1.96
    torch.testing.assert_close(value_loss(v, old, ret, 0.2), torch.tensor([0.845, 0.5, 0.98]))


def test_normalisers_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    want = {"grpo": (2 + 4, 2), "bnpo": (10, 4), "dapo": (10, 4), "dr_grpo": (10, 2 * 3),
            "sapo": (2 + 4, 2), "cispo": (10, 4)}  # sapo as grpo, cispo as dapo (TRL's)
    for loss_type, (total, denom) in want.items():
        s, d = aggregate(per_token, mask, loss_type, max_completion_length=3)
        assert s.item() == total and d.item() == denom and d.dtype == torch.int64
        assert denominator(mask, loss_type, 3).item() == denom
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "dr_grpo")  # needs max_completion_length
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "sum")


def test_clip_ratio_metrics_by_hand():
    log_w = torch.tensor([[0.5, 1.1, 1.5], [0.5, 1.5, 1.0]]).log()
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    m = clip_ratio_sums(log_w, adv, mask, epsilon=0.2, epsilon_high=0.28)
    # row 0 (A<0): 0.5 is low-clipped, 1.5 is not (only A>0 clips high); row 1 (A>0): 1.5 is high-clipped
    assert [(s.item(), c.item()) for s, c in m.values()] == [(1, 5), (1, 5), (2, 5)]
    seq = clip_ratio_sums(torch.tensor([[0.5], [1.5]]).log(), adv, mask)  # per sequence: count rows
    assert seq["clip_ratio/region_mean"][0].item() == 2 and seq["clip_ratio/region_mean"][1].item() == 2


# ---- the global normalisation, split over micro-batches and processes ------------------------------

B, T, V, D_IN, L_MAX = 8, 6, 5, 4, 6


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 1])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    w0 = torch.randn(V, D_IN, generator=g, dtype=torch.float64)
    noise = 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return x, y, mask, adv, w0, noise


def _loss(w, rows, loss_type, epsilon_high=0.28, **kw):
    x, y, mask, adv, _, noise = _batch()
    logits = x[rows] @ w.T
    logps = logits.log_softmax(-1).gather(-1, y[rows, :, None]).squeeze(-1)
    old = logps.detach() + noise[rows]  # ratios away from 1, so some tokens clip
    ref = logps.detach() - noise[rows]
    return policy_loss(logps, old, adv[rows], mask[rows], loss_type=loss_type, max_completion_length=L_MAX,
                       epsilon=0.2, epsilon_high=epsilon_high, per_token_kl=kl_k3(logps, ref), beta=0.04,
                       entropy=token_entropy(logits), entropy_coef=0.01, **kw)


def _split(loss_type, processes, micro_batches, **kw):
    """Simulate `processes` × `micro_batches`: global denominator first, backward of
    loss_sum × world / D per micro-batch, then the processes' gradients averaged (DDP)."""
    _, _, mask, _, w0, _ = _batch()
    parts = list(torch.arange(B).tensor_split(processes * micro_batches))  # uneven when it must be
    total_denom = sum(denominator(mask[rows], loss_type, L_MAX) for rows in parts)
    grads, loss = [], 0.0
    for p in range(processes):
        w = w0.clone().requires_grad_(True)  # each process holds its own replica
        for rows in parts[p * micro_batches:(p + 1) * micro_batches]:
            out = _loss(w, rows, loss_type, **kw)
            assert out.denominator == denominator(mask[rows], loss_type, L_MAX)
            (out.loss_sum * processes / total_denom).backward()
            loss += out.loss_sum.item()
        grads.append(w.grad)
    return loss / total_denom.item(), torch.stack(grads).mean(0)


# cispo's cap 1.2 binds on some tokens (ratios exp(±0.3·N(0,1))); sapo at TRL's temperatures;
# both, and dapo once more, with the KL × the importance ratio (TRL's default)
SPLIT_CASES = {"grpo": {}, "bnpo": {}, "dapo": {}, "dr_grpo": {},
               **{f"{t}+sequence_sum": {"importance_sampling": "sequence_sum"}
                  for t in ("grpo", "bnpo", "dapo", "dr_grpo")},
               "cispo": {"epsilon_high": 1.2, "use_bias_correction_kl": True},
               "sapo": {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "use_bias_correction_kl": True},
               "dapo+bias_correction_kl": {"use_bias_correction_kl": True}}


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_global_normalisation_does_not_depend_on_the_split(case):
    loss_type, kw = case.split("+")[0], SPLIT_CASES[case]
    one_loss, one_grad = _split(loss_type, 1, 1, **kw)
    for processes, micro in ((1, 4), (2, 2), (1, 3), (2, 3)):  # (1, 3) and (2, 3): rows 3,3,2 and 2,2,1,1,1,1
        loss, grad = _split(loss_type, processes, micro, **kw)
        assert loss == pytest.approx(one_loss, rel=1e-12)
        torch.testing.assert_close(grad, one_grad, rtol=1e-10, atol=1e-12)


def test_whole_batch_matches_trl_formulas():
    x, y, mask, adv, w, noise = _batch()
    m = mask.double()
    logits = x @ w.T
    logps = logits.log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
    # the same per-token loss as _loss (log ratio -noise, KL against logps - noise), then TRL's formulas
    pt = (clipped_surrogate(-noise, adv, 0.2, 0.28) + 0.04 * kl_k3(logps, logps - noise)
          - 0.01 * token_entropy(logits))
    trl = {"grpo": ((pt * m).sum(-1) / m.sum(-1)).mean(), "bnpo": (pt * m).sum() / m.sum(),
           "dapo": (pt * m).sum() / m.sum(), "dr_grpo": (pt * m).sum() / (B * L_MAX)}
    for loss_type, want in trl.items():
        out = _loss(w, torch.arange(B), loss_type)
        assert (out.loss_sum / out.denominator).item() == pytest.approx(want.item(), rel=1e-12)
        assert out.metrics["kl"][1].item() == out.metrics["entropy"][1].item() == mask.sum().item()


def test_rloo_loss_matches_trls_rloo_formula():
    """TRL's RLOOTrainer loss on the same tensors: the per-sequence clipped loss of the summed
    log-ratio, averaged over sequences == policy_loss(sequence_sum, loss_type grpo); gradients too."""
    x, y, mask, adv, w0, noise = _batch()
    m = mask.double()

    def logps_of(w):
        logps = (x @ w.T).log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
        return logps, logps.detach() + 0.5 * noise  # summed ratios well away from 1: some clip

    w_trl = w0.clone().requires_grad_(True)  # TRL 1.16 RLOOTrainer._compute_loss
    per_token_logps, old_per_token = logps_of(w_trl)
    coef_1 = torch.exp((per_token_logps * m).sum(1) - (old_per_token * m).sum(1))
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    trl = -torch.min(coef_1 * adv, coef_2 * adv).mean()
    trl_clipped = (((coef_1 < 0.8) & (adv < 0)) | ((coef_1 > 1.28) & (adv > 0))).sum().item()
    trl.backward()

    w = w0.clone().requires_grad_(True)
    out = policy_loss(*logps_of(w), adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                      importance_sampling="sequence_sum")
    loss = out.loss_sum / out.denominator
    loss.backward()
    assert loss.item() == pytest.approx(trl.item(), rel=1e-12)
    torch.testing.assert_close(w.grad, w_trl.grad, rtol=1e-10, atol=1e-12)
    region, count = out.metrics["clip_ratio/region_mean"]  # per sequence, as TRL's
    assert count.item() == B and region.item() == trl_clipped and 0 < trl_clipped < B
def test_cispo_sapo_and_the_bias_corrected_kl_match_trl_formulas():
    """TRL 1.16's GRPOTrainer._compute_loss lines for cispo, sapo and use_bias_correction_kl,
    transcribed, on _batch's tensors (one process, one step, no entropy bonus): the same loss
    and the same gradient."""
    x, y, mask, adv, w0, noise = _batch()
    m = mask.double()
    for loss_type, epsilon_high in (("cispo", 1.2), ("sapo", None)):
        losses, grads = [], []
        for side in ("trl", "sprout"):
            w = w0.clone().requires_grad_(True)
            per_token_logps = (x @ w.T).log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
            old_per_token_logps = per_token_logps.detach() + noise
            ref_per_token_logps = per_token_logps.detach() - noise
            if side == "sprout":
                out = policy_loss(per_token_logps, old_per_token_logps, adv, mask, loss_type=loss_type,
                                  epsilon_high=epsilon_high, per_token_kl=kl_k3(per_token_logps, ref_per_token_logps),
                                  beta=0.04, use_bias_correction_kl=True)
                loss = out.loss_sum / out.denominator
            else:
                advantages = adv.unsqueeze(1)
                coef_1 = torch.exp(per_token_logps - old_per_token_logps)
                per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps)
                                - (ref_per_token_logps - per_token_logps) - 1)
                per_token_kl = per_token_kl * coef_1  # use_bias_correction_kl
                if loss_type == "cispo":
                    clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
                    per_token_loss = -clamped_ratios * advantages * per_token_logps
                else:
                    temperatures = torch.where(advantages > 0, 1.0, 1.05)  # sapo_temperature_pos, _neg defaults
                    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
                    per_token_loss = -soft_coef_1 * advantages
                per_token_loss = per_token_loss + 0.04 * per_token_kl
                if loss_type == "sapo":
                    loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
                else:  # num_items_in_batch: the completion tokens of the whole batch
                    loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
            loss.backward()
            losses.append(loss.item())
            grads.append(w.grad)
        assert losses[1] == pytest.approx(losses[0], rel=1e-12)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
        assert grads[0].abs().max() > 1e-3  # a gradient to compare


def test_entropy_by_hand_and_the_bonus_changes_the_gradient():
    assert token_entropy(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))
    assert token_entropy(torch.tensor([[0.0, -1e9]])).item() == pytest.approx(0.0, abs=1e-6)
    _, _, mask, _, w0, _ = _batch()
    losses, grads = [], []
    for coef in (0.0, 0.1):
        w = w0.clone().requires_grad_(True)
        x, y, _, adv, _, noise = _batch()
        logits = x @ w.T
        logps = logits.log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)
        out = policy_loss(logps, logps.detach() + noise, adv, mask, loss_type="dapo",
                          entropy=token_entropy(logits), entropy_coef=coef)
        (out.loss_sum / out.denominator).backward()
        losses.append(out.loss_sum / out.denominator)
        grads.append(w.grad)
        mean_entropy = out.metrics["entropy"][0] / out.metrics["entropy"][1]
    assert losses[1].item() == pytest.approx(losses[0].item() - 0.1 * mean_entropy.item(), rel=1e-12)
    assert not torch.allclose(grads[0], grads[1])


def test_value_loss_enters_with_vf_coef():
    logps = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    vl = value_loss(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]]), 0.2)
    base = policy_loss(logps, logps, torch.tensor([[1.0, 1.0]]), mask, loss_type="dapo")
    with_v = policy_loss(logps, logps, torch.tensor([[1.0, 1.0]]), mask, loss_type="dapo",
                         per_token_value_loss=vl, vf_coef=0.1)
    assert (with_v.loss_sum - base.loss_sum).item() == pytest.approx(0.1 * (0.845 + 0.5))


# ---- pass@k --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, c", [(5, 0), (5, 1), (5, 2), (6, 3), (7, 7), (8, 1)])
def test_pass_at_k_against_enumeration(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, rel=1e-12, abs=1e-15)


def test_pass_at_k_is_stable_for_large_n():
    # C(2000, 1000) overflows a float; the product form does not
    want = 1 - math.comb(1990, 1000) / math.comb(2000, 1000)
    assert pass_at_k(2000, 10, 1000) == pytest.approx(want, rel=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert mean_pass_at_k([(10, 3), (10, 0)], 1) == pytest.approx(0.15)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
