"""The training order every loader of whole items (packed rows, pairs, prompts) follows.

Epoch e visits the N items in the permutation drawn from `numpy.random.default_rng([seed,
e])` (0, 1, ..., N-1 with `shuffle=False`). With `world_size` W and `per_rank` B items per
rank, step s of an epoch uses permuted items [s*W*B, (s+1)*W*B), of which rank k takes the
k-th block of B, so ranks never share an item; the tail that does not fill W*B items is
skipped in that epoch (it comes first in another epoch's permutation). The position (epoch,
step) is the state dict, the same on every rank; since the order depends only on the global
batch W*B, a run may resume with another W for the same global batch, and a resume refuses
another seed, item count or global batch.
"""

from __future__ import annotations

import numpy as np

from sprout.errors import SproutError


class EpochOrder:
    """The order above for one loader. A loader names its items (`unit`: rows, pairs,
    prompts) and the keys of its state dict, which its checkpoints already carry."""

    def __init__(self, path, num_items: int, per_rank: int, *, seed: int, rank: int, world_size: int,
                 shuffle: bool, unit: str, keys: tuple[str, str, str] = ("step", "num_items", "global_batch")):
        if per_rank < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size/rank/world_size: {per_rank}/{rank}/{world_size}")
        self.path, self.num_items, self.per_rank, self.unit = path, num_items, per_rank, unit
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.step_key, self.count_key, self.batch_key = keys
        self.global_batch = per_rank * world_size
        self.steps_per_epoch = num_items // self.global_batch
        self.epoch, self.step = 0, 0
        self._perm_epoch, self._perm = None, None

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of all items (kept until another epoch is asked for)."""
        if self._perm_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.num_items) if self.shuffle else np.arange(self.num_items)
            self._perm_epoch = epoch
        return self._perm

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """The items this rank takes at (epoch, step)."""
        start = step * self.global_batch + self.rank * self.per_rank
        return self.order(epoch)[start:start + self.per_rank]

    def next(self, batch_name: str) -> np.ndarray:
        """This rank's items of the next global batch; a new epoch starts when one is used up.
        `batch_name` says in the error what the global batch is."""
        if self.steps_per_epoch == 0:
            raise SproutError(f"{self.path}: {self.num_items} {self.unit} cannot fill one global batch of "
                              f"{batch_name}")
        idx = self.indices(self.epoch, self.step)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, self.step_key: self.step, "seed": self.seed, self.count_key: self.num_items,
                self.batch_key: self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        for key, value in (("seed", self.seed), (self.count_key, self.num_items), (self.batch_key, self.global_batch)):
            if state.get(key) != value:
                raise SproutError(f"{self.path}: cannot resume: saved loader {key}={state.get(key)} "
                                  f"but this run has {value}")
        self.epoch, self.step = int(state["epoch"]), int(state[self.step_key])
