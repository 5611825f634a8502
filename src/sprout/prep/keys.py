"""Dedup keys and the hash split: one definition that every prep uses.

`text_key(text)` is the 16-byte MD5 of a document's lower-cased text (for pretraining, the
cleaned text). Two documents with the same key are duplicates and the first seen is kept; only
exact duplicates are caught. Structured records are keyed by `record_text`: each part on its
own, joined by a separator that cannot appear in cleaned text, so ("ab", "c") and ("a", "bc")
differ; a conversation by its roles and contents in order (`conversation_key`). Keys stored as
arrays are N × 16 uint8 rows, or two big-endian uint64 halves (`KEY_DTYPE`, `key_halves`).

The split is a pure function of the key, so it is stable across re-runs, worker counts and
source order, and no document is in both splits (`SplitRule` holds either rule, for manifests):
- hash-fraction (`val_frac`): val when the last 8 bytes of the key, read big-endian
  (`key_low`), are below `val_frac × 2^64` (`val_threshold`); `is_val` for one key,
  `val_mask_low` vectorised;
- hash-count (`val_docs`, pretraining only): each source's N smallest such numbers go to val.
A third split (dev, for the record preps) reads the FIRST 8 bytes the same way (`is_dev`), so it
is independent of the val/test rule.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from sprout.errors import SproutError

KEY_BYTES = 16
KEY_DTYPE = np.dtype([("hi", ">u8"), ("lo", ">u8")])  # a 16-byte key as two big-endian halves
_PART_SEP = "\x1f"  # ASCII unit separator: joins the parts of a structured record


def text_key(text: str) -> bytes:
    """16-byte MD5 of the lower-cased text (cleaned text for pretraining documents)."""
    return hashlib.md5(text.lower().encode("utf-8", "surrogatepass")).digest()


def record_text(*parts: str) -> str:
    """The canonical text of a structured record (for `text_key`): parts joined unambiguously."""
    return _PART_SEP.join(parts)


def conversation_key(messages) -> bytes:
    """The key of a conversation: `text_key` of the `record_text` of its roles and contents."""
    return text_key(record_text(*(part for m in messages for part in (m["role"], m["content"]))))


def key_halves(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) uint64 halves of N x 16 uint8 keys."""
    pairs = np.ascontiguousarray(keys, dtype=np.uint8).view(KEY_DTYPE).ravel()
    return pairs["hi"].astype(np.uint64), pairs["lo"].astype(np.uint64)


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
    """The hash-fraction rule for one key (see the module docstring)."""
    return key_low(key) < val_threshold(val_frac)


def is_dev(key: bytes, dev_frac: float | None) -> bool:
    """The dev rule for one key: its first 8 bytes, big-endian, below dev_frac × 2^64."""
    return int.from_bytes(key[:8], "big") < val_threshold(dev_frac)


def three_way_split(key: bytes, test_frac: float, dev_frac: float) -> str:
    """"test" by `is_val(key, test_frac)`, else "dev" by `is_dev(key, dev_frac)`, else "train"."""
    return "test" if is_val(key, test_frac) else "dev" if is_dev(key, dev_frac) else "train"


def val_mask_low(lo: np.ndarray, val_frac: float | None, val_docs: int | None = None) -> np.ndarray:
    """The split rule for the documents of ONE source at once, given the last-8-byte halves
    of their keys as uint64: hash-count when `val_docs` is given, else hash-fraction."""
    if val_docs is not None:
        mask = np.zeros(len(lo), dtype=bool)
        mask[np.argsort(lo, kind="stable")[:val_docs]] = True
        return mask
    return lo < np.uint64(val_threshold(val_frac))


@dataclass(frozen=True)
class SplitRule:
    val_frac: float | None = 0.01
    val_docs: int | None = None  # per source; overrides val_frac

    def mask(self, lo: np.ndarray) -> np.ndarray:
        """Which documents of one source go to val (`val_mask_low`)."""
        return val_mask_low(lo, self.val_frac, self.val_docs)

    def describe(self, text: str = "cleaned text") -> dict:
        """The rule as recorded in a manifest; `text` names what was keyed."""
        key = f"md5(lower({text})), last 8 bytes big-endian"
        if self.val_docs is not None:
            return {"method": "hash-count", "val_docs_per_source": self.val_docs,
                    "key": f"{key}; smallest N per source go to val"}
        return {"method": "hash-fraction", "val_frac": self.val_frac, "key": f"{key}; < val_frac * 2^64 goes to val"}
