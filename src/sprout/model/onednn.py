"""Matrix multiplies on oneDNN-packed weight copies: the one home of torch's private oneDNN operators.

On a CPU with oneDNN, a weight copy packed into the blocked layout oneDNN picks for a batch of
rows (`torch.ops.mkldnn._reorder_linear_weight`, as inductor's CPU weight prepacking packs)
and multiplied by `torch.ops.mkldnn._linear_pointwise` outruns MKL's matmul on the dense
weight for the few rows of a decode step, the more the wider the matrix; a oneDNN call costs
a fixed amount more than an MKL one, so narrow models keep dense weights. tests/test_onednn.py
fails, naming the operator and this module, when the pinned torch no longer has them.

A matmul weight (`matmul_weight`) is of one of three kinds, each multiplied by `linear`:

    "dense"      transposed [in, out], x @ w: an accelerator, bf16, autocast (which the packed
                 operators would bypass), or a model narrower than ONEDNN_MIN_WIDTH
    "onednn"     packed for the batch's rows
    "onednn_op"  dense, carrying its packed copy, for a compiled graph (dense tensors only):
                 `onednn_linear`, a custom op the compiler does not look into, multiplies by the copy
"""

from __future__ import annotations

import torch

ONEDNN_MIN_WIDTH = 256  # d_model from which packed matmuls outrun dense ones (see the module doc)
_PACKED = "_sprout_onednn"  # the attribute of a dense weight holding its oneDNN-packed copy ("onednn_op")


def onednn_available(weight: torch.Tensor, width: int) -> bool:
    """Whether a model of d_model `width` and parameters like `weight` multiplies faster packed: from
    `ONEDNN_MIN_WIDTH` on, float32 on a CPU with oneDNN, no CPU autocast (the packed matmul would
    bypass it), and the two operators present."""
    return (width >= ONEDNN_MIN_WIDTH and weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and not torch.is_autocast_enabled("cpu")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@torch.no_grad()
def matmul_weight(weight: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
    """`weight` [out, in] as `linear` takes it, of `kind` (see the module doc), packed for `rows` rows."""
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    dense = weight.t().contiguous()
    if kind == "onednn_op":
        setattr(dense, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight, rows))
    return dense


def linear(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """x [N, in] @ W.T -> [N, out] for a `matmul_weight(W, rows, kind)`."""
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return onednn_linear(x, weight) if kind == "onednn_op" else torch.matmul(x, weight)


@torch.library.custom_op("sprout::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight [in, out] through the packed copy attached to it, else plain (an op opaque to
    torch.compile: a graph takes the dense tensor, the packed one never enters it)."""
    packed = getattr(weight, _PACKED, None)
    if packed is None:
        return torch.matmul(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])
