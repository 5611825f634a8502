"""RL prompts (`sprout.formats.prompts`) for the RL stages: rendered once, seeded, split over ranks.

`PromptLoader` renders each prompt with the chat template (`sprout.chat.render`, ending on
the assistant header, so generation continues with the answer) and drops prompts longer
than `max_prompt_length` tokens (`read` and `dropped` count them); with `sources`, only
prompts of those sources are kept (`other_sources` counts the rest). Each epoch is a permutation
seeded by (seed, epoch); the epoch is cut into global batches of `global_prompts` and every
global batch into one contiguous slice per rank (`next_prompts`), so ranks never share a
prompt and stay in step however many batches they draw. Its position (epoch, batch) is its
`state_dict`; a resume refuses a different seed, prompt count or global batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sprout.chat import ChatError, render
from sprout.errors import SproutError
from sprout.formats.prompts import read_prompts


class PromptLoader:
    """The prompts of one file, rendered; this rank's slice of each seeded global batch (module doc)."""

    def __init__(self, path, tok, max_prompt_length: int, global_prompts: int = 1, *, seed: int = 0,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, limit: int = 0,
                 sources: list[str] | None = None):
        self.path, self.seed, self.rank, self.world_size, self.shuffle = Path(path), seed, rank, world_size, shuffle
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
        self.global_prompts, self.per_rank = global_prompts, global_prompts // world_size
        self.epoch, self.batch = 0, 0

    @property
    def num_prompts(self) -> int:
        return len(self.ids)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.global_prompts

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def next_prompts(self) -> np.ndarray:
        """This rank's prompt indices of the next global batch (a new epoch starts when one is used up)."""
        if self.batches_per_epoch == 0:
            raise SproutError(f"{self.path}: {self.num_prompts} prompts cannot fill one global batch of "
                              f"{self.global_prompts} (batch.global_prompts)")
        start = self.batch * self.global_prompts + self.rank * self.per_rank
        idx = self.order(self.epoch)[start:start + self.per_rank]
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "num_prompts": self.num_prompts,
                "global_prompts": self.global_prompts}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_prompts", "global_prompts"):
            if state.get(key) != getattr(self, key):
                raise SproutError(f"{self.path}: checkpoint was made with {key} {state.get(key)}, "
                                  f"this run has {getattr(self, key)}; refusing to resume")
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
