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
meta.json's `lora` record (`lora_record`) and frozen_models' `base`; `merge_adapters` makes of a
base's weights and those the state dict of a plain model, which is what every reader of a
checkpoint gets (`sprout.checkpoint.checkpoint_state`): peft is needed to train, not to read.
Decoding reads `effective_weight` (W + s B A) into its weight copies once per generate call.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
from torch import nn

from sprout.errors import SproutError

ADAPTER = "default"  # peft's adapter name; sprout trains one adapter per run
_A = re.compile(rf"^(.*)\.lora_A\.{ADAPTER}\.weight$")
_B = re.compile(rf"^(.*)\.lora_B\.{ADAPTER}\.weight$")
LORA_INSTALL = "pip install -e '.[lora]'"


def lora_scale(r: int, alpha: float, use_rslora: bool = False) -> float:
    """s of y = W x + s B A x: alpha / r, or alpha / sqrt(r) (rank-stabilised, Kalajdzievski 2023)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


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
    with torch.random.fork_rng(devices=[]):  # A's init draws; the run's RNG stream stays as without adapters
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or name.split(".")[0] in ("score_head", "value_head"))
    return targets


def adapter_layers(model: nn.Module) -> list[nn.Module]:
    """The model's peft LoRA layers (none in a plain model)."""
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def has_adapters(model: nn.Module) -> bool:
    return any(True for _ in adapter_layers(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within: `model` computes its base (every adapter layer off, peft's `enable_adapters`)."""
    layers = adapter_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # the adapters trainable again, as peft's enable sets them


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


def effective_bias(linear: nn.Module) -> torch.Tensor | None:
    base = getattr(linear, "base_layer", linear)
    return base.bias


# ---- the maths on state dicts: merge, split, PEFT's file names ---------------------------------
def adapter_pairs(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} of a checkpoint's adapter tensors (`...X.lora_A.default.weight`
    -> `X.weight`); an A without its B (or the reverse) is refused."""
    a = {m.group(1): v for k, v in adapters.items() if (m := _A.match(k))}
    b = {m.group(1): v for k, v in adapters.items() if (m := _B.match(k))}
    if set(a) != set(b):
        odd = sorted(set(a) ^ set(b))[0]
        raise SproutError(f"adapter tensors: {odd} has lora_A or lora_B but not both")
    return {f"{name}.weight": (a[name], b[name]) for name in a}


def merge_adapters(base: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], scale: float,
                   where: str = "adapters") -> dict[str, torch.Tensor]:
    """A plain model's state dict: `base` with each adapted weight W + scale B A, and every other
    tensor of `saved` (a scalar head) as it is. `where` names the file in errors: an adapter
    for a weight the base lacks, or of another shape, is refused naming both."""
    merged = dict(base)
    for name, (A, B) in adapter_pairs(saved).items():
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
