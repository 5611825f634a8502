"""What every stage's script does around the loop: resume checks, config, fit, report.

A stage's `run_*` function checks its own inputs, builds the accelerator (`start_run`), the
model and its `Stage`, then hands over to `train_stage`, which
  - builds the optimizer over the stage's parameter groups (`param_groups`, optional) and
    lets the stage prepare its frozen models (`setup`, optional),
  - copies the tokenizer file into <out>/tokenizer/ and records it, with its sha256, in each
    checkpoint (`sprout.checkpoint.bundle_tokenizer`), so the run folder works from anywhere,
  - records in each checkpoint the config and the part of it a resume must match
    (`sprout.config.resume_config`: every field not declared `resume_free`),
  - resumes when asked (refusing a checkpoint made with a different config),
  - prints the resolved config and saves it as <out>/config.yaml (rank 0),
  - runs `Trainer.fit` and prints the eval before and after training.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from sprout.atomic import atomic_write
from sprout.checkpoint import bundle_tokenizer, resolve_checkpoint
from sprout.config import config_to_dict, dump_yaml, load_config, resume_config
from sprout.train.fsdp import local_params
from sprout.train.loop import TrainConfig, Trainer, make_accelerator, resolve_max_steps
from sprout.train.optim import build_optimizer, lr_schedule
from sprout.train.schedule import warmup_warning


def run_parser(doc: str, config_example: str) -> argparse.ArgumentParser:
    """The arguments every training script shares: --config, --out, --resume [PATH|latest].

    A script adds its own (--data, --init, ...); `parse_run_config` then reads the config with
    the remaining `--section.field VALUE` overrides.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"YAML config ({config_example})")
    p.add_argument("--out", help="run directory; overrides out")
    p.add_argument("--resume", nargs="?", const="latest", metavar="PATH|latest",
                   help="continue from a checkpoint (default: the latest in --out)")
    return p


def parse_run_config(parser: argparse.ArgumentParser, config_cls):
    """(args, config): the YAML config with dotted overrides applied, then --out."""
    args, overrides = parser.parse_known_args()
    cfg = load_config(config_cls, args.config, overrides)
    if args.out:
        cfg.out = args.out
    return args, cfg


def start_run(train_cfg: TrainConfig, out: str | Path) -> Accelerator:
    """The accelerator for a run, with every process seeded alike (same initial weights)."""
    acc = make_accelerator(train_cfg, out)
    set_seed(train_cfg.seed)
    return acc


def with_max_steps(cfg, num_params: int):
    """`cfg` (with `train` and a token `batch` section) with train.max_steps resolved (Chinchilla when null)."""
    steps = resolve_max_steps(cfg.train, num_params, cfg.batch.global_tokens)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps))


def resolve_resume(resume: str | None, out: str | Path) -> Path | None:
    """--resume PATH, or `latest` for the newest checkpoint in the run's own folder."""
    if not resume:
        return None
    return resolve_checkpoint(Path(out) / "checkpoints" if resume == "latest" else resume)


def train_stage(acc: Accelerator, model, stage, cfg, *, resume: Path | None = None, tokenizer: str | None = None,
                micro_steps: int | None = None, extra_meta: dict | None = None) -> dict:
    """Build the Trainer for `stage`, resume if asked, save/print the config, fit, report.

    `cfg` has `train` (TrainConfig), `optim` (OptimConfig), `batch` and `out`; `extra_meta`:
    more fields for every checkpoint's meta.json (e.g. the chat-template version of an SFT run).
    """
    train_cfg, out = cfg.train, Path(cfg.out)
    meta = {"model_config": config_to_dict(model.config), "tokenizer": tokenizer, "config": config_to_dict(cfg),
            "resume_config": resume_config(cfg), **bundle_tokenizer(tokenizer, out, write=acc.is_main_process),
            **(extra_meta or {})}
    groups = stage.param_groups(model) if hasattr(stage, "param_groups") else None
    trainer = Trainer(acc, model, build_optimizer(model, cfg.optim, groups), lr_schedule(cfg.optim, train_cfg.max_steps),
                      train_cfg, grad_clip=cfg.optim.grad_clip, out_dir=out, meta=meta)
    if hasattr(stage, "setup"):
        stage.setup(trainer)
    if resume is not None:
        trainer.resume(resume, stage)
    acc.print(dump_yaml(cfg), end="")
    if acc.is_main_process:
        with atomic_write(out / "config.yaml", "w") as f:
            f.write(dump_yaml(cfg))
    acc.print(f"{stage.name}: model {model.num_params():,} params | {acc.num_processes} process(es)"
              + (f" × {micro_steps} micro-steps" if micro_steps else "")
              + f" | {train_cfg.max_steps} steps; batch " + ", ".join(f"{k} {v:,}" for k, v in vars(cfg.batch).items()))
    if warning := warmup_warning(cfg.optim.warmup_steps, train_cfg.max_steps):
        acc.print(warning)
    if trainer.sharded:  # counted from the parameter tensors themselves: a DDP run holds them all
        acc.print(f"FSDP: parameters sharded over {acc.num_processes} process(es); rank 0 holds "
                  f"{local_params(trainer.model):,} of {model.num_params():,}")
    result = trainer.fit(stage)
    first, last = result["first_eval"], result["last_eval"]
    for label, rec in (("before training" if first and first["step"] == 0 else "first eval", first),
                       ("after training", last)):
        if rec is not None:
            values = "  ".join(f"{k} {v:.4f}" for k, v in rec.items() if k.startswith("val_"))
            acc.print(f"{label} (step {rec['step']}): {values}")
    end_processes(acc)
    return result


def end_processes(acc: Accelerator) -> None:
    """Barrier, then tear down the process group: gloo's threads left running at
    interpreter exit abort the process ("terminate called without an active exception")."""
    acc.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
