"""Deduplication, train/val split and source mixture over per-document arrays.

Everything here works on small per-document arrays (token counts and halves of the 16-byte
dedup keys), never on text or tokens, so it is vectorised and independent of how documents were
tokenised (any number of workers gives the same plan).

- Dedup: the first occurrence of each key, in source order then document order, survives.
- Split: validation is decided by the document's key (MD5 of its cleaned, lower-cased text):
  `val_frac` sends a document to val when the key's last 8 bytes, read as a number, fall below
  val_frac * 2^64; `val_docs` sends the N documents of each source with the smallest such
  numbers. Either way it is a property of the document, so it is stable across re-runs,
  worker counts and seeds, and train and val are disjoint by construction.
- Mixture: a weight is a share of the output *train* tokens. A source is down-sampled by a
  seeded random subset of whole documents, up-sampled by whole extra passes plus a subset,
  so its share lands within one document of the target. No weights keeps every document once.
  Validation is never resampled.
- Runs (seed 004): each source's selected documents, in seeded random order, are cut into
  runs of about `run_tokens` on document boundaries, and the runs of all sources are
  shuffled together, so any stretch of the output is a fair mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from sprout.errors import SproutError

KEY_DTYPE = np.dtype([("hi", ">u8"), ("lo", ">u8")])  # a 16-byte dedup key as two big-endian halves


@dataclass(frozen=True)
class SplitRule:
    val_frac: float | None = 0.01
    val_docs: int | None = None  # per source; overrides val_frac

    def describe(self) -> dict:
        if self.val_docs is not None:
            return {"method": "hash-count", "val_docs_per_source": self.val_docs,
                    "key": "md5(lower(cleaned text)), last 8 bytes big-endian; smallest N per source go to val"}
        return {"method": "hash-fraction", "val_frac": self.val_frac,
                "key": "md5(lower(cleaned text)), last 8 bytes big-endian; < val_frac * 2^64 goes to val"}


def key_halves(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) uint64 halves of N x 16 uint8 keys."""
    pairs = np.ascontiguousarray(keys, dtype=np.uint8).view(KEY_DTYPE).ravel()
    return pairs["hi"].astype(np.uint64), pairs["lo"].astype(np.uint64)


def first_occurrences(hi: np.ndarray, full_keys: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Bool mask over documents: True for the first document with each 16-byte key.

    Documents are sorted by the keys' first halves `hi` only (8 bytes a document); those
    sharing a first half are then compared on their full keys, fetched by `full_keys(indices)`
    (rows of 16 bytes), so the answer is exact while memory stays small.
    """
    keep = np.ones(len(hi), dtype=bool)
    if len(hi) < 2:
        return keep
    order = np.argsort(hi, kind="stable")
    sorted_hi = hi[order]
    same = sorted_hi[1:] == sorted_hi[:-1]
    del sorted_hi
    if not same.any():
        return keep
    pairs = np.flatnonzero(same)
    members = np.unique(np.concatenate([order[pairs], order[pairs + 1]]))  # ascending document index
    rows = np.ascontiguousarray(full_keys(members), dtype=np.uint8).view(np.dtype("V16")).ravel()
    _, first = np.unique(rows, return_index=True)  # first occurrence among the candidates
    keep[members] = False
    keep[members[first]] = True
    return keep


def val_mask(lo: np.ndarray, rule: SplitRule) -> np.ndarray:
    """Which documents of ONE source (already deduplicated) go to validation, from the
    second halves `lo` of their keys."""
    mask = np.zeros(len(lo), dtype=bool)
    if rule.val_docs is not None:
        mask[np.argsort(lo, kind="stable")[: rule.val_docs]] = True
        return mask
    return lo < np.uint64(val_threshold(rule.val_frac))


def val_threshold(val_frac: float | None) -> int:
    """The hash-fraction rule: a document goes to val when the last 8 bytes of its key, read
    big-endian, are below this number (val_frac of the 2^64 range)."""
    frac = float(val_frac or 0.0)
    if not 0.0 <= frac < 1.0:
        raise SproutError(f"val_frac must be in [0, 1), got {frac}")
    return min(int(frac * 2.0**64), 2**64 - 1)


def token_targets(natural: list[int], weights: list[float | None], total: int | None) -> list[float]:
    """Output train tokens wanted from each source (see the module docstring)."""
    if all(w is None for w in weights):
        scale = 1.0 if total is None or sum(natural) == 0 else total / sum(natural)
        return [n * scale for n in natural]
    if any(w is None for w in weights):
        raise SproutError("give a mixture weight for every source or for none (PATH:WEIGHT)")
    wsum = float(sum(weights))
    if wsum <= 0:
        raise SproutError("mixture weights must not all be zero")
    total = sum(natural) if total is None else total
    return [w / wsum * total for w in weights]


def _shuffled(ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = ids.copy()
    rng.shuffle(out)  # in place: no int64 permutation beside a compact id array
    return out


def sample_documents(ids: np.ndarray, lengths: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """Documents from `ids` in random order (repeats allowed when up-sampling) whose token
    counts (`lengths[id]`) add up closest to `target`."""
    total = int(lengths[ids].sum(dtype=np.int64))
    if len(ids) == 0 or target <= 0 or total == 0:
        return ids[:0]
    reps = int(target // total)
    rest = target - reps * total
    parts = [_shuffled(ids, rng) for _ in range(reps)]
    last = _shuffled(ids, rng)
    cum = np.cumsum(lengths[last], dtype=np.int64)
    k = int(np.searchsorted(cum, rest))  # cum[k] >= rest
    if k < len(ids):
        below = cum[k - 1] if k > 0 else 0
        if cum[k] - rest < rest - below:
            k += 1
    parts.append(last[:k])
    return np.concatenate(parts)


def cut_runs(lengths: np.ndarray, run_tokens: int) -> list[tuple[int, int]]:
    """[start, end) ranges over a document sequence, each about `run_tokens` long."""
    n = len(lengths)
    if n == 0:
        return []
    cum = np.cumsum(lengths, dtype=np.int64)
    marks = np.arange(run_tokens, int(cum[-1]), run_tokens)
    cuts = np.searchsorted(cum, marks, side="left") + 1
    bounds = np.unique(np.concatenate([[0], cuts, [n]]))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def plan_runs(
    selections: list[np.ndarray], lengths: list[np.ndarray], run_tokens: int, rng: np.random.Generator
) -> list[tuple[int, np.ndarray]]:
    """Shuffled runs over all sources: a list of (source index, document indices)."""
    runs = []
    for src, (sel, lens) in enumerate(zip(selections, lengths)):
        for a, b in cut_runs(lens[sel], run_tokens):
            runs.append((src, sel[a:b]))
    order = rng.permutation(len(runs))
    return [runs[i] for i in order]


def plan_split(
    doc_ids: list[np.ndarray],
    lengths: list[np.ndarray],
    targets: list[float] | None,
    run_tokens: int,
    seed: int,
    split: str,
) -> list[tuple[int, np.ndarray]]:
    """Runs for one split. `doc_ids[s]` are the documents of source s in this split;
    `targets` resample them to token counts (None keeps each once, in random order)."""
    salt = {"train": 0, "val": 1}[split]
    selections = []
    for s, ids in enumerate(doc_ids):
        rng = np.random.default_rng([seed, salt, s])
        if targets is None:
            selections.append(_shuffled(ids, rng))
        else:
            selections.append(sample_documents(ids, lengths[s], targets[s], rng))
    return plan_runs(selections, lengths, run_tokens, np.random.default_rng([seed, salt, 1 << 20]))
