"""The trainer rows of benchmarks/trl_compare.py: DPO and SFT (GRPO: trl_compare_grpo.py), sprout's
stage against TRL's trainer, and what every row shares (`Bench`, `Row`).

Each row builds both sides from the same run folder (sprout: `sprout.model.load.load_model`;
TRL: the transformers export of the same weights), the same data (arithmetic problems from
`sprout.prep.arithmetic`, in conversational form) and the same batch, times optimizer steps
on each in alternation (`Bench.time_side_by_side`) and checks the first batch's loss: the same
tensors fed to both loss functions, initial weights on both sides (see each row's function),
on `Bench.precision`'s device and in its precision (trl_compare_device.py).
With `Bench.lora` set (benchmarks/trl_compare_lora.py) both sides train LoRA adapters instead,
and each check runs once more with the same non-zero adapters on both.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from data_loader.preference_batches import PreferenceLoader
from sprout.chat import render
from sprout.engine.trainer import TrainConfig, Trainer
from sprout.engine.optim import OptimConfig, build_optimizer
from sprout.formats.preference_pairs import write_preferences
from sprout.model.load import load_model
from sprout.prep.arithmetic import generate as arithmetic_problems
from sprout.prep.arithmetic import wrong_answer
from sprout.stages.dpo import DPOLossConfig, DPOStage
from sprout.stages.sft import SFTStage
from trl_compare_device import Precision


# ---- what every row shares ----------------------------------------------------------------------
@dataclass
class Row:
    """One line of the table: sprout's median and the other side's, in `unit`; `speedup` is
    sprout's speed over the other's; `check` the first-batch comparison {what: max |diff|};
    `step` runs one more sprout step (for --profile) with `phases` {label: (object, method
    name)} labelled."""
    name: str
    unit: str
    sprout: float
    other: float
    speedup: float
    target: float
    check: dict[str, float]
    notes: list[str] = field(default_factory=list)
    step: Callable | None = None
    phases: dict = field(default_factory=dict)


@dataclass
class Bench:
    """The run folder, its transformers export, both tokenizers, a scratch folder, the options and
    the device and precision of both sides; `lora` (trl_compare_lora.Adapters) makes both sides
    train LoRA adapters instead of every weight."""
    args: argparse.Namespace
    run: str
    hf: Path
    tmp: Path
    tok: object      # sprout's tokenizer of the run
    hf_tok: object   # transformers' tokenizer of the export
    context: int     # the model's max_seq_len
    precision: Precision = Precision()
    lora: object | None = None

    @property
    def total_steps(self) -> int:
        return self.args.warmup + self.args.steps

    def sprout_model(self):
        """A fresh sprout model with the run's weights (fp32, train mode, on the device), with LoRA
        adapters (B = 0) in a LoRA row."""
        model = load_model(self.run)[0].train()
        if self.lora is not None:
            self.lora.add(model)
        return model.to(self.precision.device)

    def reference(self, policy):
        """The policy's frozen reference: a fresh copy, or in a LoRA row the policy with its adapters off."""
        return self.lora.reference(policy) if self.lora is not None else self.sprout_model()

    def trl_options(self) -> dict:
        """What a TRL trainer takes besides its model: in a LoRA row the peft config."""
        return {} if self.lora is None else {"peft_config": self.lora.peft_config()}

    def hf_model(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.hf, dtype=torch.float32).to(self.precision.device)

    def sprout_trainer(self, model, lr: float) -> Trainer:
        """sprout's loop with AdamW as transformers' default (betas 0.9/0.999, no weight decay),
        a constant lr, clipping at 1, the precision's mixed_precision on its device."""
        cfg = TrainConfig(max_steps=10**6, progress=False, peak_tflops=-1, mixed_precision=self.precision.mixed_precision)
        optim = OptimConfig(lr=lr, warmup_steps=0, weight_decay=0.0, beta2=0.999)
        return Trainer(self.precision.accelerator(), model, build_optimizer(model, optim), lambda step, peak: peak,
                       cfg)

    def trl_config(self, cls, name: str, lr: float, **options):
        """A TRL *Config alike: the precision's device and bf16 (or fp32), no gradient
        checkpointing (TRL's default is on), no saving, no logging, constant lr, AdamW without
        weight decay, clipping at 1."""
        return cls(output_dir=str(self.tmp / name), report_to="none", save_strategy="no",
                   **self.precision.trl_options(), gradient_checkpointing=False, max_steps=self.total_steps, learning_rate=lr,
                   lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_strategy="no",
                   disable_tqdm=True, seed=0, **options)

    def time_side_by_side(self, trl, sprout_step: Callable) -> tuple[list[float], list[float]]:
        """(sprout's, TRL's) optimizer step times in alternation, after --warmup of each:
        `trl.train()` runs, and at the end of each of its optimizer steps a callback runs one
        `sprout_step()`. TRL's step time runs from the end of the previous sprout step to the
        end of its own, so neither side's time holds the other's and load from other
        processes falls on both alike. On CUDA each timestamp waits for the queued kernels."""
        from transformers import TrainerCallback
        from transformers.trainer_callback import PrinterCallback

        ours, theirs, clock = [], [], self.precision.clock

        class Alternate(TrainerCallback):
            mark = 0.0

            def on_train_begin(self, *args, **kwargs):
                self.mark = clock()

            def on_step_end(self, *args, **kwargs):
                theirs.append(clock() - self.mark)
                if not trl.accelerator.sync_gradients:  # accelerate's gradient state is shared by both loops
                    raise RuntimeError("a sprout step inside TRL's gradient accumulation would skip its update")
                t0 = clock()
                sprout_step()
                ours.append(clock() - t0)
                self.mark = clock()

        trl.add_callback(Alternate())
        trl.remove_callback(PrinterCallback)
        trl.train()
        return ours[self.args.warmup:], theirs[self.args.warmup:]


def problems(count: int) -> list:
    """`count` distinct arithmetic problems, all four levels in turn (seed 0)."""
    out = list(arithmetic_problems(count, levels=(1, 2, 3, 4), seed=0, split="all"))
    if len(out) < count:
        raise SystemExit(f"error: only {len(out)} arithmetic problems for {count} needed; use fewer steps")
    return out


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def shifted(ids: torch.Tensor, attention: torch.Tensor, trained: torch.Tensor) -> dict:
    """Right-padded rows as sprout's losses read them: every token an input, targets[:, t] =
    ids[:, t + 1], loss_mask where that target is trained (`trained[:, t]`: token t is a
    target), segment 1 on real tokens, positions from 0 in each row."""
    real = attention.bool()
    targets = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    loss_mask = torch.zeros_like(real)
    loss_mask[:, :-1] = trained[:, 1:].bool() & real[:, 1:]
    positions = (real.long().cumsum(1) - 1).clamp(min=0) * real
    return {"input_ids": ids, "targets": targets, "loss_mask": loss_mask, "attention_mask": real,
            "segment_ids": real.long(), "position_ids": positions}


def padded(rows: list[list[int]], masks: list[list[int]], pad_id: int) -> dict:
    """`shifted` of token rows and their trained-token masks, right-padded to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    trained = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return shifted(ids, attention, trained)


def compare_tokens(ours: list[tuple], theirs: list[tuple], decode) -> str:
    """How sprout's rendering of some sequences, (ids, trained mask) each, compares with TRL's:
    the ids, then the tokens only one side trains (decoded, with their counts)."""
    n = len(ours)
    aligned = [(o, om, t, tm) for (o, om), (t, tm) in zip(ours, theirs) if t[:len(o)] == o or o[:len(t)] == t]
    tails = {tuple(t[len(o):]) for o, _, t, _ in aligned}
    if all(o == t for (o, _), (t, _) in zip(ours, theirs)):
        ids = f"same ids in all {n} sequences"
    elif len(aligned) == n and len(tails) == 1:
        ids = f"ids differ: TRL's = sprout's + {decode(list(tails.pop()))!r} in all {n} sequences"
    else:
        ids = f"ids differ in {sum(o != t for (o, _), (t, _) in zip(ours, theirs))} of {n} sequences"
    only = {"TRL": Counter(), "sprout": Counter()}
    for o, om, t, tm in aligned:
        for i in range(max(len(o), len(t))):
            a, b = i < len(om) and bool(om[i]), i < len(tm) and bool(tm[i])
            if a != b:
                only["TRL" if b else "sprout"][decode([(t if b else o)[i]])] += 1
    trained = [f"trained only by {who}: " + ", ".join(f"{k!r} x{v}" for k, v in c.items())
               for who, c in only.items() if c]
    return "; ".join([ids, *(trained or ["same trained tokens"])])


def trl_side(example: dict, side: str) -> tuple[list[int], list[int]]:
    """(ids, trained mask) of one side of a pair as TRL's DPOTrainer tokenized it."""
    prompt, answer = example["prompt_ids"], example[side]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def first_loss(b: Bench, stage, model, batch: dict) -> tuple[float, dict]:
    """A stage's loss on one micro-batch (its summed loss over its targets) and its metrics
    (each sum over its count), no gradient, the batch on the device, under the precision's autocast."""
    with torch.no_grad(), b.precision.autocast():
        loss_sum, n, metrics = stage.loss(model, b.precision.to(batch))
    return float(loss_sum) / float(n), {k: float(s) / float(c) for k, (s, c) in metrics.items() if float(c)}


def median(times: list[float]) -> float:
    return statistics.median(times)


# ---- DPO ----------------------------------------------------------------------------------------
def dpo(b: Bench) -> Row:
    """DPOStage (live reference: a frozen copy, one forward per micro-batch) against TRL's
    DPOTrainer (a reference model passed in, precompute_ref_log_probs off) on the same pairs,
    beta, sigmoid loss and batch (--pairs per micro-batch, --accum micro-batches per step).
    Check: TRL's collated first --pairs pairs through TRL's compute_loss and, converted
    (`shifted`: TRL's completion mask as the trained tokens), through DPOStage.loss; also
    sprout's own rendering of those pairs (`PreferenceLoader.collate`) against TRL's loss. At
    the initial weights the policy is the reference, so the loss is log 2 whatever the
    log-probs: the summed log-probs of each side (TRL's logps/chosen and logps/rejected
    metrics, means over the pairs) are compared too."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    a = b.args
    B, K = a.pairs, a.accum
    rng = random.Random(0)
    records = [{"id": f"p{i}", "source": "arithmetic", "prompt": user(p.question), "chosen": assistant(p.worked),
                "rejected": assistant(wrong_answer(p, rng)[0])} for i, p in enumerate(problems((b.total_steps + 1) * B * K))]
    write_preferences(b.tmp / "preferences.jsonl", records)

    trainer = b.sprout_trainer(b.sprout_model(), 5e-7)
    loader = PreferenceLoader(b.tmp / "preferences.jsonl", b.tok, B * K, b.context, shuffle=False)
    stage = DPOStage(trainer.accelerator, loader, None, K, DPOLossConfig(loss_type="sigmoid", beta=a.beta),
                     ref_model=b.reference(trainer.model))
    stage.setup(trainer)

    cfg = b.trl_config(DPOConfig, "dpo", 5e-7, per_device_train_batch_size=B, gradient_accumulation_steps=K,
                       beta=a.beta, loss_type=["sigmoid"], max_length=None, precompute_ref_log_probs=False)
    data = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in records])
    trl = DPOTrainer(model=b.hf_model(), ref_model=None if b.lora else b.hf_model(), args=cfg, train_dataset=data,
                     processing_class=b.hf_tok, **b.trl_options())  # with peft: the reference is its adapters off

    # the check first: both sides still hold the initial weights
    trl_batch = b.precision.to(trl.data_collator([trl.train_dataset[i] for i in range(B)]))
    policy = b.sprout_model()
    pair_fields = {"pair_mask": torch.ones(B, dtype=torch.bool), "margin": torch.zeros(B), "pair_index": torch.arange(B)}
    same_tensors = {**shifted(trl_batch["input_ids"], trl_batch["attention_mask"], trl_batch["completion_mask"]),
                    **pair_fields}

    def losses() -> tuple[float, float, float]:
        """(TRL's loss, sprout's on TRL's tensors, largest |diff| of the summed log-probs' means)."""
        with torch.no_grad(), b.precision.autocast():
            theirs = float(trl.compute_loss(trl.model, trl_batch))
        ours, metrics = first_loss(b, stage, policy, same_tensors)
        trl_metrics = trl._metrics["train" if trl.model.training else "eval"]
        return theirs, ours, max(abs(metrics[k] - trl_metrics[k][-1]) for k in ("logps/chosen", "logps/rejected"))

    loss_theirs, same, logp_err = losses()
    own = first_loss(b, stage, policy, loader.collate(np.arange(B)))[0]
    check = {"loss": abs(same - loss_theirs), "logps": logp_err}
    if b.lora is not None:  # again with the same non-zero adapters on both: the policy is no longer the reference
        with b.lora.same_adapters(trl.model, policy):
            adapted = losses()
        check.update({"adapted loss": abs(adapted[1] - adapted[0]), "adapted logps": adapted[2]})
    n = len(records)
    tokens = compare_tokens([(p.chosen.tolist(), p.chosen_mask) for p in loader.pairs]
                            + [(p.rejected.tolist(), p.rejected_mask) for p in loader.pairs],
                            [trl_side(trl.train_dataset[i], side) for side in ("chosen_ids", "rejected_ids")
                             for i in range(n)], b.hf_tok.decode)

    def step():
        trainer.step(stage.next_micro_batches(trainer.steps_done), stage)

    ours, theirs = b.time_side_by_side(trl, step)
    return Row("DPO step", "s", median(ours), median(theirs), median(theirs) / median(ours), 1.1, check,
               [f"{B} pairs per micro-batch ({int(trl_batch['attention_mask'].sum())} tokens in TRL's first), "
                f"{K} per step, beta {a.beta}, sigmoid, reference live in both: "
                + ("the policy with its adapters off" if b.lora is not None else "a frozen copy"),
                f"first micro-batch's loss: TRL {loss_theirs:.6f}; sprout on TRL's tensors {same:.6f}, on its own "
                f"rendering {own:.6f} (|diff| {abs(own - loss_theirs):.1e}); the initial policy is the reference, "
                f"so that loss is log 2 on both sides and the summed log-probs (mean over the pairs, chosen and "
                f"rejected: |diff| {logp_err:.1e}) carry the check",
                *([f"with the same non-zero adapters on both sides: loss TRL {adapted[0]:.6f}, sprout "
                   f"{adapted[1]:.6f}"] if b.lora is not None else []),
                tokens],
               step, {"forwards + loss": (stage, "pair_terms"), "reference forward (in it)": (stage, "_ref_logps"),
                "backward": (trainer.accelerator, "backward"), "optimizer step": (trainer.optimizer, "step")})


# ---- SFT ----------------------------------------------------------------------------------------
def sft(b: Bench) -> Row:
    """SFTStage's loss under sprout's loop against TRL's SFTTrainer with completion-only loss, on
    the same conversations (prompt: the question; completion: the worked answer), one per row,
    right-padded to the micro-batch's longest in both (sprout's own SFT data would pack them),
    --rows per micro-batch, --accum per step. Check: TRL's collated first --rows
    conversations through TRL's compute_loss and, converted (`shifted`: TRL's labels as the
    trained tokens), through SFTStage's loss (`first_loss`); also sprout's own rendering against TRL's."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    a = b.args
    R, K = a.rows, a.accum
    convs = [(user(p.question), assistant(p.worked)) for p in problems((b.total_steps + 1) * R * K)]
    rendered = [render(prompt + answer, b.tok) for prompt, answer in convs]
    pad = b.tok.pad_id if b.tok.pad_id is not None else b.tok.eot_id
    micro = [padded(*map(list, zip(*rendered[i:i + R])), pad) for i in range(0, len(rendered), R)]

    trainer = b.sprout_trainer(b.sprout_model(), 3e-5)
    stage = SFTStage(trainer.accelerator, None, None, K)

    def step():
        start = trainer.steps_done * K % len(micro)
        trainer.step(micro[start:start + K], stage)

    cfg = b.trl_config(SFTConfig, "sft", 3e-5, per_device_train_batch_size=R, gradient_accumulation_steps=K,
                       completion_only_loss=True, packing=False, max_length=None, shuffle_dataset=False)
    data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in convs])
    trl = SFTTrainer(model=b.hf_model(), args=cfg, train_dataset=data, processing_class=b.hf_tok, **b.trl_options())

    trl_batch = b.precision.to(trl.data_collator([trl.train_dataset[i] for i in range(R)]))
    model = b.sprout_model()
    same_tensors = shifted(trl_batch["input_ids"], trl_batch["attention_mask"], trl_batch["labels"] != -100)

    def losses() -> tuple[float, float]:
        """(TRL's loss, sprout's on TRL's tensors)."""
        with torch.no_grad(), b.precision.autocast():
            theirs = float(trl.compute_loss(trl.model, trl_batch))
        return theirs, first_loss(b, stage, model, same_tensors)[0]

    loss_theirs, same = losses()
    own = first_loss(b, stage, model, micro[0])[0]
    check = {"loss": abs(same - loss_theirs)}
    if b.lora is not None:  # again with the same non-zero adapters on both sides
        with b.lora.same_adapters(trl.model, model):
            adapted = losses()
        check["adapted loss"] = abs(adapted[1] - adapted[0])
    tokens = compare_tokens(rendered, [(x["input_ids"], [int(t != -100) for t in x["labels"]])
                                       for x in (trl.train_dataset[i] for i in range(len(convs)))], b.hf_tok.decode)

    ours, theirs = b.time_side_by_side(trl, step)
    return Row("SFT step", "s", median(ours), median(theirs), median(theirs) / median(ours), 1.1, check,
               [f"{R} conversations per micro-batch ({int(trl_batch['attention_mask'].sum())} tokens in TRL's "
                f"first), {K} per step, completion-only loss",
                f"first micro-batch's loss: TRL {loss_theirs:.6f}; sprout on TRL's tensors {same:.6f}, on its own "
                f"rendering {own:.6f} (|diff| {abs(own - loss_theirs):.1e})",
                *([f"with the same non-zero adapters on both sides: loss TRL {adapted[0]:.6f}, sprout "
                   f"{adapted[1]:.6f}"] if b.lora is not None else []),
                tokens],
               step, {"forward + loss": (stage, "loss"), "backward": (trainer.accelerator, "backward"),
                      "optimizer step": (trainer.optimizer, "step")})
