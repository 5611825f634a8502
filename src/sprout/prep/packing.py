"""Best-fit packing of rendered SFT examples into fixed-length rows of `seq_len` tokens.

- no example is ever cut across two rows; a row holds whole examples plus padding (`pad_id`,
  mask 0);
- `segment_ids` number a row's documents 1..k (0 on padding), so attention can be restricted
  to one document; `position_ids` restart at 0 for every document (0 on padding).
Rows are filled by best-fit decreasing (longest first, ties in input order, each into the open
row with the least room that fits it, else a new row): the result depends only on the lengths.

`fit_examples` first applies the over-long policy (`overlong`):
- "truncate": keep the first `seq_len` tokens, then drop trailing untrained tokens, so a kept
  example ends with a complete assistant turn or inside an answer filling the whole row
  (counted as `truncated_open`); "drop": drop any example longer than `seq_len` (`overlong_dropped`).
Under both, an example whose first trained token lies beyond `seq_len` (`prompt_too_long`) and
one with no trained token (`no_trained_token`) are dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

OVERLONG_POLICIES = ("truncate", "drop")


@dataclass
class Packed:
    tokens: np.ndarray  # (rows, seq_len) token ids
    loss_mask: np.ndarray  # (rows, seq_len) uint8
    segment_ids: np.ndarray  # (rows, seq_len) uint16, 1..k per document, 0 = padding
    position_ids: np.ndarray  # (rows, seq_len) uint16, restart per document
    counts: dict = field(default_factory=dict)


def fit_examples(examples, seq_len: int, overlong: str = "truncate") -> tuple[list, dict]:
    """Apply the over-long policy to `(ids, mask)` pairs; returns kept pairs (numpy) and counts."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    counts = {"examples_in": 0, "truncated": 0, "truncated_open": 0, "overlong_dropped": 0,
              "prompt_too_long": 0, "no_trained_token": 0, "examples_packed": 0}
    kept = []
    for ids, mask in examples:
        counts["examples_in"] += 1
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=np.uint8)
        trained = np.flatnonzero(mask)
        if trained.size == 0:
            counts["no_trained_token"] += 1
            continue
        if trained[0] >= seq_len:
            counts["prompt_too_long"] += 1
            continue
        if len(ids) > seq_len:
            if overlong == "drop":
                counts["overlong_dropped"] += 1
                continue
            last = trained[trained < seq_len][-1]  # drop the untrained tail after the cut
            open_end = last + 1 < len(ids) and mask[last + 1] == 1  # cut inside an answer
            ids, mask = ids[:last + 1], mask[:last + 1]
            counts["truncated"] += 1
            counts["truncated_open"] += int(open_end)
        kept.append((ids, mask))
    counts["examples_packed"] = len(kept)
    return kept, counts


def best_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Best-fit decreasing: returns (row of each item, offset of each item in its row, rows)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"item lengths must be in 1..{capacity}")
    row_of = np.empty(len(lengths), dtype=np.int64)
    offset = np.empty(len(lengths), dtype=np.int64)
    open_with_room = np.zeros(capacity + 1, dtype=np.int64)  # rows having exactly r free slots
    rows_by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    n_rows = 0
    for i in np.argsort(-lengths, kind="stable"):
        need = lengths[i]
        fits = np.flatnonzero(open_with_room[need:])
        if fits.size:
            room = need + fits[0]
            row = rows_by_room[room].pop()
            open_with_room[room] -= 1
        else:
            room, row = capacity, n_rows
            n_rows += 1
        row_of[i], offset[i] = row, capacity - room
        rows_by_room[room - need].append(row)
        open_with_room[room - need] += 1
    return row_of, offset, n_rows


def pack(examples, seq_len: int, pad_id: int, overlong: str = "truncate", token_dtype=np.uint32) -> Packed:
    """Fit, then best-fit pack `(ids, mask)` pairs into `(rows, seq_len)` arrays."""
    if seq_len > np.iinfo(np.uint16).max:
        raise ValueError(f"seq_len {seq_len} exceeds the uint16 position/segment range")
    kept, counts = fit_examples(examples, seq_len, overlong)
    lengths = np.array([len(ids) for ids, _ in kept], dtype=np.int64)
    row_of, offset, n_rows = best_fit(lengths, seq_len)
    total = int(lengths.sum())
    flat_ids = np.concatenate([ids for ids, _ in kept] or [np.zeros(0, np.int64)])
    flat_mask = np.concatenate([m for _, m in kept] or [np.zeros(0, np.uint8)])
    doc_start = np.cumsum(lengths) - lengths  # where each document starts in flat_*
    within = np.arange(total) - np.repeat(doc_start, lengths)  # position inside its document
    dest = np.repeat(row_of * seq_len + offset, lengths) + within
    # segment number = 1 + rank of the document inside its row, ordered by offset
    order = np.lexsort((offset, row_of))
    is_first = np.ones(len(order), dtype=bool)
    is_first[1:] = row_of[order][1:] != row_of[order][:-1]
    first_index = np.maximum.accumulate(np.where(is_first, np.arange(len(order)), 0))
    seg = np.empty(len(order), dtype=np.int64)
    seg[order] = np.arange(len(order)) - first_index + 1

    tokens = np.full(n_rows * seq_len, pad_id, dtype=token_dtype)
    loss_mask = np.zeros(n_rows * seq_len, dtype=np.uint8)
    segment_ids = np.zeros(n_rows * seq_len, dtype=np.uint16)
    position_ids = np.zeros(n_rows * seq_len, dtype=np.uint16)
    tokens[dest] = flat_ids
    loss_mask[dest] = flat_mask
    segment_ids[dest] = np.repeat(seg, lengths)
    position_ids[dest] = within
    counts.update(rows=n_rows, tokens=total, trained_tokens=int(flat_mask.sum()),
                  pad_tokens=n_rows * seq_len - total,
                  packing_efficiency=round(total / (n_rows * seq_len), 6) if n_rows else 0.0)
    shape = (n_rows, seq_len)
    return Packed(tokens.reshape(shape), loss_mask.reshape(shape), segment_ids.reshape(shape),
                  position_ids.reshape(shape), counts)
