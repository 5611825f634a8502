"""What every stage does around the loop once its config is resolved: accelerator, run length, fit, report.

A script resolves its stage's config and checks the run folder first (`sprout.engine.cli`, no
torch). A stage's `run_*` function checks its own inputs, builds the accelerator (`start_run`),
the model and its `Stage`, resolves train.max_steps when null (`with_max_steps`, `with_epochs`),
with LoRA adds the adapters (`apply_lora`), takes its reference (`reference_model`: the policy
with its adapters off, or a frozen copy) and the frozen-model records its checkpoints need
(`frozen_models_meta`), then calls `train_stage` (its docstring gives the order of its steps).

Invariants: the run folder is held from before its first write to the end, and inputs and a
resumed checkpoint are checked before anything in it changes; a setup that ends before the
first step leaves the folder as it was. A SIGINT / SIGTERM ends the process with 128 + its
number: during training after a checkpoint (printing the command that resumes it), after the
last step once the report is written.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from sprout.atomic import atomic_write
from sprout.checkpoint import bundle_tokenizer, frozen_model_record
from sprout.config import config_to_dict, dump_yaml, resume_config
from sprout.engine.configs import StageConfig, TrainConfig
from sprout.engine.training_loop import fit
from sprout.engine.fsdp import local_params
from sprout.engine.trainer import Trainer, make_accelerator, resolve_max_steps
from sprout.engine.optim import build_optimizer, lr_schedule
from sprout.engine.cli import clear_deferred, latest_step, print_rank0, resume_command, run_lock
from sprout.engine.schedule import warmup_warning
from sprout.model.lora import AdaptersOff, add_adapters, lora_record


def start_run(train_cfg: TrainConfig, out: str | Path) -> Accelerator:
    """The accelerator for a run, with every process seeded alike (same initial weights)."""
    acc = make_accelerator(train_cfg, out)
    set_seed(train_cfg.seed)
    return acc


def with_max_steps(cfg, num_params: int):
    """`cfg` (with `train` and a token `batch` section) with train.max_steps resolved (Chinchilla
    when null / auto, printed)."""
    steps = resolve_max_steps(cfg.train, num_params, cfg.batch.global_tokens)
    if cfg.train.max_steps is None:
        print_rank0(f"train.max_steps auto: {steps:,} steps ({cfg.train.chinchilla_ratio:g} tokens per parameter × "
                    f"{num_params:,} parameters / {cfg.batch.global_tokens:,} tokens per step)")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps))


def with_epochs(cfg, batches_per_epoch: int, steps_per_batch: int = 1):
    """`cfg` (with `train` and a `data` section with `epochs`) with train.max_steps, when null,
    from data.epochs: epochs × batches per epoch (at least one batch) × optimizer steps per batch."""
    steps = cfg.train.max_steps or max(1, math.ceil(cfg.data.epochs * batches_per_epoch)) * steps_per_batch
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps))


def apply_lora(model, cfg, base: dict) -> dict:
    """With cfg.lora.r > 0, LoRA adapters in `model`, in place (`sprout.model.lora.add_adapters`,
    from train.seed), and the meta.json fields of a LoRA run: `lora` (its settings) and
    frozen_models' `base` (the init checkpoint of meta `base`, which its checkpoints need);
    with r 0, nothing: {}. A reference that is the base is then `AdaptersOff(model)`
    (`reference_model`)."""
    if cfg.lora.off:
        return {}
    targets = add_adapters(model, cfg.lora, seed=cfg.train.seed)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print_rank0(f"lora: r {cfg.lora.r}, alpha {cfg.lora.alpha:g} on {', '.join(targets)}; training {trained:,} "
                f"of {model.num_params():,} parameters; base {base['path']}")
    return {"lora": lora_record(cfg.lora, targets), "frozen_models": {"base": frozen_model_record(base)}}


def reference_model(policy, lora: dict, frozen_copy, *, base_is_reference: bool) -> tuple[object, str]:
    """(the reference, how it is held): the policy with its LoRA adapters off when `lora` (apply_lora's
    fields) is not empty and the reference is the policy's base, else `frozen_copy()`."""
    if lora and base_is_reference:
        return AdaptersOff(policy), "the policy with its LoRA adapters off"
    return frozen_copy(), "frozen copy"


def frozen_models_meta(lora: dict, **frozen: dict) -> dict:
    """The meta.json fields of a run: apply_lora's `lora`, and `frozen_models` holding both the
    stage's own frozen models (`frozen`: reference, reward_model, ...) and a LoRA run's base."""
    return {**lora, "frozen_models": {**frozen, **lora.get("frozen_models", {})}}


def train_stage(acc: Accelerator, model, stage, cfg: StageConfig, *, resume: Path | None = None,
                tokenizer: str | None = None, micro_steps: int | None = None, extra_meta: dict | None = None) -> dict:
    """Build the Trainer for `stage`, resume if asked, save/print the config, fit, report.

    In this order: holds the run folder (`sprout.engine.cli.run_lock`) and, after --overwrite,
    moves the old run's files aside (deleted at the first step); builds the optimizer over the
    stage's parameter groups; on a resume checks the checkpoint first (`Trainer.check_resume`:
    sha256, the config a resume must match, the stage, the frozen models), then lets the stage
    prepare its frozen models (`setup`); copies the tokenizer into <out>/tokenizer/ and records
    it with its sha256 (`sprout.checkpoint.bundle_tokenizer`); records the config and its resume
    part (`sprout.config.resume_config`); resumes (weights, optimizer, RNG, loader position);
    saves <out>/config.yaml (rank 0; a resumed run that fails before its first new checkpoint
    puts back the one it resumed from); runs `sprout.engine.training_loop.fit`.

    `cfg` has a `batch` section besides StageConfig's; `extra_meta`: more fields for every
    checkpoint's meta.json (e.g. the chat-template version of an SFT run).
    """
    with run_lock(cfg.out, acc.is_main_process):
        train_cfg, out = cfg.train, Path(cfg.out)
        clear_deferred(out, acc.is_main_process)  # --overwrite: the inputs are checked, the new run writes next
        meta = {"model_config": config_to_dict(model.config), "tokenizer": tokenizer, "config": config_to_dict(cfg),
                "resume_config": resume_config(cfg), **bundle_tokenizer(tokenizer, out, write=acc.is_main_process),
                **(extra_meta or {})}
        groups = stage.param_groups(model) if hasattr(stage, "param_groups") else None
        trainer = Trainer(acc, model, build_optimizer(model, cfg.optim, groups),
                          lr_schedule(cfg.optim, train_cfg.max_steps), train_cfg, grad_clip=cfg.optim.grad_clip,
                          out_dir=out, meta=meta)
        saved = trainer.check_resume(resume, stage) if resume is not None else None  # refused before setup
        if hasattr(stage, "setup"):
            stage.setup(trainer)
        if saved is not None:
            trainer.resume(saved, stage)
        acc.print(dump_yaml(cfg), end="")
        # a resume that fails before its first new checkpoint leaves config.yaml as it was (b"" : none)
        resumed_config = None
        if resume is not None and acc.is_main_process:
            resumed_config = (out / "config.yaml").read_bytes() if (out / "config.yaml").is_file() else b""
        if acc.is_main_process:
            with atomic_write(out / "config.yaml", "w") as f:
                f.write(dump_yaml(cfg))
        acc.print(f"{stage.name}: model {model.num_params():,} params | {acc.num_processes} process(es)"
                  + (f" × {micro_steps} micro-steps" if micro_steps else "")
                  + f" | {train_cfg.max_steps} steps; batch "
                  + ", ".join(f"{k} {v:,}" for k, v in vars(cfg.batch).items()))
        if warning := warmup_warning(cfg.optim.warmup_steps, train_cfg.max_steps):
            acc.print(warning)
        if trainer.sharded:  # counted from the parameter tensors themselves: a DDP run holds them all
            acc.print(f"FSDP: parameters sharded over {acc.num_processes} process(es); rank 0 holds "
                      f"{local_params(trainer.model):,} of {model.num_params():,}")
        latest_before = latest_step(out)
        try:
            result = fit(trainer, stage)
        except BaseException:
            # a checkpoint saved by this run was made under the new config, which stays with it
            if resumed_config is not None and latest_step(out) == latest_before:
                if resumed_config:
                    with atomic_write(out / "config.yaml", "wb") as f:
                        f.write(resumed_config)
                else:
                    (out / "config.yaml").unlink(missing_ok=True)
            raise
        first, last = result["first_eval"], result["last_eval"]
        for label, rec in (("before training" if first and first["step"] == 0 else "first eval", first),
                           ("after training", last if not result.get("interrupted") else None)):
            if rec is not None:
                values = "  ".join(f"{k} {v:.4f}" for k, v in rec.items() if k.startswith("val_"))
                acc.print(f"{label} (step {rec['step']}): {values}")
        end_processes(acc)
        if result.get("interrupted"):
            signum = result["interrupted"]
            if acc.is_main_process:
                print(f"stopped by {signal.Signals(signum).name} at step {result['steps']} of {train_cfg.max_steps}; "
                      f"checkpoint {result['checkpoint']}\nresume with:\n  {resume_command(out, acc.num_processes)}",
                      flush=True)
            raise SystemExit(128 + signum)
        if result.get("signalled"):  # after the last step: the run is complete, but the command was stopped
            signum = result["signalled"]
            if acc.is_main_process:
                print(f"stopped by {signal.Signals(signum).name} after the last step: {out} is complete at step "
                      f"{result['steps']} (checkpoint {result['checkpoint']}) and its report written", flush=True)
            raise SystemExit(128 + signum)
        return result


def end_processes(acc: Accelerator) -> None:
    """Barrier, then tear down the process group: gloo's threads left running at
    interpreter exit abort the process ("terminate called without an active exception")."""
    acc.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
