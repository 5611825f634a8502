"""The optimizer of every stage: AdamW over parameter groups, and its learning-rate schedule.

A stage may give its own parameter groups (`param_groups(model)`, e.g. a value head with its
own lr); the schedule (`sprout.engine.schedule.lr_at`: warmup, then cosine / WSD / constant)
has one shape that `Trainer.step` applies to each group's base lr. Their options are the `optim`
section, `sprout.engine.configs.OptimConfig`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from sprout.engine.configs import OptimConfig
from sprout.engine.schedule import lr_at


def decay_groups(params, weight_decay: float, **options) -> list[dict]:
    """Two parameter groups: matrices (embeddings, projections) with `weight_decay`, norms and
    biases without; `options` (e.g. lr_scale) go into both."""
    params = list(params)
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, **options},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, **options}]


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, groups: list[dict] | None = None) -> torch.optim.AdamW:
    """AdamW over `groups` (a stage's `param_groups(model)`); by default `decay_groups` of every
    trainable parameter with optim.weight_decay.

    A group is `{"params": [...]}` plus optionally `lr_scale` (its base lr is optim.lr ×
    lr_scale, e.g. a value head learning faster) or `lr` (its base lr), `weight_decay`
    (default optim.weight_decay), and `hold_steps` (its lr is 0 for the run's first hold_steps
    optimizer steps: no update, no weight decay). The schedule multiplies every group's base lr
    alike (`Trainer.step`). Every trainable parameter must be in exactly one group.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = decay_groups(trainable, optim.weight_decay) if groups is None else groups
    if sorted(id(p) for g in groups for p in g["params"]) != sorted(id(p) for p in trainable):
        raise ValueError("param_groups(model) must hold every trainable parameter of the model exactly once")
    built = []
    for group in groups:
        group = dict(group)
        if "lr" in group and "lr_scale" in group:
            raise ValueError("a parameter group takes lr or lr_scale, not both")
        group["lr"] = group.get("lr", optim.lr * group.pop("lr_scale", 1.0))
        group.setdefault("weight_decay", optim.weight_decay)
        built.append(group)
    return torch.optim.AdamW(built, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=True)


def lr_schedule(optim: OptimConfig, total_steps: int) -> Callable[..., float]:
    """`schedule(step, peak) -> lr`: the schedule's shape (warmup, decay) applied to a group's base lr."""
    return functools.partial(lr_at, total_steps=total_steps, warmup_steps=optim.warmup_steps,
                             kind=optim.schedule, min_ratio=optim.min_lr_ratio, decay_frac=optim.wsd_decay_frac)
