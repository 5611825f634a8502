"""A checkpoint's meta.json and the folder names around it, read without torch (`read_meta`).

A checkpoint is a directory holding `model.safetensors` (WEIGHTS), `train_state.pt` (STATE) and
`meta.json` (META); a folder of checkpoints has a `latest` pointer (LATEST), one line naming the
newest, which must lie in that folder. meta.json holds the format (FORMAT), architecture ("lm",
"lm+value" or "reward"), model config, tokenizer (and the run's copy of it: `tokenizer_file`,
`tokenizer_sha256`), stage, step, tokens seen, loader state, the run's config and its hash,
`run_id`, `init` and `frozen_models` (`sprout.checkpoint`, which writes checkpoints), the sha256
of both files above (`files`) and `meta_sha256` (META_DIGEST), the sha256 of every other field
(`meta_digest`), so an edited step or config is refused too, as is a meta.json lacking it or `architecture`.
A LoRA run's checkpoint holds its adapters and scalar head only; its `lora` record and frozen_models'
`base` name the checkpoint they apply to (`check_lora_record`; `sprout.model.lora` merges them).

A reward model's checkpoint says how it scores a response (`reward_score_of`): a RewardModel by
its score head; an LM whose meta.json holds `reward_score: {"kind": "logprob", "beta": β}` (β a
finite number above 0: `logprob_rule`; `reward.score: logprob` or an import of its export) by
β × the response's summed log-probability.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from sprout.atomic import safe_name, sha256_file
from sprout.errors import SproutError

FORMAT = "sprout-checkpoint-v1"
WEIGHTS, STATE, META = "model.safetensors", "train_state.pt", "meta.json"
LATEST = "latest"
META_DIGEST = "meta_sha256"  # meta.json's own hash, over every other field (`meta_digest`)


def meta_digest(meta: dict) -> str:
    """The sha256 of a checkpoint's meta without its `meta_sha256` (sorted keys, compact JSON)."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint dir, a folder with a `latest` pointer, or a run dir holding `checkpoints/`."""
    path = Path(path)
    for folder in (path, path / "checkpoints"):
        if (folder / META).is_file():
            return folder
        if (folder / LATEST).is_file():
            name = (folder / LATEST).read_text().strip()
            safe_name(name, str(folder / LATEST))
            target = folder / name
            if target.resolve().parent != folder.resolve():
                raise SproutError(f"{folder / LATEST}: points at {name}, which leads out of {folder} (to "
                                  f"{target.resolve()}); latest must name one of this folder's checkpoints")
            if not (target / META).is_file():
                raise SproutError(f"{folder / LATEST}: points at {target.name}, which has no {META}")
            return target
    if not path.exists():
        raise SproutError(f"{path}: no such checkpoint")
    raise SproutError(f"{path}: not a checkpoint (no {META}, no {LATEST} pointer)")


def read_meta(path: str | os.PathLike, verify: bool = True) -> dict:
    """meta.json of a checkpoint, checked against its `meta_sha256`; with `verify`, also check each
    file's sha256 and refuse on mismatch."""
    path = resolve_checkpoint(path)
    try:
        meta = json.loads((path / META).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SproutError(f"{path / META}: corrupted checkpoint meta ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SproutError(f"{path / META}: not a {FORMAT} meta file")
    files = meta.get("files")
    if verify and (not isinstance(files, dict) or not {WEIGHTS, STATE} <= set(files)):
        raise SproutError(f"{path / META}: no sha256 for {WEIGHTS} and {STATE} (`files` missing or incomplete); "
                          f"refusing an unverifiable checkpoint")
    missing = [key for key in (META_DIGEST, "architecture") if key not in meta]
    if missing:
        raise SproutError(f"{path / META}: no {' or '.join(missing)} (written by an earlier version of sprout); "
                          f"train or import the run again")
    if meta_digest(meta) != meta[META_DIGEST]:
        raise SproutError(f"{path / META}: its contents do not match its {META_DIGEST}; the file was modified")
    if verify:
        for name, digest in files.items():
            f = path / name
            if not f.is_file():
                raise SproutError(f"{f}: checkpoint file is missing")
            if sha256_file(f, remember=True) != digest:  # settled files: hashed once per process
                raise SproutError(f"{f}: sha256 does not match {META}; the file is corrupted or was modified")
    if "lora" in meta:
        check_lora_record(meta, path / META)
    meta["path"] = str(path)
    return meta


def check_lora_record(meta: dict, where: Path) -> None:
    """A LoRA run's meta.json: `lora` {r > 0, scale > 0, target_modules, ...} and frozen_models'
    `base` {path, weights_sha256}, the checkpoint its adapters were trained on (`sprout.model.lora`)."""
    lora, base = meta["lora"], (meta.get("frozen_models") or {}).get("base")
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")

    ok = (isinstance(lora, dict) and isinstance(lora.get("r"), int) and not isinstance(lora["r"], bool)
          and lora["r"] > 0 and number(lora.get("alpha")) and number(lora.get("scale"))
          and isinstance(lora.get("use_rslora"), bool) and isinstance(lora.get("target_modules"), list))
    if ok:  # the scale that merges is the one r and alpha give (an export writes r and alpha)
        want = lora["alpha"] / (lora["r"] ** 0.5 if lora["use_rslora"] else lora["r"])
        ok = abs(lora["scale"] - want) <= 1e-9 * want
    if not ok:
        raise SproutError(f"{where}: lora is {json.dumps(lora)}; expected r > 0, alpha > 0, use_rslora, "
                          f"target_modules and the scale alpha / r (alpha / sqrt(r) with use_rslora)")
    if not (isinstance(base, dict) and isinstance(base.get("path"), str) and isinstance(base.get("weights_sha256"), str)):
        raise SproutError(f"{where}: a LoRA checkpoint without frozen_models.base (path and weights_sha256 of the "
                          f"model its adapters were trained on)")


def logprob_rule(score) -> dict | None:
    """`score` as a log-probability reward model's rule {"kind": "logprob", "beta": β} (β a
    float), or None unless it is a dict of kind logprob with β a finite number above 0."""
    if not isinstance(score, dict) or score.get("kind") != "logprob":
        return None
    beta = score.get("beta")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta < float("inf"):
        return None
    return {"kind": "logprob", "beta": float(beta)}


def reward_score_of(meta: dict) -> dict | None:
    """How the checkpoint of `meta` scores a response as a reward model: {"kind": "head"} for a
    RewardModel (architecture reward), `logprob_rule`'s {"kind": "logprob", "beta": β} for an LM
    whose meta.json has that `reward_score` (trained with score logprob, or imported from its
    export), None for any other checkpoint. A logprob record without a finite positive β is
    refused, naming the meta.json."""
    arch = meta["architecture"]
    if arch == "reward":
        return {"kind": "head"}
    score = meta.get("reward_score") or {}
    if arch != "lm" or not isinstance(score, dict) or score.get("kind") != "logprob":
        return None
    rule = logprob_rule(score)
    if rule is None:
        raise SproutError(f"{Path(meta['path']) / META}: reward_score has kind logprob and beta "
                          f"{json.dumps(score.get('beta'))}; expected a finite number above 0")
    return rule
