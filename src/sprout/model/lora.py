"""LoRA adapters (Hu et al., 2021) on a sprout model, through peft, and their maths without it.

A targeted linear layer y = W x becomes y = W x + s B A x, with A [r, in], B [out, r] (B starts
at 0, so an adapted model starts equal to its base) and s = alpha / r (alpha / sqrt(r) with
use_rslora). `add_adapters` injects peft's LoRA layers (`peft.inject_adapter_in_model`) into the
blocks' projections that `lora.target_modules` names, never into lm_head or a scalar head, and
leaves trainable only the adapters and the model's scalar head (a reward model's score head,
PPO's value head), which train in full.

Invariants: with its adapters off (`AdaptersOff`) the model computes its base exactly: that is
the reference of DPO, PPO and GRPO, no second copy of the weights. A LoRA checkpoint holds the
trainable tensors only, named as the module names them (`...q_proj.lora_A.default.weight`), with
meta.json's `lora` record (`lora_record`) and frozen_models' `base`; `sprout.lora_weights.merge_adapters`
makes of a base's weights and those the state dict of a plain model, which is what every reader
of a checkpoint gets (`sprout.checkpoint.checkpoint_state`): peft is needed to train, not to read.
Decoding reads `effective_weight` (W + s B A) into its weight copies once per generate call.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from sprout.errors import SproutError
from sprout.lora_weights import ADAPTER, has_adapters, is_lora_layer, lora_scale

SCALAR_HEADS = ("score_head", "value_head")  # `sprout.model.heads`' heads: trained in full beside the adapters

LORA_INSTALL = "pip install -e '.[lora]'"


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers outside its heads, in model order
    (q_proj, k_proj, ..., down_proj): what `target_modules` may name."""
    names: list[str] = []
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and path.startswith("layers.") and leaf not in names:
            names.append(leaf)
    return names


def resolve_targets(model: nn.Module, target_modules: list[str]) -> list[str]:
    """The layer names `target_modules` stands for in `model` (all-linear: every one); a name that
    matches none of its linear layers is refused in one line listing them."""
    present = linear_layer_names(model)
    if "all-linear" in target_modules:
        return present
    missing = [t for t in target_modules if t not in present]
    if missing:
        raise SproutError(f"lora.target_modules: {', '.join(missing)} matches no linear layer of this model "
                          f"(its linear layers: {', '.join(present)})")
    return [t for t in present if t in target_modules]


def lora_record(lora, targets: list[str]) -> dict:
    """meta.json's `lora`: the adapter settings a checkpoint was trained with, targets resolved."""
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "use_rslora": lora.use_rslora,
            "target_modules": list(targets), "scale": lora_scale(lora.r, lora.alpha, lora.use_rslora)}


# ---- peft: adapters on a live model -------------------------------------------------------------
def _peft():
    try:
        import peft
    except ImportError:
        raise SproutError(f"lora.r > 0 trains LoRA adapters through peft, which is not installed: {LORA_INSTALL}") \
            from None
    return peft


def add_adapters(model: nn.Module, lora, seed: int = 0) -> list[str]:
    """Inject peft LoRA layers (`lora`: a `sprout.engine.configs.LoraConfig` with r > 0) into
    `model` in place, A drawn from `seed` (the global RNG left as it was); only the adapters and
    a scalar head (score_head, value_head) stay trainable. Returns the targeted layer names."""
    peft = _peft()
    targets = resolve_targets(model, lora.target_modules)
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_rslora=lora.use_rslora,
                             target_modules=targets, bias="none")
    if has_adapters(model):
        raise SproutError("add_adapters: the model has LoRA adapters already")
    with torch.random.fork_rng(devices=[]):  # A's init draws on the CPU; the run's RNG streams stay as they were
        torch.default_generator.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or name.split(".")[0] in SCALAR_HEADS)
    vars(model).pop("_matmul_counts", None)  # `Transformer.matmul_params` counts the frozen matrices again
    return targets


def adapter_layers(model: nn.Module) -> list[nn.Module]:
    """The model's peft LoRA layers (none in a plain model)."""
    return [m for m in model.modules() if is_lora_layer(m)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within: `model` computes its base (every adapter layer off). Only the flag peft's forward
    reads (`disable_adapters`) changes: peft's `enable_adapters` would also turn the adapters'
    requires_grad off and on, which FSDP2 reads at its first forward to choose the gradients'
    dtypes, and which torch.compile guards on."""
    layers = adapter_layers(model)
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer in layers:
            layer._disable_adapters = False


class AdaptersOff:
    """A LoRA model seen as its frozen base: calls run it with its adapters off and without
    gradients. DPO's, PPO's and GRPO's reference (`sprout.engine.trainer.Trainer.prepare_frozen`
    returns it as it is): the same parameters, no copy."""

    def __init__(self, model: nn.Module):
        self.module = model

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), adapters_disabled(self.module):
            return self.module(*args, **kwargs)

    def eval(self):
        return self

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def effective_weight(linear: nn.Module) -> torch.Tensor:
    """`linear`'s weight as it computes now: W, plus s B A of its active adapters when it is a
    peft LoRA layer with adapters on and not merged (what decoding's fused copies take)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    weight = base.weight
    if linear.disable_adapters or linear.merged:
        return weight
    for name in linear.active_adapters:
        if name in linear.lora_A:
            weight = weight + linear.get_delta_weight(name).to(weight.dtype)
    return weight
