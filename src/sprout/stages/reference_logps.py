"""Reference log-probs computed once and cached beside the data (DPO's `precompute_ref_logps`).

For each preference file a run reads (train and held-out), the reference's summed response
log-probs of every kept pair are computed once, before training, and kept in

    <data file>.ref_logps.<key>.safetensors
        chosen    float32 [N]   log p_ref(chosen response | prompt), summed over its tokens
        rejected  float32 [N]   the same for the rejected response
        line      int64   [N]   each pair's line in the data file (N = the loader's kept pairs, in file order)
        metadata: the key's parts (data_sha256, ref_weights_sha256, template_version,
                  tokenizer_fingerprint, seq_len, truncation)

`key` is the first 16 hex digits of the sha256 of those parts, so a change to any of them names
another file; a cache whose lines do not match the loader's pairs is computed again; older
files are left in place. Every rank computes when any rank cannot read the cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from data_loader.preference_batches import PreferenceLoader
from sprout.atomic import atomic_path, sha256_file
from sprout.checkpoint import WEIGHTS, read_meta
from sprout.losses.tokens import sequence_logps
from sprout.engine.trainer import all_reduce_sums
from sprout.stages.packing import loss_forward


@dataclass
class ReferenceLogps:
    """(chosen [N], rejected [N]) per file, indexed by the loader's pair index; where each lives."""
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    paths: tuple[Path, Path]
    reused: tuple[bool, bool]


def cache_parts(loader: PreferenceLoader, ref_path: str, tokenizer_fingerprint: str) -> dict:
    """What the cached log-probs depend on: the parts of the cache file's key."""
    return {"data_sha256": sha256_file(loader.path),
            "ref_weights_sha256": read_meta(ref_path, verify=False)["files"][WEIGHTS],
            "template_version": loader.template_version, "tokenizer_fingerprint": tokenizer_fingerprint,
            "seq_len": loader.seq_len, "truncation": loader.truncation}


def cache_file(data: str | Path, parts: dict) -> Path:
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return Path(f"{data}.ref_logps.{key}.safetensors")


def read_cache(path: Path, loader: PreferenceLoader) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cached (chosen, rejected), or None when the file is absent, unreadable or not for these pairs."""
    if not path.is_file():
        return None
    try:
        t = load_file(path)
    except (SafetensorError, OSError):
        return None
    lines = torch.tensor([p.line for p in loader.pairs], dtype=torch.int64)
    if set(t) != {"chosen", "rejected", "line"} or not torch.equal(t["line"], lines):
        return None
    return t["chosen"], t["rejected"]


def response_logps(model, batch: dict, padding_free: bool = False, overwrite_logits: bool = False) -> torch.Tensor:
    """The summed response log-probs [2B] of both sides of a micro-batch of pairs under `model`
    (one forward, logits at the response tokens alone; `padding_free`: over the sides packed,
    `sprout.stages.packing.loss_forward`): what the reference gives DPO, live or cached.
    `overwrite_logits` as in `sequence_logps`."""
    logits = loss_forward(model, batch, padding_free)
    return sequence_logps(logits, batch["targets"], batch["loss_mask"], overwrite_logits=overwrite_logits)[0]


@torch.no_grad()
def compute_logps(accelerator, ref, loader: PreferenceLoader, micro_pairs: int,
                  score=response_logps) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [N], rejected [N]) of every kept pair of `loader`, on the CPU on every rank: rank k
    takes pairs k, k+W, ... (padded so every rank runs the same number of forwards, as FSDP
    needs), in micro-batches of `micro_pairs` under the run's autocast, then all are gathered.
    `score(model, batch)` gives both sides' [2B] values (default: summed response log-probs)."""
    dev = accelerator.device
    idx, real = loader.eval_pairs()
    rows = []
    for i in range(0, len(idx), micro_pairs):
        batch = {k: v.to(dev) for k, v in loader.collate(idx[i:i + micro_pairs], real[i:i + micro_pairs]).items()}
        with accelerator.autocast():
            logps = score(ref, batch).double()
        b = batch["pair_index"].shape[0]
        rows.append(torch.stack([logps[:b], logps[b:], batch["pair_index"].double(),
                                 batch["pair_mask"].double()], dim=1))
    local = torch.cat(rows)  # [ceil(N / W), 4] on every rank
    table = accelerator.gather(local).cpu() if accelerator.num_processes > 1 else local.cpu()
    keep = table[:, 3] > 0
    at = table[keep, 2].long()
    chosen, rejected = torch.zeros(loader.num_pairs), torch.zeros(loader.num_pairs)
    chosen[at], rejected[at] = table[keep, 0].float(), table[keep, 1].float()
    return chosen, rejected


def write_cache(path: Path, loader: PreferenceLoader, logps: tuple[torch.Tensor, torch.Tensor], parts: dict) -> None:
    lines = torch.tensor([p.line for p in loader.pairs], dtype=torch.int64)
    with atomic_path(path) as tmp:
        save_file({"chosen": logps[0].contiguous(), "rejected": logps[1].contiguous(), "line": lines}, str(tmp),
                  metadata={k: str(v) for k, v in parts.items()})


def reference_logps(accelerator, ref, ref_path: str, tokenizer_fingerprint: str,
                    loaders: tuple[PreferenceLoader, PreferenceLoader], micro_pairs: int,
                    padding_free: bool = False) -> ReferenceLogps:
    """The reference log-probs of the train and held-out pairs, from their caches or computed
    (and cached) now (`padding_free`: its forwards over packed sides, the same values); every
    rank calls it and gets the same tensors."""
    found, paths, reused = [], [], []
    for loader in loaders:
        parts = cache_parts(loader, ref_path, tokenizer_fingerprint)
        path = cache_file(loader.path, parts)
        cached = read_cache(path, loader)
        missing = all_reduce_sums(accelerator, {"missing": float(cached is None)})["missing"]
        if missing:
            cached = compute_logps(accelerator, ref, loader, micro_pairs,
                                   score=lambda model, batch: response_logps(model, batch, padding_free))
            if accelerator.is_main_process:
                write_cache(path, loader, cached, parts)
            accelerator.wait_for_everyone()
        accelerator.print(f"dpo: reference log-probs of {loader.num_pairs:,} pairs "
                          f"{'computed and written to' if missing else 'read from'} {path}")
        found.append(cached)
        paths.append(path)
        reused.append(not missing)
    return ReferenceLogps(found[0], found[1], tuple(paths), tuple(reused))
