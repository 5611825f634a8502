"""Deduplication, train/val split and source mixture over per-document arrays.

Everything here works on small per-document arrays (token counts and 16-byte dedup keys),
never on text or tokens, so it is vectorised and independent of how documents were
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

import numpy as np

from sprout.errors import SproutError

KEY_BYTES = 16


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


def first_occurrences(keys: np.ndarray) -> np.ndarray:
    """Bool mask over rows of `keys` (N x 16 uint8): True for the first row with each key."""
    keep = np.zeros(len(keys), dtype=bool)
    if len(keys):
        flat = np.ascontiguousarray(keys, dtype=np.uint8).view(np.dtype(f"V{KEY_BYTES}")).ravel()
        _, first = np.unique(flat, return_index=True)
        keep[first] = True
    return keep


def split_numbers(keys: np.ndarray) -> np.ndarray:
    """The uint64 each document's split is decided by (last 8 key bytes, big-endian)."""
    return np.ascontiguousarray(keys[:, 8:16]).view(">u8").ravel().astype(np.uint64)


def val_mask(keys: np.ndarray, rule: SplitRule) -> np.ndarray:
    """Which documents of ONE source (already deduplicated) go to validation."""
    nums = split_numbers(keys)
    mask = np.zeros(len(nums), dtype=bool)
    if rule.val_docs is not None:
        mask[np.argsort(nums, kind="stable")[: rule.val_docs]] = True
        return mask
    frac = float(rule.val_frac or 0.0)
    if not 0.0 <= frac < 1.0:
        raise SproutError(f"val_frac must be in [0, 1), got {frac}")
    threshold = np.uint64(min(int(frac * 2.0**64), 2**64 - 1))
    return nums < threshold


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


def sample_documents(lengths: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of documents (repeats allowed) whose token counts add up closest to `target`."""
    n = len(lengths)
    total = int(lengths.sum())
    if n == 0 or target <= 0 or total == 0:
        return np.zeros(0, dtype=np.int64)
    reps = int(target // total)
    rest = target - reps * total
    parts = [rng.permutation(n) for _ in range(reps)]
    perm = rng.permutation(n)
    cum = np.cumsum(lengths[perm])
    k = int(np.searchsorted(cum, rest))  # cum[k] >= rest
    if k < n:
        below = cum[k - 1] if k > 0 else 0
        if cum[k] - rest < rest - below:
            k += 1
    parts.append(perm[:k])
    return np.concatenate(parts).astype(np.int64)


def cut_runs(lengths: np.ndarray, run_tokens: int) -> list[tuple[int, int]]:
    """[start, end) ranges over a document sequence, each about `run_tokens` long."""
    n = len(lengths)
    if n == 0:
        return []
    cum = np.cumsum(lengths)
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
            selections.append(ids[rng.permutation(len(ids))])
        else:
            selections.append(ids[sample_documents(lengths[s][ids], targets[s], rng)])
    return plan_runs(selections, lengths, run_tokens, np.random.default_rng([seed, salt, 1 << 20]))
