"""RL prompts (`sprout.formats.prompts`) for the RL stages: rendered once, seeded, split over ranks.

`PromptLoader` renders each prompt with the chat template (`sprout.chat.render`, ending on
the assistant header, so generation continues with the answer) and drops prompts longer
than `max_prompt_length` tokens (`read` and `dropped` count them); with `sources`, only
prompts of those sources are kept (`other_sources` counts the rest). The order is
`data_loader.order`'s: each epoch a permutation seeded by (seed, epoch), cut into global
batches of `global_prompts` and every global batch into one contiguous slice per rank
(`next_prompts`), so ranks never share a prompt and stay in step however many batches they
draw; its position (epoch, batch) is its `state_dict`.

`check_held_out` refuses a held-out file that shares a prompt with the train file (`overlap_key`:
case and whitespace aside).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_loader.order import EpochOrder
from sprout.chat import ChatError, render
from sprout.errors import SproutError
from sprout.formats.prompts import read_prompts
from sprout.prep.keys import conversation_key


class PromptLoader(EpochOrder):
    """The prompts of one file, rendered; this rank's slice of each seeded global batch (module doc)."""

    def __init__(self, path, tok, max_prompt_length: int, global_prompts: int = 1, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, limit: int = 0,
                 sources: list[str] | None = None):
        self.path, self.sources, self.max_prompt_length = Path(path), sources, max_prompt_length
        self.ids: list[list[int]] = []
        self.gold: list[str] = []
        self.records: list[dict] = []  # the kept records themselves (for evaluation)
        self.read, self.dropped, self.other_sources = 0, 0, 0
        for record in read_prompts(self.path):
            if limit and len(self.ids) >= limit:
                break
            self.read += 1
            if sources is not None and record["source"] not in sources:
                self.other_sources += 1
                continue
            try:
                ids, _ = render(record["prompt"], tok, add_generation_prompt=True)
            except ChatError as exc:
                raise SproutError(f"{self.path}: prompt {record['id']!r}: {exc}") from None
            if len(ids) > max_prompt_length:
                self.dropped += 1
                continue
            self.ids.append(ids)
            self.gold.append(record["gold"])
            self.records.append(record)
        if global_prompts % world_size:
            raise SproutError(f"batch.global_prompts {global_prompts} is not a multiple of {world_size} processes")
        super().__init__(self.path, len(self.ids), global_prompts // world_size, seed=seed, rank=rank,
                         world_size=world_size, shuffle=shuffle, unit="prompts",
                         keys=("batch", "num_prompts", "global_prompts"))
        self.global_prompts, self.batches_per_epoch, self.num_prompts = global_prompts, self.steps_per_epoch, len(self.ids)

    def left_out(self) -> str:
        """Why prompts read were not kept, for an error: ": 5 left out by data.sources [...]; 2 longer
        than data.max_prompt_length 64" ("" when none was left out)."""
        why = []
        if self.other_sources:
            why.append(f"{self.other_sources} left out by data.sources {list(self.sources)}")
        if self.dropped:
            why.append(f"{self.dropped} longer than data.max_prompt_length {self.max_prompt_length}")
        return f": {'; '.join(why)}" if why else ""

    def next_prompts(self) -> np.ndarray:
        """This rank's prompt indices of the next global batch (a new epoch starts when one is used up)."""
        return self.next(f"{self.global_prompts} (batch.global_prompts)")


def overlap_key(messages) -> bytes:
    """The key by which a held-out prompt is the same as a train prompt: the prep's
    `sprout.prep.keys.conversation_key` (roles and contents, lower-cased) of the messages with
    every run of whitespace in a content made one space and its ends stripped, so prompts that
    differ only in case and whitespace meet."""
    return conversation_key([{"role": m["role"], "content": " ".join(m["content"].split())} for m in messages])


def check_held_out(train: str | Path, test: str | Path, sealed: bool = False) -> None:
    """Refuse a held-out prompt file that shares a prompt with the train file: the same id, or
    the same prompt by `overlap_key` (case and whitespace aside). Held-out figures over prompts the
    policy trained on measure nothing, so every file is read whole, whatever the loaders keep of
    it. `sealed`: `test` is the sealed test file, which data.val_path cannot replace."""
    train_ids, train_keys = set(), {}
    for record in read_prompts(train):
        train_ids.add(record["id"])
        train_keys.setdefault(overlap_key(record["prompt"]), (record["id"], conversation_key(record["prompt"])))
    shared = []
    for record in read_prompts(test):
        key = overlap_key(record["prompt"])
        if record["id"] in train_ids:
            shared.append(f"id {record['id']!r}")
        elif key in train_keys:
            train_id, exact = train_keys[key]
            how = "" if exact == conversation_key(record["prompt"]) else " but for case and whitespace"
            shared.append(f"{record['id']!r}, the prompt of train id {train_id!r}{how}")
    if shared:
        raise SproutError(f"{test}: {len(shared):,} held-out prompt(s) also in the train file {train} (first: "
                          f"{shared[0]}); held-out figures must not count trained prompts: prepare the prompts "
                          f"again" + ("" if sealed else " or set data.val_path to a disjoint file"))
