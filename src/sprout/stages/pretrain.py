"""Pretraining: next-token prediction over token shards, as one stage of the shared loop.

`PretrainStage` feeds the loop (`sprout.engine.trainer`) with micro-batches from
`data_loader.token_batches` (sequential per-rank spans, or nanoGPT random windows), shortens the
sequences during the sequence-length warmup (the global batch stays fixed in tokens), and
evaluates val loss and val bits per byte (`sprout.bpb`) on a fixed slice of the
val split. `run_pretrain(cfg, resume)` is everything `scripts/pretrain.py` does after
parsing its arguments: check the data against the model before anything heavy starts,
build model, optimizer, schedule and stage, resume if asked, train, report. The data check
(`verify_data`) proves the files are the ones prep wrote (manifest, sizes, sha256 unless
data.verify is `sizes`) and that every token id fits the model's vocabulary; `data_tokenizer`
that the tokenizer file is the one the manifest records.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import torch

from data_loader.token_batches import DistributedTokenLoader, RandomWindowSampler, eval_rows, open_token_sources, read_tokens
from sprout.atomic import check_writable
from sprout.checkpoint import bundled_file, read_meta
from sprout.bpb import bits_per_byte, luts_to_torch, token_bytes
from sprout.errors import SproutError
from sprout.formats.data_paths import token_data_path
from sprout.formats.verify_inputs import DataCheck, verify_token_data
from sprout.losses.tokens import token_nll_sum
from sprout.model.transformer import Transformer
from sprout.tokenizer import Tokenizer, load_tokenizer
from sprout.tokenizer_files import load_recorded
from sprout.ranges import check_ranges
from sprout.engine.trainer import all_reduce_sums
from sprout.engine.stage import TokenStage, micro_steps
from sprout.engine.run_stage import start_run, train_stage, with_max_steps
from sprout.engine.cli import is_rank0, print_rank0, resolve_resume
from sprout.engine.schedule import seq_len_at, seq_len_stages
from sprout.stages.configs import PretrainConfig, TokenDataConfig


class PretrainStage(TokenStage):
    """Every target trained (count_targets, num_tokens, flops: `TokenStage`'s defaults); the
    metric `seq_len` is the row length of the step (per row), which the warmup changes."""

    name = "pretrain"

    def __init__(self, accelerator, loader, val_tokens: np.ndarray, *, seq_len: int, seq_len_fn,
                 micro_batch_tokens: int, accum_steps: int, luts=None):
        self.acc, self.loader, self.val_tokens = accelerator, loader, val_tokens
        self.seq_len, self.seq_len_fn, self.luts = seq_len, seq_len_fn, luts
        self.micro_batch_tokens, self.accum_steps = micro_batch_tokens, accum_steps

    def next_micro_batches(self, step: int) -> list[dict]:
        T = self.seq_len_fn(step)
        rows = self.micro_batch_tokens // T
        return [dict(zip(("input_ids", "targets"), self.loader.next_batch(rows, T))) for _ in range(self.accum_steps)]

    def loss(self, model, batch):
        ids = batch["input_ids"]
        nll, n = token_nll_sum(model(ids), batch["targets"], overwrite_logits=True)
        return nll, n, {"seq_len": (ids.numel(), ids.shape[0])}

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        dev, rows = self.acc.device, max(1, self.micro_batch_tokens // self.seq_len)
        world = self.acc.num_processes
        x, y = eval_rows(self.val_tokens, self.seq_len, self.acc.process_index, world)
        # Every rank runs the same number of forwards (under FSDP each one is a collective):
        # a rank whose share of the rows is shorter scores a dummy row with nothing counted.
        n_rows = max(0, (len(self.val_tokens) - 1) // self.seq_len)
        most_rows_per_rank = math.ceil(n_rows / world)
        n_batches = math.ceil(most_rows_per_rank / rows)
        sums = {k: torch.zeros((), device=dev) for k in ("nll", "n", "bytes")}
        model.eval()
        for i in range(0, n_batches * rows, rows):
            xb, yb = x[i : i + rows].to(dev), y[i : i + rows].to(dev)
            counted = len(xb) > 0
            if not counted:
                xb = yb = torch.zeros(1, self.seq_len, dtype=torch.long, device=dev)
            with self.acc.autocast():
                nll, n = token_nll_sum(model(xb), yb)
            if counted:
                sums["nll"] += nll
                sums["n"] += n
                if self.luts is not None:
                    sums["bytes"] += token_bytes(xb, yb, self.luts).sum()
        model.train()
        tot = all_reduce_sums(self.acc, sums)
        if tot["n"] == 0:
            raise SproutError(f"the val split has fewer than {self.seq_len + 1} tokens: nothing to evaluate")
        out = {"val_loss": tot["nll"] / tot["n"]}
        if self.luts is not None:
            out["val_bpb"] = bits_per_byte(tot["nll"], int(tot["bytes"]))
        return out


def verify_data(data: TokenDataConfig) -> DataCheck:
    """The start-up check of the token data (`sprout.formats.verify_inputs.verify_token_data`): the
    manifest, every shard's presence, size and (data.verify full) sha256, and the largest token
    id; prints what was checked and how long it took (rank 0)."""
    check = verify_token_data(data.dir, data.verify, show_progress=is_rank0())
    print_rank0(check.report("shards" if Path(data.dir).is_dir() else "HDF5 files"))
    return check


def data_tokenizer(spec: str | None, check: DataCheck, out: str) -> Tokenizer | None:
    """The tokenizer of the val bits per byte: `spec` (data.tokenizer), else the one the data
    names, whose files must be those its manifest records (`load_recorded`; the run folder
    `out`'s own copy stands in for a file not here); None when neither names one. Data made
    outside prep records none, and its tokenizer is taken as it is."""
    spec = spec or check.tokenizer
    if not spec:
        return None
    if check.tokenizer_record is None:
        return load_tokenizer(spec)
    return load_recorded(spec, check.tokenizer_record, stand_in=bundled_file(spec, out), note=print_rank0)


def vocab_for_data(data_vocab: int) -> int:
    """model.vocab_size when the config leaves it null: the data's vocabulary rounded up to a
    multiple of 64 (an embedding and output head of a size the matmul kernels like)."""
    return -(-data_vocab // 64) * 64


def check_vocab(check: DataCheck, model_vocab: int, where: str | Path) -> None:
    """The model's vocab must be the data's, or the data's padded up to a multiple of 64/128,
    and every token id must fit it."""
    v = check.vocab_size
    allowed = {v, vocab_for_data(v), -(-v // 128) * 128}
    if model_vocab not in allowed:
        raise SproutError(f"{where}: data vocab is {v} but model.vocab_size is {model_vocab} "
                          f"(use {' or '.join(map(str, sorted(allowed)))}, or leave it null for {vocab_for_data(v)})")
    if check.max_token_id >= model_vocab:
        raise SproutError(f"{check.max_where}: token id {check.max_token_id} does not fit model.vocab_size {model_vocab}")


def check_val_split(val_src, seq_len: int, eval_tokens: int, where: str | Path) -> None:
    """The val split must hold one window of seq_len + 1 tokens within the data.eval_tokens + 1
    that each eval scores."""
    have = sum(len(s) for s in val_src)
    if min(have, eval_tokens + 1) < seq_len + 1:
        limit = "data.eval_tokens" if eval_tokens < have else "the val split"
        raise SproutError(f"{where}: the val split has {have:,} tokens and data.eval_tokens is {eval_tokens:,}; "
                          f"one eval window needs {seq_len + 1:,} (sequence length {seq_len} + 1): {limit} is too "
                          f"small (prepare more data, raise data.val_frac in prep or data.eval_tokens, or lower "
                          f"data.seq_len)")


def check_resumed_data(check: DataCheck, data_dir: str, resume_path: Path, where: str | Path) -> None:
    """A resume must read data of the tokenizer the checkpoint was trained with (its recorded
    fingerprint against the one prep recorded); other data of that tokenizer is said plainly."""
    meta = read_meta(resume_path, verify=False)
    was_fp, now_fp = meta.get("tokenizer_fingerprint"), check.tokenizer_fingerprint
    was_dir = ((meta.get("config") or {}).get("data") or {}).get("dir")
    if was_fp and now_fp and was_fp != now_fp:
        raise SproutError(f"{where}: the data was tokenized with {check.tokenizer} (fingerprint {now_fp[:12]}) but "
                          f"the run {resume_path} was trained on {was_dir} with {meta.get('tokenizer')} (fingerprint "
                          f"{was_fp[:12]}); resume with that tokenizer's data, or start a new run")
    if was_dir and Path(was_dir).resolve() != Path(data_dir).resolve() and is_rank0():
        print(f"note: resuming on other data: data.dir was {was_dir}, now {data_dir} (same tokenizer); training "
              f"continues from the checkpoint's loader position", file=sys.stderr, flush=True)


def run_pretrain(cfg: PretrainConfig, resume: str | None = None) -> dict:
    """Check inputs, build everything, resume if asked, train; returns fit's summary (sprout.engine.training_loop).
    Every check of the data (files, tokenizer file, vocabulary, val size, the tokenizer of a
    resumed run) comes before the run folder is touched."""
    check_ranges(cfg)  # a config built in Python (the scripts' from_dict has checked)
    if not cfg.data.dir:
        raise SproutError("no training data: set data.dir in the config or pass --data DIR")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=str(token_data_path(cfg.data.dir))))
    if cfg.data.sampler not in ("sequential", "random"):
        raise SproutError(f"data.sampler must be sequential or random, not {cfg.data.sampler!r}")
    check = verify_data(cfg.data)
    data_dir = Path(cfg.data.dir)
    where = data_dir / "manifest.json" if data_dir.is_dir() else data_dir
    spec = cfg.data.tokenizer or check.tokenizer
    tok = data_tokenizer(spec, check, cfg.out)
    train_src, val_src = open_token_sources(cfg.data.dir, "train"), open_token_sources(cfg.data.dir, "val")
    if cfg.model.vocab_size is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_for_data(check.vocab_size)))
        print_rank0(f"model.vocab_size {cfg.model.vocab_size} (the data's vocabulary {check.vocab_size:,}, "
                    f"rounded up to a multiple of 64)")
    check_vocab(check, cfg.model.vocab_size, where)
    seq_len = cfg.data.seq_len or cfg.model.max_seq_len
    if seq_len > cfg.model.max_seq_len:
        raise SproutError(f"data.seq_len {seq_len} exceeds model.max_seq_len {cfg.model.max_seq_len}")
    check_val_split(val_src, seq_len, cfg.data.eval_tokens, where)
    micro = cfg.batch.micro_tokens
    for T in seq_len_stages(seq_len, cfg.data.seq_len_start if cfg.data.seq_warmup_frac > 0 else seq_len):
        if micro % T:
            raise SproutError(f"batch.micro_tokens {micro} is not a multiple of sequence length {T}")
    resume_path = resolve_resume(resume, cfg.out)
    if resume_path is not None:
        check_resumed_data(check, cfg.data.dir, resume_path, where)
    check_writable(Path(cfg.out) / "config.yaml")

    acc = start_run(cfg.train, cfg.out)
    accum = micro_steps(cfg.batch.global_tokens, micro, acc.num_processes)
    model = Transformer(cfg.model)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len))
    cfg = with_max_steps(cfg, model.num_params())
    total, data = cfg.train.max_steps, cfg.data

    def seq_len_fn(step: int) -> int:
        return seq_len_at(step, total_steps=total, final=seq_len, start=data.seq_len_start,
                          warmup_frac=data.seq_warmup_frac)

    rank, world = acc.process_index, acc.num_processes
    loader = (DistributedTokenLoader(train_src, rank, world) if data.sampler == "sequential"
              else RandomWindowSampler(train_src, cfg.train.seed, rank, world))
    luts = luts_to_torch(tok.byte_luts(), acc.device) if tok else None
    if tok is None:
        acc.print("note: no tokenizer spec (data.tokenizer or manifest); val_bpb will not be reported")
    stage = PretrainStage(acc, loader, read_tokens(val_src, data.eval_tokens + 1), seq_len=seq_len,
                          seq_len_fn=seq_len_fn, micro_batch_tokens=micro, accum_steps=accum, luts=luts)
    return train_stage(acc, model, stage, cfg, resume=resume_path, tokenizer=spec, micro_steps=accum,
                       extra_meta={"tokenizer_fingerprint": tok.fingerprint()} if tok else None)
