"""The LoRA rows of benchmarks/trl_compare.py: GRPO, DPO and SFT with adapters on both sides.

Each is its full fine-tuning row (benchmarks/trl_compare_rows.py, trl_compare_grpo.py) run with `Bench.lora` set:
sprout's model gains LoRA adapters through `sprout.model.lora.add_adapters` (a stage's `lora`
section: r, alpha, dropout, every linear layer of the blocks), TRL's trainer gets the same
settings as a peft `LoraConfig` (`peft_config=`, which it applies with `get_peft_model`); DPO's
reference is the policy with its adapters off on both sides. Both sides start with B = 0
(peft's initialisation; each side draws its own A), so the first batch's loss is the base's on
both, as in the full rows. Each check then runs once more with the same non-zero adapters on
both models (`Adapters.same_adapters`: TRL's A, B drawn at random, copied into sprout's), which
compares the adapters' arithmetic (targets, scale, the reference with them off) as well.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from trl_compare_grpo import grpo
from trl_compare_rows import Bench, Row, dpo, sft
from sprout.engine.configs import LoraConfig
from sprout.lora_weights import lora_scale, sprout_adapter_state
from sprout.model.lora import AdaptersOff, add_adapters

TARGET = 1.3  # sprout's LoRA step speed over TRL+peft's, every row


@dataclass(frozen=True)
class Adapters:
    """The adapter settings of both sides, on every linear layer of the blocks; `std`: the
    spread of B in the checks with non-zero adapters."""
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    std: float = 0.02

    def add(self, model) -> None:
        """sprout's adapters in `model`, in place, as a stage's `lora` section adds them."""
        add_adapters(model, LoraConfig(r=self.r, alpha=self.alpha, dropout=self.dropout,
                                       target_modules=["all-linear"]), seed=0)

    @staticmethod
    def reference(policy):
        """DPO's reference of a LoRA policy: the policy with its adapters off, as the stage makes it."""
        return AdaptersOff(policy)

    def peft_config(self):
        """What TRL's trainers take as `peft_config`: the same adapters (peft's all-linear leaves out lm_head)."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules="all-linear",
                              task_type="CAUSAL_LM")

    def describe(self) -> str:
        return (f"LoRA r {self.r}, alpha {self.alpha:g} (scale {lora_scale(self.r, self.alpha):g}), dropout "
                f"{self.dropout:g}, on every linear layer of the blocks in both (TRL: peft_config); B = 0 at the "
                f"start on both sides, so the first-batch check compares the base's loss; the adapted checks give "
                f"TRL's model B ~ N(0, {self.std:g}) and copy its A and B into a sprout model")

    @contextmanager
    def same_adapters(self, trl_model, model):
        """Within: TRL's peft model `trl_model` has B drawn from N(0, std) (seed 0) and `model`
        (sprout's) holds TRL's A and B; both models' adapters are as before on exit. A target
        that one side adapts and the other does not is refused."""
        trl_params = {k: p for k, p in trl_model.named_parameters() if ".lora_A." in k or ".lora_B." in k}
        ours = {k: p for k, p in model.named_parameters() if ".lora_" in k}
        saved = [(p, p.detach().clone()) for p in [*trl_params.values(), *ours.values()]]
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for k, p in trl_params.items():
                if ".lora_B." in k:
                    p.copy_(torch.randn(p.shape, generator=g) * self.std)
            theirs = sprout_adapter_state({k: p.detach() for k, p in trl_params.items()}, "TRL's adapters")
            if set(theirs) != set(ours):
                odd = sorted(set(theirs) ^ set(ours))
                raise RuntimeError(f"TRL and sprout adapt different layers: {len(odd)} adapter tensors on one side "
                                   f"only, {odd[0]} the first")
            for k, v in theirs.items():
                ours[k].copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in saved:
                    p.copy_(value)


def lora_row(row: Callable[[Bench], Row], b: Bench, name: str) -> Row:
    """`row` run with LoRA adapters on both sides (--lora-r, --lora-alpha), named `name`, its target TARGET."""
    adapters = Adapters(r=b.args.lora_r, alpha=b.args.lora_alpha)
    out = row(dataclasses.replace(b, lora=adapters))
    return dataclasses.replace(out, name=name, target=TARGET, notes=[adapters.describe(), *out.notes])


def grpo_lora(b: Bench) -> Row:
    return lora_row(grpo, b, "GRPO LoRA step")


def dpo_lora(b: Bench) -> Row:
    return lora_row(dpo, b, "DPO LoRA step")


def sft_lora(b: Bench) -> Row:
    return lora_row(sft, b, "SFT LoRA step")
