"""Supervised fine-tuning (SFT): masked next-token loss on packed chat rows, as one stage of the shared loop.

`SFTStage` feeds the loop micro-batches of `data_loader.sft_batches.SFTLoader` rows
(conversations rendered by `sprout.chat`, packed by `sprout.prep.sft_data`; format
`sprout.formats.packed_sft`). Per micro-batch (`sft_batch_loss`): attention stays inside each
packed conversation and positions restart per conversation, so a row computes what each
conversation would alone; the loss is the cross-entropy summed over the trained targets only
(`loss_mask`: assistant content and its end-of-turn token), whose logits alone are computed. Normaliser: the trained targets of
the whole global batch (all micro-batches, all processes). Metrics, per trained target: token
accuracy and mean entropy. Eval: masked loss and token accuracy over every val row, sums reduced
over processes. `run_sft` refuses a train/val pair from different prep runs or no longer
matching their sha256, a tokenizer file other than the one the pair records (`check_sft_tokenizer`),
data of another tokenizer, chat template or longer context, a row that trains nothing
(`check_trained_rows`) and a train file holding a held-out problem (`check_held_out_rows`); each
checkpoint's meta records the tokenizer, chat-template version and base checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from data_loader.sft_batches import SFTLoader, shift
from sprout.atomic import check_writable
from sprout.chat import ChatError, template_of
from sprout.chat_formats import ChatFormat, format_for, format_for_spec
from sprout.checkpoint import (TokenizerUnavailable, bundled_file, checkpoint_tokenizer, init_record, load_weights,
                               read_meta)
from sprout.errors import SproutError
from sprout.losses.tokens import loss_positions, masked_correct_sum, masked_entropy_sum, token_nll_sum
from sprout.model.chat_session import ChatSession
from sprout.model.load import check_init_architecture
from sprout.model.config import ModelConfig
from sprout.model.load import uninitialised
from sprout.model.transformer import Transformer
from sprout.formats.data_paths import SFT_FILES, resolve_data
from sprout.formats.packed_sft import SFTFile
from sprout.prep.held_out import (check_record, check_sft_examples, prep_dev_slice, sft_user_turns,
                                  slice_digest)
from sprout.formats.verify_inputs import verify_sft_pair
from sprout.ranges import check_ranges
from sprout.engine.trainer import all_reduce_sums
from sprout.engine.stage import TokenStage, micro_steps
from sprout.engine.run_stage import apply_lora, start_run, train_stage, with_epochs
from sprout.engine.cli import is_rank0, print_rank0, resolve_resume
from sprout.stages.configs import SFTConfig
from sprout.tokenizer_files import load_recorded


def sft_batch_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked next-token loss of one micro-batch: (nll sum, trained targets, metric sums). Logits
    are computed at the trained positions only (`loss_positions` as `logits_to_keep`), which is
    all the loss and its metrics read."""
    targets, mask = batch["targets"], batch["loss_mask"]
    logits = model(batch["input_ids"], segment_ids=batch["segment_ids"], position_ids=batch["position_ids"],
                   logits_to_keep=loss_positions(mask))
    nll, n = token_nll_sum(logits, targets, mask, overwrite_logits=True)  # logits unused after backward
    with torch.no_grad():  # both per trained target
        metrics = {"accuracy": (masked_correct_sum(logits, targets, mask), n),
                   "entropy": (masked_entropy_sum(logits, mask), n)}
    return nll, n, metrics


class SFTStage(TokenStage):
    """Rows with a loss mask: the targets are the trained ones (count_targets); tokens count
    every row position, padding included (`TokenStage`), and so do the FLOPs but the lm_head's,
    counted at the trained positions only (`flops`)."""

    name = "sft"
    loss_label = "masked loss"  # the y axis of loss.png
    sample_decoding = "greedy, at most 64 new tokens"

    def __init__(self, accelerator, loader: SFTLoader, val: SFTLoader, accum_steps: int, *,
                 tokenizer=None, sample_prompts=()):
        self.acc, self.loader, self.val, self.accum_steps = accelerator, loader, val, accum_steps
        self.tokenizer, self.sample_prompts = tokenizer, list(sample_prompts)

    def next_micro_batches(self, step: int) -> list[dict]:
        """One loader batch (this rank's share of the global batch) cut into accum_steps micro-batches."""
        batch = self.loader.next_batch()
        rows = self.loader.batch_size // self.accum_steps
        parts = {k: v.split(rows) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(self.accum_steps)]

    loss = staticmethod(sft_batch_loss)

    def count_targets(self, batch: dict) -> torch.Tensor:
        return batch["loss_mask"].sum()

    def flops(self, model, batch: dict) -> float:
        """Every row position's training FLOPs, the lm_head's only where logits are computed: the
        trained positions (`sft_batch_loss`; `Transformer.training_flops`)."""
        training_flops = getattr(model, "training_flops", None)
        ids = batch["input_ids"]
        return training_flops(ids.shape[-1], ids.numel(), int(batch["loss_mask"].sum())) if training_flops else 0.0

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        dev, val = self.acc.device, self.val
        # Every rank runs the same number of forwards (FSDP gathers weights in each one): a
        # rank with fewer rows repeats its last batch with nothing trained.
        rows_per_rank = -(-val.num_rows // val.world_size)
        n_batches = -(-rows_per_rank // val.batch_size)
        sums = {k: torch.zeros((), dtype=torch.float64, device=dev) for k in ("nll", "correct", "n")}
        batches, batch = val.eval_batches(), None
        model.eval()
        for _ in range(n_batches):
            nxt = next(batches, None)
            if nxt is None and batch is None:  # fewer val rows than ranks: borrow row 0
                batch = shift(val.file.read(np.array([0])))
            batch = nxt if nxt is not None else {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
            with self.acc.autocast():
                nll, n, m = sft_batch_loss(model, {k: v.to(dev) for k, v in batch.items()})
            sums["nll"] += nll
            sums["n"] += n
            sums["correct"] += m["accuracy"][0]
        model.train()
        tot = all_reduce_sums(self.acc, sums)
        if tot["n"] == 0:
            raise SproutError(f"{val.path}: the val file has no trained tokens; nothing to evaluate")
        return {"val_loss": tot["nll"] / tot["n"], "val_accuracy": tot["correct"] / tot["n"]}

    @torch.no_grad()
    def samples(self, model) -> Iterator[tuple[str, str]]:
        """(prompt, answer) for each sample prompt, one at a time: one user turn rendered with the
        chat template, answered greedily (`sprout.model.chat_session.ChatSession`, temperature 0),
        so the answers are the same on every rank and touch no RNG."""
        if self.tokenizer is None or not self.sample_prompts:
            return
        for prompt in self.sample_prompts:
            session = ChatSession(model, self.tokenizer, max_new_tokens=min(64, model.config.max_seq_len // 2),
                                  temperature=0.0)  # a short answer within a small model's context
            try:
                answer = session.send(prompt).text
            except ChatError as exc:
                answer = f"(not generated: {exc})"
            yield prompt, answer


# ---- checks before anything heavy starts ----------------------------------------------------
def _base_fingerprint(base: dict) -> str | None:
    """The fingerprint of the base checkpoint's tokenizer (`base_tokenizer`), or None when it
    cannot be loaded here."""
    tok = base_tokenizer(base)
    return tok.fingerprint() if tok is not None else None


def check_sft_data(base: dict, model_cfg: ModelConfig, data: Path, attrs: dict, val: Path, val_attrs: dict,
                   fmt: ChatFormat) -> None:
    """Refuse SFT files that the base checkpoint cannot train on, naming the files; `fmt` is
    the chat format the trained model will be prompted with, and files whose prep did not
    record that it left out the held-out problems (`sprout.prep.held_out.check_record`)."""
    ckpt = Path(base["path"]) / "meta.json"
    check_record(attrs.get("held_out"), str(data))
    for key in ("tokenizer_fingerprint", "template_version", "seq_len", "vocab_size"):
        if val_attrs[key] != attrs[key]:
            raise SproutError(f"{val}: {key} {val_attrs[key]!r} differs from the train file {data} ({attrs[key]!r})")
    if attrs["template_version"] != fmt.version:
        raise SproutError(f"{data}: rendered with chat template {attrs['template_version']!r}, but the base "
                          f"checkpoint's tokenizer renders {fmt.version!r} ({fmt.name}) at inference; "
                          f"prepare the SFT data again")
    v, mv = attrs["vocab_size"], model_cfg.vocab_size
    if not v <= mv <= -(-v // 128) * 128:  # the model's vocab may be the tokenizer's padded for matmuls
        raise SproutError(f"{data}: data vocab is {v} but the base checkpoint {ckpt} has vocab_size {mv}")
    if attrs["seq_len"] - 1 > model_cfg.max_seq_len:
        raise SproutError(f"{data}: rows of {attrs['seq_len']} tokens (inputs of {attrs['seq_len'] - 1}) exceed "
                          f"max_seq_len {model_cfg.max_seq_len} of the base checkpoint {ckpt}; prepare the SFT "
                          f"data with --seq-len {model_cfg.max_seq_len}")


def check_base_tokenizer(base: dict, data: Path, attrs: dict) -> None:
    """Refuse SFT data (`data`, its `attrs`) of another tokenizer than the base checkpoint's: by the
    fingerprints recorded, else by the base's tokenizer loaded (`_base_fingerprint`), else by spec.
    Comes before the base's tokenizer is loaded for the run, so that a base of another tokenizer is
    named as such."""
    ckpt = Path(base["path"]) / "meta.json"
    spec, fp = attrs["tokenizer_spec"], attrs["tokenizer_fingerprint"]
    base_spec, base_fp = base.get("tokenizer"), base.get("tokenizer_fingerprint")
    if base_fp is None and (base.get("tokenizer_file") or base_spec not in (None, spec)):
        base_fp = _base_fingerprint(base)
    same = base_fp == fp if base_fp else base_spec in (None, spec)
    if not same:
        base_fp = (base_fp or "unavailable")[:12]
        raise SproutError(f"{data}: SFT data was tokenized with {spec} (fingerprint {fp[:12]}) but the base "
                          f"checkpoint {ckpt} was trained with {base_spec} (fingerprint {base_fp}); "
                          f"prepare the SFT data with --tokenizer {base_spec}")


def check_sft_tokenizer(data: Path, val: Path, out: str):
    """The pair's tokenizer (its `tokenizer_spec`), whose files must be those the train file records
    (`sprout.tokenizer_files.load_recorded`; the run folder `out`'s own copy stands in for a file
    not here), and the val file must record the same."""
    with SFTFile(data) as f:
        spec, record = f.attrs["tokenizer_spec"], f.tokenizer_record()
    with SFTFile(val) as f:
        if not f.tokenizer_record().same(record):
            raise SproutError(f"{val}: its tokenizer record (tokenizer_fingerprint, tokenizer_side_sha256) differs "
                              f"from the train file {data}'s")
    return load_recorded(spec, record, stand_in=bundled_file(spec, out), note=print_rank0)


def check_held_out_rows(data: Path, tok, fmt: ChatFormat, attrs: dict) -> None:
    """Refuse a train file holding a held-out problem (`sprout.prep.held_out.check_sft_examples`:
    every conversation's user turns, decoded; GSM8K's dev slice where the prep's GSM8K train file
    can be read here), and say what was checked."""
    config = attrs.get("config") or {}
    dev, where, whole = prep_dev_slice(config, config.get("max_examples"))
    if dev:
        recorded = (attrs.get("held_out") or {}).get("gsm8k_dev_slice")
        if whole and recorded is not None and recorded != slice_digest(dev):
            where += " (not the slice the prep recorded: the file changed since)"
        dev |= {tok.decode(tok.encode(q)).strip() for q in dev}  # as a tokenizer that rewrites text decodes it
    n = check_sft_examples(data, sft_user_turns(data, tok, template_of(tok, fmt)), dev)
    print_rank0(f"held-out problems: none in the {n:,} conversations of {data} (arithmetic dev and test; "
                f"GSM8K dev: {where})")


def base_tokenizer(base: dict):
    """The base checkpoint's tokenizer (`checkpoint_tokenizer`), also for the end-of-training
    samples: a run folder's copy that changed is refused like any other; None (no samples) only
    when a tokenizer named by its spec alone cannot be loaded here (tiktoken without its ranks)."""
    try:
        return checkpoint_tokenizer(base)
    except TokenizerUnavailable:
        return None


def _attrs(path: Path) -> dict:
    with SFTFile(path) as f:
        return f.attrs


def check_trained_rows(path: Path, shown: int = 5) -> None:
    """Refuse an SFT file with a row that trains nothing, naming the file and the rows: no
    loss could be taken from it (prep never writes one: the loss mask was edited)."""
    with SFTFile(path) as f:
        rows, total = f.rows_without_targets(), f.num_rows
    if rows.size:
        listed = ", ".join(map(str, rows[:shown])) + (", ..." if rows.size > shown else "")
        raise SproutError(f"{path}: {rows.size:,} of {total:,} rows have no trained target (loss_mask all 0): "
                          f"rows {listed}; prepare the SFT data again")


# ---- the run ---------------------------------------------------------------------------------
def run_sft(cfg: SFTConfig, resume: str | None = None) -> dict:
    """Check inputs, load the base model, build everything, resume if asked, train; returns fit's summary (sprout.engine.training_loop)."""
    check_ranges(cfg)  # a config built in Python (the scripts' from_dict has checked)
    if not cfg.init:
        raise SproutError("no base model: set init in the config or pass --init CHECKPOINT")
    if not cfg.data.path:
        raise SproutError("no SFT data: set data.path in the config or pass --data DIR (or FILE.h5)")
    data, val = resolve_data(cfg.data.path, SFT_FILES, cfg.data.val_path)
    base = read_meta(cfg.init)  # resolves run dir / latest pointer, verifies every file's sha256
    check_init_architecture(base, "sft")
    model_cfg = ModelConfig(**base["model_config"])
    check = verify_sft_pair(data, val, cfg.data.verify, show_progress=is_rank0())
    print_rank0(check.report("SFT files"))
    data_tok = check_sft_tokenizer(data, val, cfg.out)
    attrs = _attrs(data)
    check_base_tokenizer(base, data, attrs)
    sample_tok = base_tokenizer(base)
    if sample_tok is not None and sample_tok.checkpoint is not None and base.get("template_version") is None:
        # a base never trained on chat: a chat template in its tokenizer copy renders what this run trains it with
        sample_tok.checkpoint = (sample_tok.checkpoint[0], attrs["template_version"])
    fmt = format_for(sample_tok) if sample_tok is not None else format_for_spec(attrs["tokenizer_spec"])
    check_sft_data(base, model_cfg, data, attrs, val, _attrs(val), fmt)
    for path in (data, val):
        check_trained_rows(path)
    if cfg.data.verify == "full":
        check_held_out_rows(data, data_tok, fmt, attrs)
    row_len, micro = attrs["seq_len"], cfg.batch.micro_tokens
    if micro % row_len:
        raise SproutError(f"batch.micro_tokens {micro} is not a multiple of the row length {row_len} of {data}")
    resume_path = resolve_resume(resume, cfg.out)
    check_writable(Path(cfg.out) / "config.yaml")

    acc = start_run(cfg.train, cfg.out)
    accum = micro_steps(cfg.batch.global_tokens, micro, acc.num_processes)
    rows, rank, world = micro // row_len, acc.process_index, acc.num_processes
    loader = SFTLoader(data, rows * accum, seed=cfg.train.seed, rank=rank, world_size=world)
    if loader.steps_per_epoch == 0:
        raise SproutError(f"{data}: {loader.num_rows} rows cannot fill one global batch of "
                          f"{loader.global_batch} rows (batch.global_tokens / {row_len})")
    val_loader = SFTLoader(val, rows, rank=rank, world_size=world, shuffle=False)
    if val_loader.num_rows < world:
        raise SproutError(f"{val}: {val_loader.num_rows} val rows for {world} processes")
    model = uninitialised(Transformer, model_cfg)  # the base's weights, or the resumed run's
    if resume_path is None or not cfg.lora.off:  # a LoRA resume loads its adapters onto the base
        load_weights(model, base["path"], base)
    lora = apply_lora(model, cfg, base)
    cfg = with_epochs(cfg, loader.steps_per_epoch)
    acc.print(f"sft: {data} ({loader.num_rows:,} rows of {row_len}, {loader.steps_per_epoch} steps per epoch), "
              f"val {val} ({val_loader.num_rows:,} rows); base {base['path']} (step {base.get('step')})")
    stage = SFTStage(acc, loader, val_loader, accum, tokenizer=sample_tok,
                     sample_prompts=cfg.sample_prompts)
    provenance = {"tokenizer_fingerprint": attrs["tokenizer_fingerprint"],
                  "template_version": attrs["template_version"], "template": attrs["template"],
                  "init": init_record(base), **lora}
    return train_stage(acc, model, stage, cfg, resume=resume_path, tokenizer=attrs["tokenizer_spec"],
                       micro_steps=accum, extra_meta=provenance)
