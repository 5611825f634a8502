"""Checkpoints: safetensors weights, a JSON meta and the training state, written atomically.

One checkpoint is a directory:

    model.safetensors   the weights (safetensors: a flat tensor file, nothing to unpickle)
    train_state.pt      optimizer, scheduler and RNG state: tensors and plain containers only,
                        read back with torch.load(weights_only=True), which refuses pickled code
    meta.json           format, model config, tokenizer spec, stage, step, tokens seen, loader
                        state, the run's config and its hash, and the sha256 of both files above

It is written into a temporary sibling directory and renamed into place, so a crash leaves
either the old checkpoint or the complete new one. A run keeps its checkpoints under
`<out>/checkpoints/step_XXXXXXXX/` next to `latest`, a one-line pointer written last;
only the newest K are kept. Loading checks every file's sha256 against meta.json and refuses
a corrupted or modified file with an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_model as _load_safetensors_model
from safetensors.torch import save_file

from sprout.atomic import atomic_write, sha256_file
from sprout.errors import SproutError

FORMAT = "sprout-checkpoint-v1"
WEIGHTS, STATE, META = "model.safetensors", "train_state.pt", "meta.json"
LATEST = "latest"


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: first name} of parameters registered under several names (tied embeddings).

    A checkpoint stores a tied matrix once, under its first name; loading fills the aliases in.
    """
    first, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _weights_to_store(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors model.safetensors holds: tied aliases dropped, detached, on the CPU, contiguous."""
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items() if name not in aliases}


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module | dict,
    *,
    meta: dict,
    optimizer: Any = None,
    scheduler: Any = None,
    extra_state: dict | None = None,
    rng_states: list[dict] | None = None,
    aliases: dict[str, str] | None = None,
) -> Path:
    """Write one checkpoint directory at `path` atomically; returns `path`.

    `model` is a module or an already gathered state dict (FSDP); for a state dict, `aliases`
    names its tied duplicates (`tied_aliases` of the module it came from). `meta` should hold
    `model_config` (a dict or dataclass); `format` and file hashes are added here.
    `optimizer` may also be an already gathered state dict (FSDP). `rng_states` is one RNG
    state per rank (default: this process's only).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}.", dir=path.parent))
    try:
        if isinstance(model, torch.nn.Module):
            state, aliases = model.state_dict(), tied_aliases(model)
        else:
            state, aliases = model, aliases or {}
        save_file(_weights_to_store(state, aliases), tmp / WEIGHTS, metadata={"format": "pt"})
        train_state = {
            "optimizer": optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer,
            "scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
            "rng": rng_states if rng_states is not None else [rng_state()],
            "extra": extra_state,
        }
        torch.save(train_state, tmp / STATE)
        meta = dict(meta)
        if dataclasses.is_dataclass(meta.get("model_config")):
            meta["model_config"] = dataclasses.asdict(meta["model_config"])
        meta["format"] = FORMAT
        meta["files"] = {name: sha256_file(tmp / name) for name in (WEIGHTS, STATE)}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        for name in (WEIGHTS, STATE, META):
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
        old = None
        if path.exists():  # re-saving the same step: move the old one aside first
            old = path.with_name(f".tmp-old-{path.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_rotating(root: str | os.PathLike, step: int, model, *, keep: int = 3, **kwargs) -> Path:
    """Save `root/step_XXXXXXXX`, then point `root/latest` at it, then drop all but the newest `keep`."""
    root = Path(root)
    for stale in root.glob(".tmp-step_*"):  # left by a crash mid-save; only rank 0 writes here
        shutil.rmtree(stale, ignore_errors=True)
    path = save_checkpoint(root / f"step_{step:08d}", model, **kwargs)
    with atomic_write(root / LATEST, "w") as f:
        f.write(path.name + "\n")
    if keep > 0:
        for old in sorted(root.glob("step_*"))[:-keep]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint dir, a folder with a `latest` pointer, or a run dir holding `checkpoints/`."""
    path = Path(path)
    for folder in (path, path / "checkpoints"):
        if (folder / META).is_file():
            return folder
        if (folder / LATEST).is_file():
            target = folder / (folder / LATEST).read_text().strip()
            if not (target / META).is_file():
                raise SproutError(f"{folder / LATEST}: points at {target.name}, which has no {META}")
            return target
    if not path.exists():
        raise SproutError(f"{path}: no such checkpoint")
    raise SproutError(f"{path}: not a checkpoint (no {META}, no {LATEST} pointer)")


def read_meta(path: str | os.PathLike, verify: bool = True) -> dict:
    """meta.json of a checkpoint; with `verify`, check each file's sha256 and refuse on mismatch."""
    path = resolve_checkpoint(path)
    try:
        meta = json.loads((path / META).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SproutError(f"{path / META}: corrupted checkpoint meta ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SproutError(f"{path / META}: not a {FORMAT} meta file")
    if verify:
        for name, digest in meta.get("files", {}).items():
            f = path / name
            if not f.is_file():
                raise SproutError(f"{f}: checkpoint file is missing")
            if sha256_file(f) != digest:
                raise SproutError(f"{f}: sha256 does not match {META}; the file is corrupted or was modified")
    meta["path"] = str(path)
    return meta


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are DTensor shards (FSDP2) rather than whole tensors."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _load_full_into_sharded(model: torch.nn.Module, f: Path) -> None:
    """Every rank reads the full weights and keeps its own shard of each (no collective)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = load_file(f)
    for alias, name in tied_aliases(model).items():
        if alias not in state and name in state:
            state[alias] = state[name]
    expected = set(model.state_dict())
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise RuntimeError(f"missing keys {missing[:4]}, unexpected keys {unexpected[:4]}")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def load_weights(model: torch.nn.Module, path: str | os.PathLike, meta: dict | None = None) -> dict:
    """Load a checkpoint's weights into `model` (verified first); returns the meta.

    `model` may be sharded by FSDP2 (then every rank keeps its own shard of the full weights).
    """
    meta = meta or read_meta(path)
    f = Path(meta["path"]) / WEIGHTS
    try:
        if is_sharded(model):
            _load_full_into_sharded(model, f)
        else:
            _load_safetensors_model(model, f, strict=True, device=str(next(model.parameters()).device))
    except (SafetensorError, RuntimeError, ValueError) as exc:
        raise SproutError(f"{f}: cannot load weights into this model ({str(exc).splitlines()[0]})") from None
    return meta


def load_train_state(path: str | os.PathLike, meta: dict | None = None) -> dict:
    """Optimizer/scheduler/RNG state, read with weights_only=True (no arbitrary unpickling)."""
    meta = meta or read_meta(path)
    f = Path(meta["path"]) / STATE
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure here means a bad file
        raise SproutError(f"{f}: cannot read training state ({str(exc).splitlines()[0]})") from None


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(Transformer in eval mode, meta) from a checkpoint, for inference, eval and export."""
    from sprout.model.transformer import ModelConfig, Transformer

    meta = read_meta(path)
    model = Transformer(ModelConfig(**meta["model_config"])).to(device)
    load_weights(model, meta["path"], meta)
    return model.eval(), meta


def rng_state() -> dict:
    """This process's RNG state (python, numpy, torch, cuda) as tensors and plain values."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
