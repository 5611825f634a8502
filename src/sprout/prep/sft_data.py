"""SFT data prep (`scripts/prepare_sft_data.py`): sources -> conversations -> (ids, loss_mask) ->
packed HDF5 rows.

Sources are read by `sprout.prep.chat_sources`; each conversation is validated by the chat
template (invalid ones dropped and counted by reason; a source with no usable row stops the prep
naming it); a held-out problem (`sprout.prep.held_out`) is dropped (`dropped_held_out`) and the
files' `held_out` attribute records it; dedup is exact across sources on `conversation_key`,
first wins, and val is split by the same key (`is_val` with `val_fraction`: disjoint, stable,
independent of `max_examples` and source order). Weights resample the train split
(`sprout.prep.mixture.resample`: weight w gives each example floor(w) times plus a seeded random
round((w - floor(w)) * n) of the n once more). Examples are rendered and packed
(`sprout.prep.packing.pack`); `out` and its `_val` file are written per `sprout.formats.packed_sft`,
both renamed into place only when both are written, after removing a killed run's temporaries.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal
from pathlib import Path

import numpy as np

from sprout.atomic import check_writable, remove_stale_temps, safe_name
from sprout.chat import ChatError, render, template_for, validate
from sprout.errors import SproutError
from sprout.formats.data_paths import SFT_FILES
from sprout.formats.packed_sft import val_path, write_sft_files
from sprout.formats.shards import dtype_for_vocab
from sprout.prep.chat_sources import SourceConfig, from_dict_source, read_source
from sprout.prep.held_out import HeldOut, gsm8k_dev_questions
from sprout.prep.keys import conversation_key, is_val
from sprout.prep.mixture import resample
from sprout.prep.packing import OVERLONG_POLICIES, pack
from sprout.prep.records import empty_split_warning, kept_records, log_first_drops
from sprout.prep.sources import print_warning
from sprout.ranges import SEED_RANGE, in_range
from sprout.tokenizer_files import side_files_sha256


@dataclass
class SFTDataConfig:
    tokenizer: str = "tiktoken:r50k_base"  # tiktoken:NAME, sentencepiece:PATH.model or hf:PATH
    out: str = "runs/demo/sft/sft.h5"  # train file; val beside it with _val
    seq_len: int = in_range(512, "[2, 65535]")  # row length in tokens
    mirror: str | None = None  # fills ${SPROUT_MIRROR} in paths (default: sprout.mirror.mirror_dir)
    max_examples: int | None = in_range(None, "[0, inf)")  # per source, for quick runs
    seed: int = in_range(0, SEED_RANGE)  # resampling of weighted sources
    val_fraction: float = in_range(0.02, "[0, 1)")  # share of conversations in the val file
    dedup: bool = True  # drop exact duplicate conversations
    overlong: Literal["truncate", "drop"] = "truncate"  # what happens to examples longer than seq_len
    sources: list = field(default_factory=list)  # SourceConfig fields, one mapping per source


def _check_config(cfg: SFTDataConfig) -> list[SourceConfig]:
    if cfg.overlong not in OVERLONG_POLICIES:
        raise SproutError(f"overlong must be one of {', '.join(OVERLONG_POLICIES)}, got {cfg.overlong!r}")
    if not cfg.sources:
        raise SproutError("no sources configured (--source PATH[:WEIGHT] with --source-format, or a `sources:` list in the config)")
    safe_name(Path(cfg.out).name, f"out {cfg.out}")
    if Path(cfg.out).suffix != SFT_FILES.suffix:  # the trainers find packed rows by it
        raise SproutError(f"out {cfg.out}: the train file's name must end in {SFT_FILES.suffix} "
                          f"(e.g. {Path(cfg.out) / SFT_FILES.train}); the val file goes beside it")
    check_writable(cfg.out)
    specs = [from_dict_source(s, i) for i, s in enumerate(cfg.sources)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SproutError(f"source names must be unique, got {names}")
    for i, spec in enumerate(specs):
        if spec.format == "gsm8k" and spec.split != "train":
            raise SproutError(f"sources[{i}].split ({spec.name}) of the config: {spec.split!r}, but SFT reads GSM8K's "
                              f"train split only (its test split and its train split's dev slice are held out)")
    return specs


def prepare(cfg: SFTDataConfig, tok, command: str = "", log=print, warn=print_warning) -> dict:
    """Run the whole prep; writes the train and val files and returns the counts (a split
    without a row is written and warned about). Examples longer than `seq_len` follow `overlong`;
    every count goes to the files' `counts` attribute."""
    specs = _check_config(cfg)
    tok.fingerprint()  # the tokenizer's files hashed now, as they are when it is loaded, and kept
    sides = side_files_sha256(tok)
    t0 = time.perf_counter()
    per_source = {s.name: Counter() for s in specs}
    seen: set[bytes] = set()
    train: dict[str, list] = {s.name: [] for s in specs}
    val: list = []
    first_drop: dict[str, str] = {}
    held_out = HeldOut(gsm8k_dev_questions(specs, cfg.mirror, cfg.max_examples))  # its dev slice, held out in every source
    for spec in specs:
        c = per_source[spec.name]
        rows = ((ex.where, ex) for ex in read_source(spec, cfg.mirror, cfg.max_examples, skipped=c))
        gsm8k_split = "train" if spec.format == "gsm8k" else None
        for ex in kept_records(rows, c, first_drop, spec.name, lambda ex: validate(ex.messages)):
            if held_out.excluded(ex.messages, gsm8k_split):
                c["dropped_held_out"] += 1
                first_drop.setdefault(f"{spec.name}/held_out", f"{ex.where}: a held-out problem")
                continue
            key = conversation_key(ex.messages)
            if cfg.dedup and key in seen:
                c["duplicates"] += 1
                continue
            seen.add(key)
            if is_val(key, cfg.val_fraction):
                c["val"] += 1
                val.append(ex.messages)
            else:
                c["train"] += 1
                train[spec.name].append(ex.messages)
        if c["train"] + c["val"] + c["duplicates"] + c["dropped_held_out"] == 0:  # nothing read, or every row dropped
            drops = ", ".join(f"{k} {v:,}" for k, v in sorted(c.items()) if k != "read") or "the source is empty"
            raise SproutError(f"{spec.path or spec.hub or spec.name}: source {spec.name!r} has no usable rows "
                              f"({c['read']:,} read; {drops})")
    log_first_drops(first_drop, log)
    t_read = time.perf_counter()

    train_convs = []
    for i, spec in enumerate(specs):
        rng = np.random.default_rng([cfg.seed, i])
        n = len(train[spec.name])
        idx = resample(np.arange(n), np.ones(n, dtype=np.int64), spec.weight * n, rng)
        per_source[spec.name]["train_weighted"] = len(idx)
        train_convs += [train[spec.name][j] for j in idx]

    tpl = template_for(tok)
    pad_id = tok.pad_id if tok.pad_id is not None else tok.eot_id
    token_dtype = dtype_for_vocab(tok.vocab_size)
    attrs = {"tokenizer_spec": tok.spec, "tokenizer_name": tok.name, "tokenizer_fingerprint": tok.fingerprint(),
             **({"tokenizer_side_sha256": sides} if sides is not None else {}),
             "vocab_size": tok.vocab_size, "eot_id": tok.eot_id, "pad_id": pad_id,
             "template_version": tpl.version, "template": tpl.to_json(),
             "config": {k: v for k, v in vars(cfg).items()}, "command": command, "held_out": held_out.record()}
    result = {"sources": {k: dict(v) for k, v in per_source.items()}, "held_out": held_out.record()}
    cache: dict[int, tuple] = {}
    files, lines = [], []
    for split, convs, path in (("train", train_convs, cfg.out), ("val", val, val_path(cfg.out))):
        t1 = time.perf_counter()
        examples, render_drops = [], Counter()
        for conv in convs:
            try:
                if id(conv) not in cache:  # weighted copies share one rendering
                    cache[id(conv)] = render(conv, tok)
                examples.append(cache[id(conv)])
            except ChatError as exc:
                render_drops[f"dropped_{exc.reason}"] += 1
        packed = pack(examples, cfg.seq_len, pad_id, cfg.overlong, token_dtype=token_dtype)
        counts = {**dict(render_drops), **packed.counts}
        result[split] = counts
        arrays = {"tokens": packed.tokens, "loss_mask": packed.loss_mask,
                  "segment_ids": packed.segment_ids, "position_ids": packed.position_ids}
        files.append((path, arrays, {**attrs, "split": split, "counts": {"sources": result["sources"], "split": counts}}))
        lines.append(f"{split}: {counts['rows']:,} rows x {cfg.seq_len} -> {path} "
                     f"({counts['examples_packed']:,} examples, {counts['trained_tokens']:,} trained tokens, "
                     f"packing efficiency {counts['packing_efficiency']:.3f}, {time.perf_counter() - t1:.1f}s)")
    for path, _, _ in files:
        remove_stale_temps(path)
    write_sft_files(files)
    for line in lines:
        log(line)
    for path, _, file_attrs in files:
        if file_attrs["counts"]["split"]["rows"] == 0:
            warn(empty_split_warning(file_attrs["split"], Path(path), len(train_convs) + len(val), "conversations"))
    result["seconds"] = {"read": round(t_read - t0, 2), "total": round(time.perf_counter() - t0, 2)}
    return result
