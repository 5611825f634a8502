"""PEFT LoRA adapter folders, both ways: a LoRA run exported as its base and its adapter
(`export_lora_adapter`, `scripts/export_hf.py --adapter`), and an adapter merged into an
imported model (`merge_peft_adapter`, `scripts/import_model.py --adapter`).

Invariants: an export with its adapter is one folder written whole or not at all: the merged
model, `base/` (the run's base, itself merged if a LoRA run) and `adapter/` (peft's own
`adapter_config.json`, its base_model_name_or_path the absolute path of `base/`, and
`adapter_model.safetensors` under peft's names), which `PeftModel.from_pretrained` loads onto
`base/`. A LoRA reward model is refused (its score head has no place in a CAUSAL_LM adapter). An
import merges plain LoRA only, W + s B A on the blocks' linear layers; any setting that changes
those maths (DoRA, biases, modules_to_save, rank or alpha patterns, a base-rewriting init) or a
tensor of another layer or shape is refused in one line naming the file and field, before
anything is written. The format details: docs/import-export.md.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sprout.atomic import sha256_file
from sprout.checkpoint import WEIGHTS, checkpoint_tokenizer, lora_base, run_folder
from sprout.errors import SproutError
from sprout.tokenizer import read_json_object
from sprout.formats.checkpoint_meta import read_meta, resolve_checkpoint
from sprout.model.export import (EXPORT_FOLDERS, ExportResult, build_export, check_export_out, check_ids,
                                 check_outside_run, check_vocab, compare_logits, logprob_rule_of,
                                 write_export)
from sprout.model.export_tokenizer import INSTALL_HINT
from sprout.model.load import load_model
from sprout.lora_weights import adapter_pairs, lora_scale, merge_adapters, peft_adapter_state, sprout_adapter_state
from sprout.model.lora import LORA_INSTALL

BASE_DIR, ADAPTER_DIR = EXPORT_FOLDERS
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class AdapterExport:
    merged: ExportResult  # OUT itself: the merged model, as without --adapter
    base: ExportResult  # OUT/base
    adapter: Path  # OUT/adapter
    adapter_files: list[str] = field(default_factory=list)  # relative to OUT
    config: dict = field(default_factory=dict)  # adapter_config.json as written


# ---- export -------------------------------------------------------------------------------------
def _peft():
    try:
        import peft
    except ImportError:
        raise SproutError(f"--adapter writes a PEFT adapter with peft's own LoraConfig; peft is not installed: "
                          f"{LORA_INSTALL}") from None
    return peft


def peft_lora_config(lora: dict, base_path: str):
    """peft's `LoraConfig` of a LoRA run's `lora` record, as `PeftModel.save_pretrained` would
    write it for this adapter (inference_mode true); its `save_pretrained` writes adapter_config.json."""
    peft = _peft()
    config = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             use_rslora=lora["use_rslora"], target_modules=list(lora["target_modules"]),
                             bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_path,
                             inference_mode=True)
    return config


def check_adapter_run(meta: dict) -> None:
    """Refuse, in one line naming the meta.json, a checkpoint that --adapter cannot export:
    one trained without LoRA, or a LoRA reward model (its score head has no place in a CAUSAL_LM
    adapter)."""
    where = Path(meta["path"]) / "meta.json"
    if "lora" not in meta:
        raise SproutError(f"{where}: not a LoRA run (no lora record); --adapter exports a LoRA run's base and "
                          f"adapter, export this checkpoint without it")
    if meta["architecture"] == "reward":
        raise SproutError(f"{where}: a reward model trained with LoRA; --adapter does not export its score head "
                          f"(PEFT's modules_to_save), export the merged model without --adapter")


def export_lora_adapter(checkpoint: str | os.PathLike, out: str | os.PathLike, *, tokenizer: str | None = None,
                        overwrite: bool = False) -> tuple[AdapterExport, object, object, object]:
    """Export a LoRA run's checkpoint to `out` merged, with `out/base` and `out/adapter` (see the
    module doc); returns (result, merged sprout model, base sprout model, tokenizer). Every
    refusal comes before anything is written."""
    out = Path(out)
    check_outside_run(out, run_folder(resolve_checkpoint(checkpoint)))
    meta = read_meta(checkpoint)
    check_adapter_run(meta)
    _peft()
    check_export_out(out, overwrite)
    base_meta = lora_base(meta)
    model, _ = load_model(meta["path"])
    base, _ = load_model(base_meta["path"])
    tok = checkpoint_tokenizer(meta, tokenizer)
    check_vocab(model, tok)
    saved = load_file(Path(meta["path"]) / WEIGHTS)
    adapters = peft_adapter_state(saved)
    config = peft_lora_config(meta["lora"], str(Path(os.path.abspath(out)) / BASE_DIR))
    results = {}

    def fill(tmp: Path) -> list[str]:
        results["merged"] = write_export(model, tok, tmp, logprob_rule_of(meta))
        (tmp / BASE_DIR).mkdir()
        results["base"] = write_export(base, tok, tmp / BASE_DIR, logprob_rule_of(base_meta))
        config.save_pretrained(str(tmp / ADAPTER_DIR))
        save_file(adapters, tmp / ADAPTER_DIR / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        return [*results["merged"].files, *(f"{BASE_DIR}/{n}" for n in results["base"].files),
                *(f"{ADAPTER_DIR}/{n}" for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS))]

    build_export(out, overwrite, fill)
    merged, base_result = replace(results["merged"], out=out), replace(results["base"], out=out / BASE_DIR)
    written = json.loads((out / ADAPTER_DIR / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    result = AdapterExport(merged, base_result, out / ADAPTER_DIR,
                           [f"{ADAPTER_DIR}/{n}" for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)], written)
    return result, model, base, tok


def verify_adapter(out: str | os.PathLike, model, tok, *, atol: float = 1e-4, seed: int = 0) -> dict:
    """Load `out/base` with transformers and `out/adapter` on it with peft
    (`PeftModel.from_pretrained`) and compare its logits with the merged sprout `model`'s on
    random ids (`sprout.model.export.compare_logits`'s tolerance); returns {"max_abs_diff",
    "max_abs_diff_fp64"}, raises SproutError on a mismatch."""
    peft = _peft()
    try:
        import transformers
    except ImportError:
        raise SproutError(f"checking the export needs transformers: {INSTALL_HINT}") from None
    out = Path(out)
    base = transformers.AutoModelForCausalLM.from_pretrained(out / BASE_DIR, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()
    diff, diff64 = compare_logits(out / ADAPTER_DIR, model, adapted, check_ids(model, tok, seed), atol,
                                  who="peft's (base/ with adapter/)")
    return {"max_abs_diff": diff, "max_abs_diff_fp64": diff64}


# ---- import -------------------------------------------------------------------------------------
# adapter_config.json fields that leave W + s B A as it is (or name where it applies, which the
# tensors themselves say); any other field set to something other than off is refused
PLAIN_FIELDS = {"peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
                "inference_mode", "r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules",
                "exclude_modules", "layers_to_transform", "layers_pattern", "megatron_core", "qalora_group_size",
                "ensure_weight_tying", "init_lora_weights", "bias", "loftq_config", "eva_config", "corda_config",
                "lora_ga_config", "runtime_config"}
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")  # inits that leave the base weights as they are


def read_adapter_config(folder: Path) -> dict:
    """adapter_config.json of a PEFT folder, checked to be plain LoRA for a causal LM (module doc)."""
    f = folder / ADAPTER_CONFIG
    if not f.is_file():
        raise SproutError(f"{folder}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    config = read_json_object(f)
    if config.get("peft_type") != "LORA":
        raise SproutError(f"{f}: peft_type {json.dumps(config.get('peft_type'))} is not supported (only LORA)")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise SproutError(f"{f}: task_type {json.dumps(config['task_type'])} is not supported (only CAUSAL_LM)")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf \
                or (name == "r" and value != int(value)):
            what = "missing" if name not in config else json.dumps(value)
            kind = "an integer" if name == "r" else "a number"
            raise SproutError(f"{f}: {name} is {what}; expected {kind} above 0")
    if config.get("use_dora"):
        raise SproutError(f"{f}: use_dora true (DoRA) is not supported; sprout merges plain LoRA, W + s B A")
    if config.get("bias", "none") != "none":
        raise SproutError(f"{f}: bias {json.dumps(config['bias'])} is not supported (only none: the adapter "
                          f"trains no biases)")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise SproutError(f"{f}: init_lora_weights {json.dumps(init)} is not supported (it rewrites the base "
                          f"weights the adapter applies to)")
    for name, value in config.items():
        if name not in PLAIN_FIELDS and value not in (None, False, {}, [], ""):
            raise SproutError(f"{f}: {name} {json.dumps(value)} is not supported; sprout merges plain LoRA, "
                              f"W + s B A on the blocks' linear layers")
    return config


def merge_peft_adapter(model, folder: str | os.PathLike, base_where: str) -> dict:
    """Merge the PEFT LoRA adapter in `folder` into `model` (a sprout Transformer), in place:
    W + s B A for each adapted layer. `base_where` names the model's source (its config.json)
    in errors. Returns meta.json's `adapter` record: {path, sha256 of adapter_model.safetensors,
    r, lora_alpha, use_rslora, target_modules, base_model_name_or_path (what the adapter names as
    its base; only its shapes are checked against the model)}."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SproutError(f"{folder}: no such PEFT adapter folder")
    config = read_adapter_config(folder)
    f = folder / ADAPTER_WEIGHTS
    if not f.is_file():
        raise SproutError(f"{f}: missing (only safetensors adapters are imported)")
    try:
        tensors = load_file(f)
    except (SafetensorError, OSError) as exc:
        raise SproutError(f"{f}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
    where = f"{f} on the model of {base_where}"
    adapters = sprout_adapter_state(tensors, where)
    r, use_rslora = int(config["r"]), bool(config.get("use_rslora", False))
    pairs = adapter_pairs(adapters, str(f))
    for name, (A, _) in pairs.items():
        if A.dim() != 2 or A.shape[0] != r:
            raise SproutError(f"{f}: the adapter of {name} has rank {A.shape[0] if A.dim() else '?'}, "
                              f"{ADAPTER_CONFIG}'s r is {r}")
    state = model.state_dict()
    merged = merge_adapters(state, adapters, lora_scale(r, config["lora_alpha"], use_rslora), where=where)
    model.load_state_dict(merged, strict=True)
    targets = config.get("target_modules")
    return {"path": str(folder.resolve()), "sha256": sha256_file(f), "r": r, "lora_alpha": config["lora_alpha"],
            "use_rslora": use_rslora, "target_modules": sorted(targets) if isinstance(targets, list) else targets,
            "base_model_name_or_path": config.get("base_model_name_or_path") or None}
