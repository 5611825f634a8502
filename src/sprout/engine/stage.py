"""The stage protocol: what a stage gives the shared loop (`sprout.engine.trainer.Trainer`).

`Stage` lists what a stage has; `TokenStage` gives the defaults for batches of token rows. A
loss is a sum over the batch's n targets, never a mean, and each metric a (sum, count) pair over
its own denominator, so the Trainer divides by counts reduced over the global batch. A stage
whose loss reads frozen models (a reference policy, a reward model) gets them from
`trainer.prepare_frozen(model)` in `setup`: placed, sharded under FSDP, in eval mode without
gradients, never in the optimizer or a checkpoint. Each stage's config has a batch section of
its own: `sprout.engine.configs.TokenBatchConfig` (tokens per step and per micro-batch) for
pretraining and SFT; rows, pairs or prompts for the others.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sprout.errors import SproutError


class Stage(Protocol):
    """What a stage has (`TokenStage` gives the defaults marked *; the required part is typed below):

        name: str
        next_micro_batches(step) -> list[dict] | None
            this rank's micro-batches of the step; None = data exhausted (every rank stops).
            Timed apart from the optimizer step: rollouts are generated here.
        generated_tokens: int                                       * 0
            tokens this rank generated in the last next_micro_batches call (generation tokens/s)
        loss(model, batch) -> (loss_sum, n, {name: (sum, count)})
            loss_sum: the loss summed over the batch's n targets (never a mean); each metric as
            its sum and its own denominator on this micro-batch: per token (KL, entropy, clip
            fraction: count = tokens), per sequence (reward, length: count = rows), per pair
            (accuracy: count = pairs). Every rank returns the same metric names.
        count_targets(batch) -> int | Tensor                        * targets.numel()
            the n that loss() will return for this batch, counted without a forward
        num_tokens(batch) -> int                                    * input_ids.numel()
            tokens the forward/backward processes (tokens seen, training tokens/s)
        flops(model, batch) -> float                                * model.flops_per_token(T) × tokens
            training FLOPs of the batch's forward + backward (MFU); 0 = no MFU
        derived_metrics(reduced) -> {name: float}                   optional; figures that are no sum / count
                                                                    (a std), from the step's reduced metrics
        evaluate(model) -> {"val_...": float}                       reduced over ranks (all_reduce_sums)
        state_dict() -> dict ; load_state_dict(dict)                loader position, saved in meta.json
        tensor_state() -> dict ; load_tensor_state(dict)            optional; this rank's tensors (rollout
                                                                    buffer, generator state) on the CPU,
                                                                    saved in train_state.pt
        param_groups(model) -> list[dict]                           optional; see sprout.engine.optim
        setup(trainer)                                              optional; called once, after a resume's
                                                                    checks and before its loading and
                                                                    training: prepare frozen models
    """

    name: str

    def next_micro_batches(self, step: int) -> list[dict[str, torch.Tensor]] | None: ...
    def loss(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple]]: ...
    def count_targets(self, batch: dict) -> int | torch.Tensor: ...
    def num_tokens(self, batch: dict) -> int: ...
    def flops(self, model, batch: dict) -> float: ...
    def evaluate(self, model) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class LoaderPosition:
    """The protocol's state_dict of a stage whose position in its data is its loader's
    (`self.loader`: `data_loader.order.EpochOrder` and the token loaders)."""

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class TokenStage(LoaderPosition):
    """The protocol's defaults for micro-batches of token rows: `input_ids` (B, T) and
    `targets` (B, T), every target trained. A stage with a loss mask overrides count_targets."""

    generated_tokens = 0

    def count_targets(self, batch: dict) -> int:
        return batch["targets"].numel()

    def num_tokens(self, batch: dict) -> int:
        return batch["input_ids"].numel()

    def flops(self, model, batch: dict) -> float:
        """Training FLOPs of the rows: the model's FLOPs per token at this row length × tokens."""
        flops_per_token = getattr(model, "flops_per_token", None)
        ids = batch["input_ids"]
        return flops_per_token(ids.shape[-1]) * ids.numel() if flops_per_token else 0.0


def micro_steps(global_size: int, micro_size: int, world_size: int, unit: str = "tokens") -> int:
    """Micro-steps per optimizer step on each process: global / (world × micro), exactly."""
    per_step = world_size * micro_size
    if micro_size <= 0 or global_size % per_step:
        raise SproutError(
            f"global batch of {global_size} {unit} is not a multiple of {world_size} process(es) × "
            f"micro-batch of {micro_size} {unit}; change batch.global_{unit} or batch.micro_{unit}"
        )
    return global_size // per_step
