"""The oneDNN-packed matmuls: the pinned torch still has the private operators sprout.model.onednn
calls, every kind of matmul weight multiplies as x @ W.T, the compiled step's op falls back to a plain
matmul, and no other module calls torch.ops.mkldnn."""

from pathlib import Path

import pytest
import torch

from sprout.model.onednn import linear, matmul_weight, onednn_available, onednn_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("op", ["_reorder_linear_weight", "_linear_pointwise"])
def test_torch_has_the_private_onednn_operators(op):
    assert hasattr(torch.ops.mkldnn, op), (
        f"torch {torch.__version__} has no torch.ops.mkldnn.{op}, which sprout.model.onednn calls to pack "
        f"and multiply decode weights: update sprout/model/onednn.py (or pin the torch it was written for)")


@pytest.mark.parametrize("kind", ["dense", pytest.param("onednn", marks=needs_onednn),
                                  pytest.param("onednn_op", marks=needs_onednn)])
def test_every_kind_multiplies_as_the_dense_weight(kind):
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    torch.testing.assert_close(linear(x, matmul_weight(w, 4, kind), kind), x @ w.T)


def test_onednn_op_falls_back_to_a_plain_matmul():
    """The compiled step's matmul op: through the packed copy attached to the dense weight, or
    x @ w when none is (a weight built elsewhere)."""
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    torch.testing.assert_close(onednn_linear(x, matmul_weight(w, 4, "dense")), x @ w.T)
    if torch.backends.mkldnn.is_available():
        torch.testing.assert_close(onednn_linear(x, matmul_weight(w, 4, "onednn_op")), x @ w.T)


def test_narrow_models_bf16_and_autocast_keep_dense_weights():
    w = torch.randn(8, 16)
    assert not onednn_available(w, 128) and not onednn_available(w.bfloat16(), 1024)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not onednn_available(w, 1024)
    assert onednn_available(w, 256) == torch.backends.mkldnn.is_available()


def test_no_other_module_calls_the_private_operators():
    src = Path(__file__).resolve().parents[1] / "src"
    callers = [p.relative_to(src).as_posix() for p in src.rglob("*.py") if "torch.ops.mkldnn" in p.read_text()]
    assert callers == ["sprout/model/onednn.py"]
