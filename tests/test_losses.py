"""token_nll_sum against hand-computed values."""

import math

import pytest
import torch

from sprout.losses.tokens import token_nll_sum


def test_hand_computed_sum_and_count():
    # vocab 2, logits (0, ln 3) -> p = (1/4, 3/4); logits (0, 0) -> p = (1/2, 1/2)
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, 0.0], [0.0, math.log(3)]]])
    targets = torch.tensor([[0, 1, 1]])
    nll, n = token_nll_sum(logits, targets)
    assert n.item() == 3
    assert nll.item() == pytest.approx(math.log(4) + math.log(2) + math.log(4 / 3), rel=1e-6)

    mask = torch.tensor([[1, 0, 1]])
    nll, n = token_nll_sum(logits, targets, mask)
    assert n.item() == 2 and n.dtype == torch.int64
    assert nll.item() == pytest.approx(math.log(4) + math.log(4 / 3), rel=1e-6)


def test_masked_positions_cannot_poison_the_sum():
    logits = torch.tensor([[[0.0, 0.0], [float("nan"), float("inf")]]])
    nll, n = token_nll_sum(logits, torch.tensor([[1, 0]]), torch.tensor([[True, False]]))
    assert n.item() == 1
    assert nll.item() == pytest.approx(math.log(2), rel=1e-6)


def test_sum_not_mean_and_half_precision_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    nll, n = token_nll_sum(logits.bfloat16(), targets)
    ref = torch.nn.functional.cross_entropy(logits.bfloat16().float().view(-1, 7), targets.view(-1), reduction="sum")
    assert n.item() == 10
    assert nll.dtype == torch.float32
    assert nll.item() == pytest.approx(ref.item(), rel=1e-6)


def test_cross_entropy_matches_torch_in_value_and_gradient():
    """token_nll_sum uses a hand-written cross-entropy (for CPU memory traffic): it must equal
    F.cross_entropy, value and gradient, with and without a mask."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    mask = torch.rand(3, 7) > 0.4
    from sprout.losses.tokens import _CrossEntropyRows  # token_nll_sum itself computes in float32

    assert torch.autograd.gradcheck(lambda z: _CrossEntropyRows.apply(z, targets.reshape(-1)), (logits.reshape(-1, 50),))
    for m in (None, mask):
        got, n = token_nll_sum(logits, targets, m)
        keep = torch.ones_like(targets, dtype=torch.bool) if m is None else m
        ref = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), reduction="none")[keep.reshape(-1)].sum()
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-5)
        assert int(n) == int(keep.sum())
        g_got, = torch.autograd.grad(got, logits)
        g_ref, = torch.autograd.grad(ref, logits)
        torch.testing.assert_close(g_got.double(), g_ref, rtol=1e-5, atol=1e-6)


def test_overwrite_logits_gives_the_same_gradient_in_the_logits_memory():
    """overwrite_logits=True trades the logits' values after backward for one less logits-sized
    tensor: the gradient must be unchanged and must live in the logits' own storage."""
    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(8, 11)
    targets, mask = torch.randint(0, 11, (6,)), torch.rand(6) > 0.3
    grads, ptrs = {}, {}
    for overwrite in (False, True):
        logits = h @ w
        seen = []
        logits.register_hook(lambda g: seen.append(g.data_ptr()))
        nll, _ = token_nll_sum(logits, targets, mask, overwrite_logits=overwrite)
        grads[overwrite], = torch.autograd.grad(nll, h)
        ptrs[overwrite] = (seen[0], logits.data_ptr())
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)
    assert ptrs[True][0] == ptrs[True][1]  # the gradient was written over the logits
    assert ptrs[False][0] != ptrs[False][1]


def test_sequence_logps_matches_log_softmax_per_row_with_padding():
    """sequence_logps = per-row sum of log_softmax(logits)[target] over the mask, value and gradient;
    padding (mask 0, even NaN logits there) adds nothing, and an all-padding row gives (0, 0)."""
    from sprout.losses.tokens import sequence_logps

    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    got, n = sequence_logps(logits, targets, mask)
    ref = (logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1) * mask).sum(-1)
    assert n.tolist() == [3, 5, 0] and n.dtype == torch.int64
    assert got.dtype == torch.float32 and got[2].item() == 0.0
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    w = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)  # distinct weights: rows must stay apart
    g_got, = torch.autograd.grad((got.double() * w).sum(), logits)
    g_ref, = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-6)

    poisoned = logits.detach().clone()
    poisoned[0, 0] = float("nan")
    got2, _ = sequence_logps(poisoned, targets, mask)
    torch.testing.assert_close(got2, got.detach())
