"""Checkpoints: safetensors weights, a JSON meta and the training state, written atomically.

The folder layout and meta.json's fields are `sprout.formats.checkpoint_meta`'s contract.
train_state.pt (optimizer, scheduler, RNG and a stage's tensor state under `extra`) holds
tensors and plain containers only, read back with torch.load(weights_only=True). A checkpoint
is written into a temporary sibling and renamed into place, so a crash leaves the old one or
the complete new one, and a full disk is one line naming it; `save_rotating` writes `latest`
last and keeps the newest K of the run's own checkpoints (same `run_id`). Every read checks
meta.json against its `meta_sha256`; a load checks every file's sha256 too.

meta.json also records what the run depends on: the checkpoint it started from (`init_record`),
the frozen models it scores with (`frozen_model_record`; a resume refuses one that changed) and
the run's own copy of its tokenizer (`bundle_tokenizer`), which `checkpoint_tokenizer` opens
from the run folder wherever it lies, refusing a file whose sha256 differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from safetensors.torch import load_model as _load_safetensors_model

from sprout.atomic import DISK_ERRNOS, atomic_write, replace_dir, sha256_file, write_error
from sprout.config import config_to_dict
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import (FORMAT, LATEST, META, META_DIGEST, STATE, WEIGHTS, meta_digest,
                                            read_meta)
from sprout.lora_weights import has_adapters, merge_adapters

TOKENIZER_DIR = "tokenizer"


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


def architecture_of(model: torch.nn.Module) -> str:
    """The `architecture` a module declares (`sprout.model.heads`); "lm" for one that declares none."""
    return getattr(model, "architecture", "lm")


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
    names its tied duplicates (`tied_aliases` of the module it came from) and `meta` its
    `architecture` (a module's own is written). `meta` should hold `model_config` (a dict or
    dataclass); `format` and file hashes are added here.
    `optimizer` may also be an already gathered state dict (FSDP). `rng_states` is one RNG
    state per rank (default: this process's only).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}.", dir=path.parent))
    try:
        if isinstance(model, torch.nn.Module):
            state, aliases, architecture = model.state_dict(), tied_aliases(model), architecture_of(model)
        else:
            state, aliases, architecture = model, aliases or {}, meta["architecture"]
        save_file(_weights_to_store(state, aliases), tmp / WEIGHTS, metadata={"format": "pt"})
        train_state = {
            "optimizer": optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer,
            "scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict") else None,
            "rng": rng_states if rng_states is not None else [rng_state()],
            "extra": extra_state,
        }
        with open(tmp / STATE, "wb") as f:  # a file object: a failed write leaves its OSError in the chain
            torch.save(train_state, f)
        meta = dict(meta)
        meta["architecture"] = architecture
        if dataclasses.is_dataclass(meta.get("model_config")):
            meta["model_config"] = config_to_dict(meta["model_config"])
        meta["format"] = FORMAT
        meta["files"] = {name: sha256_file(tmp / name) for name in (WEIGHTS, STATE)}
        meta = json.loads(json.dumps(meta))  # as it reads back, so the digest is that of what is read
        meta[META_DIGEST] = meta_digest(meta)
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(tmp, path, (WEIGHTS, STATE, META))  # re-saving a step moves the old one aside first
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        disk = _disk_error(exc)
        if disk is not None:
            raise write_error(path, disk) from None
        raise
    return path


def _disk_error(exc: BaseException) -> OSError | None:
    """The full-disk / size-limit OSError behind a failed write, if that is what it was:
    the exception itself, one in its chain (torch.save wraps it in a RuntimeError), or the
    `(os error N)` safetensors names in its message."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, SafetensorError):
        m = re.search(r"os error (\d+)", str(exc))
        if m and int(m.group(1)) in DISK_ERRNOS:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    return None


def _run_id(step_dir: Path) -> str | None:
    """The `run_id` in a checkpoint's meta.json; None when absent or unreadable."""
    try:
        return json.loads((step_dir / META).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def save_rotating(root: str | os.PathLike, step: int, model, *, keep: int = 3, **kwargs) -> Path:
    """Save `root/step_XXXXXXXX`, then point `root/latest` at it, then drop all but the newest
    `keep` of this run's checkpoints: those whose meta has the same `run_id` as `meta` (another
    run's checkpoints in the same folder are never deleted). First removes what a save killed
    mid-way left here (`.tmp-step_*`, `.tmp-old-step_*`; only rank 0 writes here)."""
    root = Path(root)
    for pattern in (".tmp-step_*", ".tmp-old-step_*"):
        for stale in root.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    path = save_checkpoint(root / f"step_{step:08d}", model, **kwargs)
    with atomic_write(root / LATEST, "w") as f:
        f.write(path.name + "\n")
    if keep > 0:
        run_id = kwargs.get("meta", {}).get("run_id")
        own = [p for p in sorted(root.glob("step_*")) if p == path or _run_id(p) == run_id]
        for old in own[:-keep]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return path


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are DTensor shards (FSDP2) rather than whole tensors."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def read_weights(f: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict in weights file `f`, with the tied aliases of `model` filled in."""
    state = load_file(f)
    for alias, name in tied_aliases(model).items():
        if alias not in state and name in state:
            state[alias] = state[name]
    return state


def _load_full_into_sharded(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every rank holds the full weights `state` and keeps its own shard of each (no collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    expected = set(model.state_dict())
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise RuntimeError(f"missing keys {missing[:4]}, unexpected keys {unexpected[:4]}")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def checkpoint_state(meta: dict, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of the checkpoint of `meta` for a plain (adapter-free) `model`.

    A LoRA run's checkpoint holds its adapters and scalar head only (`sprout.model.lora`): its
    base (frozen_models' `base`, itself perhaps a LoRA run) is read and checked, the adapters
    merged in, and the base's tensors `model` has no place for (a head of another architecture)
    left out. A base that is gone or whose weights changed is refused in one line naming both.
    """
    f = Path(meta["path"]) / WEIGHTS
    if "lora" not in meta:
        return read_weights(f, model)
    base = lora_base(meta)
    own = set(model.state_dict())
    state = {k: v for k, v in checkpoint_state(base, model).items() if k in own}
    return merge_adapters(state, load_file(f), meta["lora"]["scale"], where=str(f))


def lora_base(meta: dict) -> dict:
    """The meta of a LoRA checkpoint's base, checked against the record in its meta.json."""
    record, where = meta["frozen_models"]["base"], Path(meta["path"]) / META
    try:
        base = read_meta(record["path"])
    except SproutError as exc:
        raise SproutError(f"{where}: its LoRA base {record['path']} cannot be read ({exc}); the adapters "
                          f"need the model they were trained on") from None
    if base["files"][WEIGHTS] != record["weights_sha256"]:
        raise SproutError(f"{where}: its LoRA base {record['path']} has changed (weights sha256 "
                          f"{base['files'][WEIGHTS][:12]}..., trained on {record['weights_sha256'][:12]}...); "
                          f"the adapters need the model they were trained on")
    return base


def _load_adapters(model: torch.nn.Module, f: Path) -> None:
    """A LoRA run's own tensors (adapters, scalar head) into a model with adapters (a resume)."""
    state = load_file(f)
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise RuntimeError(f"missing keys {missing[:4]}, unexpected keys {unexpected[:4]}")
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        device = next(model.parameters()).device
        model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False)


def load_weights(model: torch.nn.Module, path: str | os.PathLike, meta: dict | None = None) -> dict:
    """Load a checkpoint's weights into `model` (verified first); returns the meta.

    `model` may be sharded by FSDP2 (then every rank keeps its own shard of the full weights).
    A LoRA checkpoint loads into a model with adapters as its own tensors (a resume), into a
    plain model merged with its base (`checkpoint_state`).
    """
    meta = meta or read_meta(path)
    f = Path(meta["path"]) / WEIGHTS
    try:
        if has_adapters(model):
            if "lora" not in meta:
                raise RuntimeError("a checkpoint without LoRA adapters into a model with adapters")
            _load_adapters(model, f)
        elif is_sharded(model):
            _load_full_into_sharded(model, checkpoint_state(meta, model))
        elif "lora" in meta:
            model.load_state_dict(checkpoint_state(meta, model), strict=True)
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


# ---- the checkpoints a run started from or scores with ----------------------------------------
def frozen_model_record(meta: dict, **how) -> dict:
    """The `frozen_models` record of the checkpoint of `meta` (read with `read_meta`): its absolute
    path (a LoRA run reads its base from any directory), the sha256 of its weights as its
    meta.json lists them, and `how` the run uses it (e.g. a reward model's score)."""
    return {"path": os.path.abspath(meta["path"]), "weights_sha256": meta["files"][WEIGHTS], **how}


def init_record(meta: dict) -> dict:
    """The `init` record a run started from the checkpoint of `meta` keeps in its meta.json: the
    same path and weights sha256, with its stage and step (the report's inputs section reads it)."""
    return frozen_model_record(meta, stage=meta.get("stage"), step=meta.get("step"))


# ---- the tokenizer travels with the run ---------------------------------------------------------
def bundle_tokenizer(spec: str | None, run_dir: str | os.PathLike, write: bool = True) -> dict:
    """Copy the tokenizer file behind `spec` into `<run_dir>/tokenizer/`; returns the meta fields.

    SentencePiece: the .model (and the .vocab beside it, if any) is copied atomically, unless the
    same file is already there; returns {"tokenizer_file": "tokenizer/NAME.model",
    "tokenizer_sha256": ...}. hf: the tokenizer.json and its side files
    (`sprout.tokenizer_files.side_file_names`, those present) go to `tokenizer/FOLDER/`, FOLDER
    being the name of the folder holding the tokenizer.json, and the fields add
    "tokenizer_side_sha256" (`sprout.tokenizer_files.hash_side_files`, what a prep records of the
    same files). A tiktoken spec (or none) returns {}. `write=False` only computes the fields (the
    processes of a run that do not write to its folder). A different tokenizer already in the run
    folder is refused; when the spec does not resolve here (a relative path, a resume from another
    directory) the run folder's own copy (`bundled_file`) stands in for it.
    """
    from sprout.tokenizer import spec_file
    from sprout.tokenizer_files import hash_side_files, side_file_names

    kind = (spec or "").partition(":")[0]
    dst = bundled_file(spec, run_dir)
    if dst is None:
        return {}
    src = spec_file(spec)
    rel = dst.relative_to(run_dir).as_posix()
    sides = side_file_names(kind) if kind == "hf" else (".vocab",)
    what = "Hugging Face tokenizer" if kind == "hf" else "SentencePiece model"

    def side(main: Path, name: str) -> Path:
        return main.with_suffix(name) if name.startswith(".") else main.parent / name

    def fields(main: Path) -> dict:
        out = {"tokenizer_file": rel, "tokenizer_sha256": sha256_file(main)}
        if kind == "hf":
            out["tokenizer_side_sha256"] = hash_side_files(main, kind)
        return out

    if not src.is_file():
        if dst.is_file():  # a resume from elsewhere: the spec was relative, the run kept its copy
            return fields(dst)
        raise SproutError(f"{src}: {what} not found (tokenizer spec {spec!r})")
    want = fields(src)
    if write:
        if dst.is_file() and fields(dst) != want:
            raise SproutError(f"{dst}: this run folder already holds a different tokenizer than {src} "
                              f"(sha256 differs); use another output folder")
        if not dst.is_file():
            for a, b in [(side(src, n), side(dst, n)) for n in sides] + [(src, dst)]:  # the main file last
                if a.is_file():
                    with atomic_write(b, "wb") as out:
                        out.write(a.read_bytes())
    return want


def bundled_file(spec: str | None, run_dir: str | os.PathLike) -> Path | None:
    """Where `bundle_tokenizer` keeps the file of `spec` in `run_dir`: `tokenizer/NAME.model`, or
    `tokenizer/FOLDER/tokenizer.json` for hf; None for a spec with no file (tiktoken, none)."""
    from sprout.tokenizer import spec_file

    src = spec_file(spec or "")
    if src is None:
        return None
    if spec.startswith("hf:"):
        return Path(run_dir) / TOKENIZER_DIR / Path(os.path.abspath(src)).parent.name / src.name
    return Path(run_dir) / TOKENIZER_DIR / src.name


def run_folder(checkpoint: str | os.PathLike) -> Path:
    """The run folder a checkpoint belongs to: `<run>` for `<run>/checkpoints/step_X`, else itself."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint


class TokenizerUnavailable(SproutError):
    """A checkpoint's tokenizer, named by its spec alone, cannot be loaded here (`checkpoint_tokenizer`)."""


def checkpoint_tokenizer(meta: dict, spec: str | None = None):
    """The tokenizer a checkpoint was trained with (`meta` from `read_meta`); `spec` overrides.

    With `tokenizer_file` in meta: that file in the checkpoint's run folder, loaded as the kind of
    the recorded `tokenizer` spec (sentencepiece unless that is hf:) and checked against the
    meta's record of it (`sprout.tokenizer_files.load_recorded`: `tokenizer_sha256`, and for hf:
    every side file by `tokenizer_side_sha256`, one changed, gone or new refused). Otherwise the
    `tokenizer` spec (tiktoken: a name, whose ranks file the loader pins); one that cannot be
    loaded here raises `TokenizerUnavailable` naming the meta.json. A recorded
    `tokenizer_fingerprint` must match either way. A tokenizer loaded from the meta's record
    carries the checkpoint (`Tokenizer.checkpoint`: the meta.json and its `template_version`),
    by which `sprout.chat_formats.format_for` tells the chat format it was trained with.
    """
    from sprout.tokenizer import load_tokenizer
    from sprout.tokenizer_files import Record, load_recorded

    ckpt_meta = Path(meta["path"]) / META
    recorded = spec is None
    if recorded and meta.get("tokenizer_file"):
        f = run_folder(meta["path"]) / meta["tokenizer_file"]
        if not f.is_file():
            raise SproutError(f"{f}: tokenizer file missing (named by {ckpt_meta}); was the run folder split up?")
        kind = "hf" if str(meta.get("tokenizer", "")).startswith("hf:") else "sentencepiece"
        record = Record(meta.get("tokenizer_sha256"), meta.get("tokenizer_side_sha256"), str(ckpt_meta),
                        ("tokenizer_sha256", "tokenizer_side_sha256"), made="this model was trained with", fix="")
        tok = load_recorded(f"{kind}:{f}", record, note=None)
        spec = tok.spec
    else:
        spec = spec or meta.get("tokenizer")
        if not spec:
            raise TokenizerUnavailable(f"{ckpt_meta}: no tokenizer recorded; pass --tokenizer SPEC")
        try:
            tok = load_tokenizer(spec)
        except SproutError as exc:  # a tiktoken spec's ranks file replaced, a missing file
            raise TokenizerUnavailable(f"{ckpt_meta}: tokenizer {spec} cannot be loaded ({exc})") from None
    want = meta.get("tokenizer_fingerprint")
    if want and tok.fingerprint() != want:
        raise SproutError(f"{spec}: not the tokenizer {ckpt_meta} was trained with (fingerprint differs)")
    if recorded:
        tok.checkpoint = (str(ckpt_meta), meta.get("template_version"))
    return tok


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
