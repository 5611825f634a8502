"""Dedup keys and the hash split: one definition that every prep uses.

A document (pretraining text, an SFT conversation, a preference pair, an RL prompt) is
identified by `text_key(text)`: the 16-byte MD5 of its lower-cased text. Two documents
with the same key are duplicates; the first one seen is kept.

The train/val (or train/test) split is a pure function of the key, so it is stable across
re-runs, worker counts and source order, and a document can never be in both splits:
a document goes to val when the last 8 bytes of its key, read big-endian, are below
`val_frac × 2^64` (`is_val` for one key, `val_mask` for many at once, vectorised).

Structured records are keyed by a canonical text built from their fields
(`record_text`): each part on its own, joined by a separator that cannot appear in
cleaned text, so ("ab", "c") and ("a", "bc") differ.
"""

from __future__ import annotations

import hashlib

import numpy as np

from sprout.errors import SproutError

KEY_BYTES = 16
_PART_SEP = "\x1f"  # ASCII unit separator: joins the parts of a structured record


def text_key(text: str) -> bytes:
    """16-byte MD5 of the lower-cased text (cleaned text for pretraining documents)."""
    return hashlib.md5(text.lower().encode("utf-8", "surrogatepass")).digest()


def record_text(*parts: str) -> str:
    """The canonical text of a structured record (for `text_key`): parts joined unambiguously."""
    return _PART_SEP.join(parts)


def val_threshold(val_frac: float | None) -> int:
    """A key goes to val when its last 8 bytes, read big-endian, are below this number
    (val_frac of the 2^64 range)."""
    frac = float(val_frac or 0.0)
    if not 0.0 <= frac < 1.0:
        raise SproutError(f"val_frac must be in [0, 1), got {frac}")
    return min(int(frac * 2.0**64), 2**64 - 1)


def key_low(key: bytes) -> int:
    """The last 8 bytes of a key as a big-endian integer: what the split compares."""
    return int.from_bytes(key[8:KEY_BYTES], "big")


def is_val(key: bytes, val_frac: float | None) -> bool:
    """The split rule for one key (see the module docstring)."""
    return key_low(key) < val_threshold(val_frac)


def val_mask_low(lo: np.ndarray, val_frac: float | None) -> np.ndarray:
    """The split rule for many keys at once, given their last-8-byte halves as uint64."""
    return lo < np.uint64(val_threshold(val_frac))
