"""What the preference stages (reward model, DPO) share: loaders, micro-batches, held-out groups, checks.

Both read preference pairs through `data_loader.preference_batches.PreferenceLoader`: a
micro-batch of B pairs is 2B rows, the chosen sides then the rejected sides, right-padded
(`batch.padding_free`: packed for the forward; `batch.micro_batch_tokens`: B set by a token
budget; `sprout.stages.packing`); their config sections (`PairBatchConfig`, `PairDataConfig`)
are in `sprout.stages.configs`.
`PreferenceStage`: targets (`count_targets`) are pairs, each real pair (`pair_mask`) counting
1, so the loop divides the summed per-pair losses by the pairs of the whole global batch (all
micro-batches, all processes); tokens are every non-padding token of both sides; FLOPs are the
trained model's only (a reference forward is not counted). `open_preference_run` checks both
files against their manifest (and refuses a held-out file with the train file's bytes), the
init checkpoint's chat format and the model's context, and builds the accelerator and loaders.
Every rank walks the held-out pairs in the same number of micro-batches (padding pairs count
nothing), so eval works under FSDP and per-group results (`pair_groups`) reduce with the same
keys everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from data_loader.preference_batches import PreferenceLoader
from sprout.atomic import sha256_file
from sprout.chat_formats import check_trained_format, format_for
from sprout.checkpoint import checkpoint_tokenizer, init_record, read_meta
from sprout.config import require
from sprout.errors import SproutError
from sprout.formats.data_paths import PREFERENCE_FILES, resolve_data
from sprout.formats.preference_pairs import kind_group, read_preferences
from sprout.formats.verify_inputs import verify_jsonl_data
from sprout.prep.held_out import check_train_jsonl
from sprout.model.load import check_init_architecture
from sprout.model.config import ModelConfig
from sprout.engine.run_stage import start_run, with_epochs
from sprout.engine.cli import print_rank0, resolve_resume
from sprout.engine.stage import LoaderPosition, micro_steps
from sprout.stages.packing import budget_slices, packed_cost


def pair_groups(path: str | Path, loader: PreferenceLoader) -> list[list[str | None]]:
    """The held-out groups of each kept pair of `loader` (a pair is one line of `path`), one list
    per grouping: the pair's `source`, and `rejected_<kind>` (`kind_group`) for a record with a
    `rejected_kind` (None for one without). A source named like a kind's group is refused: the
    two would be counted as one."""
    records = list(read_preferences(path))
    kept = [records[pair.line - 1] for pair in loader.pairs]
    sources = [r["source"] for r in kept]
    kinds = [kind_group(r["rejected_kind"]) if "rejected_kind" in r else None for r in kept]
    if clash := sorted(set(sources) & set(kinds)):
        raise SproutError(f"{path}: source {clash[0]!r} has the name of a rejected_kind's group; rename the source")
    return [sources, kinds]


class PreferenceStage(LoaderPosition):
    """The protocol parts the preference stages share. A subclass
    gives `name`, `loss` and `evaluate`; `extend(batch, held_out)` may add tensors to each
    micro-batch (of the train file, or of the held-out file when `held_out`)."""

    generated_tokens = 0

    def __init__(self, accelerator, loader: PreferenceLoader, val: PreferenceLoader, accum_steps: int,
                 val_groups: list[list[str | None]] | None = None, *, padding_free: bool = False,
                 micro_batch_tokens: int = 0):
        self.acc, self.loader, self.val, self.accum_steps = accelerator, loader, val, accum_steps
        self.micro_pairs = loader.batch_size // accum_steps
        self.padding_free, self.micro_batch_tokens = padding_free, micro_batch_tokens  # `PairBatchConfig`'s
        self.val_groups = val_groups or []  # `pair_groups` of the held-out file: accuracy per group
        self.group_names = [sorted(set(groups) - {None}) for groups in self.val_groups]

    def add_group_sums(self, sums: dict, batch: dict, correct: torch.Tensor) -> None:
        """Add one held-out micro-batch's pairs ranked right (`correct` [B]) and pairs per group
        to `sums` (`group_sums`' keys; all-reduced with the rest)."""
        for groups, names in zip(self.val_groups, self.group_names):
            for k, v in group_sums("correct:", groups, batch["pair_index"], batch["pair_mask"], correct,
                                   names).items():
                sums[k] = sums.get(k, 0.0) + v

    def group_figures(self, tot: dict, key: str) -> dict:
        """`{key}/<group>` (pairs ranked right / pairs) and `val_pairs/<group>` (its denominator) of
        every group with held-out pairs, from the reduced sums of `add_group_sums`."""
        out = {}
        for name in (name for names in self.group_names for name in names):
            if tot[f"count:{name}"] > 0:
                out[f"{key}/{name}"] = tot[f"correct:{name}"] / tot[f"count:{name}"]
                out[f"val_pairs/{name}"] = tot[f"count:{name}"]
        return out

    def extend(self, batch: dict, held_out: bool = False) -> dict:
        return batch

    def next_micro_batches(self, step: int) -> list[dict]:
        """This rank's pairs of the step in micro-batches, each padded to its own longest side:
        accum_steps of micro_pairs, or with micro_batch_tokens consecutive pairs (at most
        micro_pairs) while their tokens fit (padded: 2 × pairs × longest side; padding_free: both
        sides' tokens), every rank running as many (`sprout.stages.packing.budget_slices`)."""
        idx = self.loader.next_batch()["pair_index"].numpy()
        cost = None
        if self.micro_batch_tokens:
            lengths = self.loader.side_lengths(idx)
            cost = packed_cost(lengths) if self.padding_free else \
                (lambda i, j: 2 * (j - i) * int(lengths[i:j].max()))
        slices = budget_slices(len(idx), self.micro_pairs, self.micro_batch_tokens, cost, self.acc, unit="pairs")
        return [self.extend(self.loader.collate(idx[s])) for s in slices]

    def eval_batches(self) -> Iterator[dict]:
        """This rank's held-out micro-batches on the device (the same number on every rank)."""
        for batch in self.val.eval_batches():
            yield {k: v.to(self.acc.device) for k, v in self.extend(batch, held_out=True).items()}

    def count_targets(self, batch: dict) -> torch.Tensor:
        return batch["pair_mask"].sum()

    def num_tokens(self, batch: dict) -> int:
        return int(batch["attention_mask"].sum())

    def logit_positions(self, batch: dict) -> int | None:
        """How many positions of the micro-batch the forward computes logits at (None: every one)."""
        return None

    def flops(self, model, batch: dict) -> float:
        """The real tokens' training FLOPs, the lm_head's only at `logit_positions`
        (`sprout.model.transformer.Transformer.training_flops`)."""
        training_flops = getattr(model, "training_flops", None)
        if training_flops is None:
            return 0.0
        return training_flops(batch["input_ids"].shape[1], self.num_tokens(batch), self.logit_positions(batch))


def split_sides(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [2B, ...] tensor of a micro-batch as its chosen half and its rejected half."""
    b = x.shape[0] // 2
    return x[:b], x[b:]


def group_sums(prefix: str, groups: list[str | None], pair_index: torch.Tensor, pair_mask: torch.Tensor,
               correct: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """{f"{prefix}{name}": correct pairs, f"count:{name}": pairs} of one micro-batch, for every
    group name (`groups`: each pair's group, `pair_groups`; the same keys on every rank, zeros
    for groups absent here)."""
    src = np.array(groups, dtype=object)[pair_index.cpu().numpy()]
    keep, hit = pair_mask.cpu().numpy(), correct.detach().cpu().numpy()
    out = {}
    for name in names:
        sel = keep & (src == name)
        out[f"{prefix}{name}"] = torch.tensor(float(hit[sel].sum()), dtype=torch.float64)
        out[f"count:{name}"] = torch.tensor(float(sel.sum()), dtype=torch.float64)
    return out


@dataclass
class PreferenceRun:
    """What `open_preference_run` built: everything a preference stage's run_* needs next."""
    cfg: object                         # the stage config with train.max_steps resolved
    base: dict                          # the init checkpoint's meta
    model_config: ModelConfig
    tokenizer: object
    accelerator: object
    loader: PreferenceLoader
    val: PreferenceLoader
    accum_steps: int
    resume: Path | None
    data: Path
    val_path: Path

    def batching(self) -> dict:
        """The stage's keyword arguments of batch.padding_free and batch.micro_batch_tokens."""
        return {"padding_free": self.cfg.batch.padding_free, "micro_batch_tokens": self.cfg.batch.micro_batch_tokens}

    def provenance(self) -> dict:
        """Fields for every checkpoint's meta: tokenizer, chat template, the init checkpoint, the data."""
        return {"tokenizer_fingerprint": self.tokenizer.fingerprint(),
                "template_version": format_for(self.tokenizer).version,
                "init": init_record(self.base),
                "preference_data": {"train": str(self.data), "val": str(self.val_path),
                                    "pairs": self.loader.counts, "val_pairs": self.val.counts}}


def open_preference_run(cfg, stage_name: str, resume: str | None = None) -> PreferenceRun:
    """Checks, accelerator, tokenizer and loaders for a preference stage: both files against the
    preference manifest.json beside them (`verify_jsonl_data`; sha256 unless data.verify is
    `sizes`), an init checkpoint trained with another chat format than its tokenizer renders
    refused, as are data.seq_len beyond the model's context, a tokenizer beyond its vocab and a
    train file holding a dev or test problem or lacking the prep's record of them
    (`sprout.prep.held_out.check_train_jsonl`), and a held-out file that is a copy of the train
    file (the same file is refused by `resolve_data`); a
    pair that does not fit is dropped or its prompt shortened (`data.truncation`), counted and
    printed; train.max_steps resolved from data.epochs when null.

    `cfg` has init, data (PairDataConfig), batch (PairBatchConfig), train and out."""
    if not cfg.init:
        raise SproutError("no init model: set init in the config or pass --init CHECKPOINT")
    if not cfg.data.path:
        raise SproutError("no preference data: set data.path in the config or pass --data DIR (or FILE.jsonl)")
    data, val = resolve_data(cfg.data.path, PREFERENCE_FILES, cfg.data.val_path)
    base = read_meta(cfg.init)  # resolves run dir / latest pointer, verifies every file's sha256
    check_init_architecture(base, stage_name)
    model_cfg = ModelConfig(**base["model_config"])
    tok = checkpoint_tokenizer(base)
    check_trained_format(base.get("template_version"), format_for(tok), str(Path(base["path"]) / "meta.json"))
    if tok.vocab_size > model_cfg.vocab_size:
        raise SproutError(f"{Path(base['path']) / 'meta.json'}: its tokenizer has {tok.vocab_size} ids but the "
                          f"model has vocab_size {model_cfg.vocab_size}")
    seq_len = cfg.data.seq_len or model_cfg.max_seq_len
    if seq_len > model_cfg.max_seq_len:
        raise SproutError(f"data.seq_len {seq_len} exceeds max_seq_len {model_cfg.max_seq_len} of the init "
                          f"checkpoint {base['path']}")
    require(not cfg.batch.micro_batch_tokens or cfg.batch.micro_batch_tokens >= 2 * seq_len,
            "batch.micro_batch_tokens", cfg.batch.micro_batch_tokens,
            f"0 or at least 2 × data.seq_len = {2 * seq_len} (both sides of the longest pair must fit a micro-batch)")
    check = verify_jsonl_data(data, val, cfg.data.verify, kind="preference")
    check_train_jsonl(data, read_preferences(data))
    if data.stat().st_size == val.stat().st_size and sha256_file(data) == sha256_file(val):
        raise SproutError(f"{'data.val_path ' if cfg.data.val_path else ''}{val}: the same pairs as the train file "
                          f"{data} (a copy); held-out figures over the pairs the model trains on measure nothing: "
                          f"name a held-out file")
    print_rank0(check.report("preference files"))
    resume_path = resolve_resume(resume, cfg.out)

    acc = start_run(cfg.train, cfg.out)
    accum = micro_steps(cfg.batch.global_pairs, cfg.batch.micro_pairs, acc.num_processes, unit="pairs")
    rank, world, trunc = acc.process_index, acc.num_processes, cfg.data.truncation
    loader = PreferenceLoader(data, tok, cfg.batch.micro_pairs * accum, seq_len, truncation=trunc,
                              seed=cfg.train.seed, rank=rank, world_size=world)
    if loader.steps_per_epoch == 0:
        raise SproutError(f"{data}: {loader.num_pairs} pairs cannot fill one global batch of "
                          f"{loader.global_batch} pairs (batch.global_pairs)")
    val_loader = PreferenceLoader(val, tok, cfg.batch.micro_pairs, seq_len, truncation=trunc, rank=rank,
                                  world_size=world, shuffle=False)
    cfg = with_epochs(cfg, loader.steps_per_epoch)
    for path, ld in ((data, loader), (val, val_loader)):
        c = ld.counts
        acc.print(f"{stage_name}: {path}: {c['pairs']:,} of {c['pairs_read']:,} pairs fit {seq_len} tokens "
                  f"({c['dropped_too_long']:,} dropped as too long, {c['truncated']:,} with a shortened prompt)")
    acc.print(f"{stage_name}: {loader.steps_per_epoch} steps per epoch; init {base['path']} (step {base.get('step')})")
    return PreferenceRun(cfg, base, model_cfg, tok, acc, loader, val_loader, accum, resume_path, data, val)
