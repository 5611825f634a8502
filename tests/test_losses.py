"""token_nll_sum against hand-computed values."""

import math

import pytest
import torch

from sprout.losses import token_nll_sum


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
