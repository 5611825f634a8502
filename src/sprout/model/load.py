"""Models from checkpoints (whose files `sprout.checkpoint` reads and verifies): the module
meta.json's `architecture` names (`sprout.model.heads`), or a head model on an LM's backbone.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sprout.checkpoint import META, WEIGHTS, checkpoint_state, load_weights, read_meta
from sprout.errors import SproutError
from sprout.model.config import ModelConfig
from sprout.model.heads import ARCHITECTURES, HEAD_WEIGHTS
from sprout.model.transformer import Transformer, model_rope_tables


def uninitialised(cls: type[Transformer], config: ModelConfig, device: str | torch.device = "cpu") -> Transformer:
    """A `cls(config)` (the Transformer or a head model) whose parameters hold no values yet,
    for weights that are loaded next: built on the meta device, then allocated on `device`.
    The tied lm_head is tied again and the rotary tables are computed, as `__init__` does."""
    with torch.device("meta"):
        model = cls(config)
    # not to_empty: its empty_like would run torch's Python reference for meta tensors (an import)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if config.tie_embeddings and hasattr(model, "lm_head"):
        model.lm_head.weight = model.embed_tokens.weight
    cos, sin = model_rope_tables(config)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


def model_class(meta: dict):
    """The module class of a checkpoint's architecture."""
    arch = meta["architecture"]
    if arch not in ARCHITECTURES:
        raise SproutError(f"{Path(meta['path']) / META}: unknown architecture {arch!r} "
                          f"(known: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[arch]


ARCHITECTURE_NAMES = {"lm": "a language model", "lm+value": "a PPO policy (a language model with a value head)",
                      "reward": "a reward model"}


def check_init_architecture(meta: dict, stage: str, allowed: tuple[str, ...] = ("lm",)) -> None:
    """Refuse a checkpoint that `stage` cannot start from, saying what it is and what the stage
    needs: `{path}/meta.json: a reward model checkpoint (architecture reward); SFT needs an lm
    checkpoint`."""
    arch = meta["architecture"]
    if arch not in allowed:
        what = ARCHITECTURE_NAMES.get(arch, "a")
        needs = " or ".join(allowed)
        raise SproutError(f"{Path(meta['path']) / META}: {what} checkpoint (architecture {arch}); {stage} needs "
                          f"an {needs} checkpoint ({ARCHITECTURE_NAMES['lm']}, e.g. a pretraining or SFT run)")


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(model in eval mode, meta) from a checkpoint, for inference, eval, scoring and export.

    The module is the one meta.json's `architecture` names: a Transformer, a PolicyWithValue
    (its value head included) or a RewardModel.
    """
    meta = read_meta(path)
    model = uninitialised(model_class(meta), ModelConfig(**meta["model_config"]), device)
    load_weights(model, meta["path"], meta)
    return model.eval(), meta


def init_from_lm(path: str | os.PathLike, architecture: str, *, seed: int = 0, device: str | torch.device = "cpu"):
    """(model in train mode, meta): a model of `architecture` whose backbone is the checkpoint's.

    Every backbone parameter comes from the checkpoint (an LM, or a model with another head);
    the new head is initialised as a fresh model's would be, from `seed` (the global RNG is
    left as it was). A reward model takes no lm_head; a value model takes the lm_head too.
    """
    if architecture not in ARCHITECTURES:
        raise SproutError(f"unknown architecture {architecture!r} (known: {', '.join(ARCHITECTURES)})")
    meta = read_meta(path)
    config = ModelConfig(**meta["model_config"])
    if architecture not in HEAD_WEIGHTS:  # every weight comes from the checkpoint
        model = uninitialised(ARCHITECTURES[architecture], config)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = ARCHITECTURES[architecture](config)
    f = Path(meta["path"]) / WEIGHTS
    state = checkpoint_state(meta, model)
    own = model.state_dict()
    head = HEAD_WEIGHTS.get(architecture)
    missing = sorted(set(own) - set(state) - {head})
    if missing:
        raise SproutError(f"{f}: not a backbone for this model (missing {', '.join(missing[:4])})")
    model.load_state_dict({k: v for k, v in state.items() if k in own and k != head}, strict=False)
    return model.to(device).train(), meta
