"""Deduplication, train/val split and source weighting over per-document arrays.

Works on per-document token counts and key halves (`sprout.prep.keys`), never on text or
tokens, so it is vectorised and any number of workers gives the same plan.
- Dedup: the first occurrence of each key, in source order then document order, survives.
- Split: `sprout.prep.keys.SplitRule`, a property of each document: train and val are disjoint.
- Weighting (`resample`, shared by pretraining and SFT prep): a source's items in seeded random
  order, whole passes plus a random subset, until their sizes add up closest to a target.
  Pretraining gives each source a share of the output *train* tokens (`token_targets`; sizes
  are token counts, so a share lands within one document of its target); SFT prep multiplies a
  source's example count by its weight (sizes are 1). No weights keeps every document once.
  Validation is never resampled.
- Runs: each source's selected documents, in seeded random order, are cut into runs of about
  `run_tokens` on document boundaries, and the runs of all sources are shuffled together.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from sprout.errors import SproutError


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


def resample(ids: np.ndarray, lengths: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """Items from `ids` in random order whose sizes (`lengths[id]`) add up closest to `target`:
    floor(target / total) shuffled whole passes, then the shortest prefix of one more shuffled
    pass that comes closest to the rest (so with sizes 1 and target w * n: each of n items
    floor(w) times plus a random round((w - floor(w)) * n) of them once more)."""
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
            selections.append(resample(ids, lengths[s], targets[s], rng))
    return plan_runs(selections, lengths, run_tokens, np.random.default_rng([seed, salt, 1 << 20]))
