"""LoRA adapters as tensors: their names in a checkpoint, merging them into a base's weights, and
the names of PEFT's adapter files. No peft and no model here (`sprout.model.lora` puts adapters
on a live model): what a checkpoint reader needs to turn a LoRA run into plain weights.

A LoRA checkpoint names its tensors as the module names them under peft: the adapters of linear
layer X are `X.lora_A.default.weight` (A [r, in]) and `X.lora_B.default.weight` (B [out, r]); the
merged weight is W + s B A, s = alpha / r (alpha / sqrt(r) with use_rslora). PEFT's
adapter_model.safetensors for the exported transformers model names them
`base_model.model.model.X.lora_A.weight` (sprout's module names are LlamaForCausalLM's without its
leading `model.`).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from sprout.errors import SproutError

ADAPTER = "default"  # peft's adapter name; sprout trains one adapter per run
_A = re.compile(rf"^(.*)\.lora_A\.{ADAPTER}\.weight$")
_B = re.compile(rf"^(.*)\.lora_B\.{ADAPTER}\.weight$")


def lora_scale(r: int, alpha: float, use_rslora: bool = False) -> float:
    """s of y = W x + s B A x: alpha / r, or alpha / sqrt(r) (rank-stabilised, Kalajdzievski 2023)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def is_lora_layer(module: nn.Module) -> bool:
    """Whether `module` is a peft LoRA layer (its `base_layer` beside `lora_A` and `lora_B`)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def has_adapters(model: nn.Module) -> bool:
    """Whether `model` holds peft LoRA layers."""
    return any(is_lora_layer(m) for m in model.modules())


def adapter_pairs(adapters: dict[str, torch.Tensor], where: str = "adapters") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} of a checkpoint's adapter tensors (`...X.lora_A.default.weight`
    -> `X.weight`); an A without its B (or the reverse) is refused, naming `where` (the file)."""
    a = {m.group(1): v for k, v in adapters.items() if (m := _A.match(k))}
    b = {m.group(1): v for k, v in adapters.items() if (m := _B.match(k))}
    if set(a) != set(b):
        odd = sorted(set(a) ^ set(b))[0]
        raise SproutError(f"{where}: adapter tensors of {odd} have lora_A or lora_B but not both")
    return {f"{name}.weight": (a[name], b[name]) for name in a}


def merge_adapters(base: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], scale: float,
                   where: str = "adapters") -> dict[str, torch.Tensor]:
    """A plain model's state dict: `base` with each adapted weight W + scale B A, and every other
    tensor of `saved` (a scalar head) as it is. `where` names the file in errors: an adapter
    for a weight the base lacks, or of another shape, is refused naming both."""
    merged = dict(base)
    for name, (A, B) in adapter_pairs(saved, where).items():
        if name not in base:
            raise SproutError(f"{where}: adapter for {name}, which the base model has no weight for; "
                              f"adapters saved for another base")
        W = base[name]
        if tuple(B.shape[:1]) + tuple(A.shape[1:]) != tuple(W.shape) or A.shape[0] != B.shape[1]:
            raise SproutError(f"{where}: adapter of {name} is {tuple(B.shape)} x {tuple(A.shape)}, the base's weight "
                              f"{tuple(W.shape)}; adapters saved for another base")
        merged[name] = (W.float() + scale * (B.float() @ A.float())).to(W.dtype)
    for name, value in saved.items():
        if not (_A.match(name) or _B.match(name)):
            merged[name] = value
    return merged


def peft_adapter_state(saved: dict[str, torch.Tensor], prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    """A checkpoint's adapter tensors under the names of PEFT's adapter_model.safetensors for the
    exported transformers model: `prefix` + `model.` + the sprout name without `.default`
    (sprout's names are LlamaForCausalLM's without its `model.`)."""
    return {f"{prefix}model.{k.replace(f'.{ADAPTER}.', '.')}": v for k, v in saved.items()
            if _A.match(k) or _B.match(k)}


def sprout_adapter_state(peft_state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The inverse of `peft_adapter_state`: a PEFT adapter file's tensors under sprout's names;
    a tensor that is no lora_A / lora_B of a layer of the model's body is refused."""
    out = {}
    pattern = re.compile(r"^base_model\.model\.model\.(layers\.\d+\..+)\.(lora_[AB])(?:\.[^.]+)?\.weight$")
    for k, v in peft_state.items():
        m = pattern.match(k)
        if m is None:
            raise SproutError(f"{where}: tensor {k} is not a LoRA A or B of a transformer layer "
                              f"(sprout imports LoRA adapters on the blocks' linear layers only)")
        out[f"{m.group(1)}.{m.group(2)}.{ADAPTER}.weight"] = v
    return out
