"""Bits per byte: a loss comparable across tokenizers (parameter-golf's val_bpb).

    bpb = (sum of target NLL in nats / ln 2) / (UTF-8 bytes those targets cover)

The bytes a target token covers come from the tokenizer's lookup tables
(`Tokenizer.byte_luts()`): its base bytes, plus one byte for a SentencePiece leading
"▁" unless the previous token is a boundary (control) token, where that "▁" is the dummy
prefix rather than text. Pure table lookups, so evaluation never decodes text.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def luts_to_torch(luts: tuple[np.ndarray, np.ndarray, np.ndarray], device=None) -> tuple[Tensor, Tensor, Tensor]:
    """(base_bytes int16, has_leading_space bool, is_boundary bool) as tensors on `device`."""
    base, lead, boundary = luts
    return (
        torch.as_tensor(np.asarray(base, dtype=np.int16), device=device),
        torch.as_tensor(np.asarray(lead, dtype=bool), device=device),
        torch.as_tensor(np.asarray(boundary, dtype=bool), device=device),
    )


def token_bytes(prev_ids: Tensor, tgt_ids: Tensor, luts: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """UTF-8 bytes covered by each target token (int32, same shape as `tgt_ids`).

    `prev_ids[i]` is the token before `tgt_ids[i]` (for inputs/targets windows: the inputs).
    """
    base, lead, boundary = luts
    prev_ids, tgt_ids = prev_ids.long(), tgt_ids.long()
    nbytes = base[tgt_ids].to(torch.int32)
    return nbytes + (lead[tgt_ids] & ~boundary[prev_ids]).to(torch.int32)


def bits_per_byte(loss_sum_nats: float, n_bytes: int) -> float:
    """Total NLL in nats over some targets -> bits per byte of the text they cover."""
    if n_bytes <= 0:
        raise ValueError("bits_per_byte needs a positive byte count")
    return float(loss_sum_nats) / (math.log(2) * int(n_bytes))
