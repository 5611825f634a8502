"""Trainer: one optimizer step over one global batch, the checkpoint and the resume.

`Trainer.step(micro_batches, stage)` counts every micro-batch's targets (`stage.count_targets`)
and all-reduces the count before any backward: N, the targets of the whole global batch. Each
micro-batch backpropagates `loss_sum * world_size / N` (DDP and FSDP average gradients over
ranks; the world_size factor turns their mean into the sum), gradients synchronised on the last
micro-batch only. The gradient is then d(sum of per-target losses)/N whatever the split into
micro-batches and processes: 1 process with 2 micro-steps equals 2 processes with 1. One
all-reduce (`all_reduce_sums`) of the loss sum, n, tokens, FLOPs and every metric's sum and
count follows: the logged loss is the reduced loss sum / N, each metric its reduced sum / its
reduced count (`stage.derived_metrics`, optional, adds figures that are no such ratio, a std).
A NaN/inf loss or gradient norm stops the run before the weights change (`NonFiniteLoss`);
then clip, each parameter group's lr from the schedule, AdamW step. The stage protocol is
`sprout.engine.stage`; the outer loop, `sprout.engine.training_loop.fit`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import uuid
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from sprout.checkpoint import (
    architecture_of,
    load_train_state,
    load_weights,
    read_meta,
    rng_state,
    save_rotating,
    set_rng_state,
    tied_aliases,
)
from sprout.errors import SproutError
from sprout.engine.configs import TrainConfig
from sprout.engine.fsdp import optimizer_state_by_index, optimizer_state_by_name, shard_on_cpu
from sprout.engine.metrics import MetricsLogger, check_trackers
from sprout.engine.schedule import chinchilla_steps
from sprout.engine.stage import Stage
from sprout.lora_weights import has_adapters
from sprout.model.lora import AdaptersOff


class NonFiniteLoss(SproutError):
    """The loss or gradient became NaN/inf; the weights were not updated."""


def all_reduce_sums(accelerator: Accelerator, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Sum scalars over all processes (one collective); every rank gets the same floats."""
    names, dev = list(sums), accelerator.device
    vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=dev).reshape(()) for k in names])
    vec = accelerator.reduce(vec, "sum") if accelerator.num_processes > 1 else vec
    return dict(zip(names, vec.tolist()))


def make_accelerator(cfg: TrainConfig, out_dir: str | Path | None = None) -> Accelerator:
    """The run's Accelerator: mixed precision resolved, trackers checked; without a GPU, gloo
    (and FSDP2 over gloo when the launch asked for FSDP, see `shard_on_cpu`)."""
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    trackers = check_trackers(cfg.trackers)
    cpu = not torch.cuda.is_available()
    if cfg.cpu_threads > 0 and cpu:
        torch.set_num_threads(cfg.cpu_threads)
    fsdp_on_cpu = cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_on_cpu and os.environ.get("FSDP_VERSION", "1") != "2":  # accelerate's FSDP1 plugin needs a GPU
        raise SproutError(f"accelerate config: FSDP on CPU needs fsdp_config.fsdp_version 2, not "
                          f"{os.environ.get('FSDP_VERSION', '1')} (see configs/accelerate/cpu_fsdp.yaml)")
    # cpu=True without a GPU: under torchrun (or `accelerate launch --multi_gpu`) accelerate then
    # sets up MULTI_CPU with the gloo backend instead of silently running single-process.
    acc = Accelerator(mixed_precision=mp, cpu=cpu, log_with=trackers or None,
                      project_dir=str(out_dir) if out_dir else None)
    if fsdp_on_cpu:
        shard_on_cpu(acc)
    return acc


def resolve_max_steps(cfg: TrainConfig, num_params: int, global_tokens: int) -> int:
    """train.max_steps, or when it is null the Chinchilla budget: chinchilla_ratio × params tokens."""
    return cfg.max_steps or chinchilla_steps(num_params, global_tokens, cfg.chinchilla_ratio)


def config_hash(resume_config: dict) -> str:
    return hashlib.sha256(json.dumps(resume_config, sort_keys=True).encode()).hexdigest()[:16]


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix.rstrip('.')} {a!r} != {b!r}"]


def check_frozen_models(saved: dict, now: dict) -> None:
    """A resume scores with the frozen models its run started with (`frozen_models`, see
    `sprout.checkpoint.frozen_model_record`): one whose weights or use differ now, or one added or
    dropped, is refused in one line naming it, as is a checkpoint without the record. The paths
    may differ (a moved run folder). Stages without frozen models record none."""
    before, after = saved.get("frozen_models"), now.get("frozen_models")
    if after is None:
        return
    if before is None:
        raise SproutError(f"{saved['path']}/meta.json: no frozen_models (written by an earlier version of sprout); "
                          f"train the run again (--overwrite)")

    def use(record):  # what must match: everything but the path
        return {k: v for k, v in record.items() if k != "path"} if record else None

    for role in sorted(set(before) | set(after)):
        a, b = before.get(role), after.get(role)
        if use(a) != use(b):
            diffs = "; ".join(_diff(use(a) or {}, use(b) or {})) if a and b else "recorded in one of them only"
            raise SproutError(f"{saved['path']}: the run's {role} was {a['path'] if a else 'none'}, now "
                              f"{b['path'] if b else 'none'} ({diffs}); refusing to resume against another model")


class Uncompiled:
    """`module` called through its eager forward even after `Module.compile()`: the same module,
    parameters, buffers and hooks (FSDP's included); every other attribute is the module's."""

    def __init__(self, module: torch.nn.Module):
        self.module = self.eager_module = module  # eager_module: what `sprout.model.decode.fusable` reads

    def __call__(self, *args, **kwargs):
        return self.module._call_impl(*args, **kwargs)  # Module.__call__ without the compiled path

    def __getattr__(self, name: str):
        return getattr(self.module, name)


class Trainer:
    """Accelerate-backed step machinery; see the module docstring for the step.

    `schedule(step, peak) -> lr` gives a parameter group's lr from its base lr (the lr it
    had when the optimizer was built; `lr_schedule`); `cfg.max_steps` must already be
    resolved; `grad_clip` 0 disables clipping. `meta` holds the static fields of every
    checkpoint's meta.json (model_config, tokenizer, config, resume_config); the hash of
    `resume_config` is what a resume must match. Only rank 0 writes to `out_dir`.

    Handles on the policy: `model` (what accelerate prepared: the DDP wrapper, or the FSDP2
    module; train with it), `raw_model` (the module itself) and `generation_model` (for
    generation: the module without the DDP wrapper, called through its eager forward even
    when train.compile is on, since decoding changes shapes at every step; the same
    parameters, so it always generates with the current weights).
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer, schedule: Callable[..., float],
                 cfg: TrainConfig, *, grad_clip: float = 1.0, out_dir: str | Path | None = None,
                 meta: dict | None = None):
        self.accelerator, self.cfg, self.schedule, self.grad_clip = accelerator, cfg, schedule, grad_clip
        self.raw_model = model
        if cfg.max_steps is None:
            raise ValueError("cfg.max_steps must be resolved (resolve_max_steps) before building a Trainer")
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing = True  # every stage's trained model is a Transformer (or a head model)
        if cfg.compile:
            model.compile()  # compiles forward in place; parameter names stay unchanged
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        # Generation changes shapes at every decode step: never through the compiled forward.
        self.generation_model = Uncompiled(self.raw_model) if cfg.compile else self.raw_model
        self.frozen: list[torch.nn.Module] = []
        self.out_dir = Path(out_dir) if out_dir else None
        self.meta = dict(meta or {})
        self.meta.setdefault("resume_config", {})
        self.meta["config_hash"] = config_hash(self.meta["resume_config"])
        self.meta.setdefault("run_id", uuid.uuid4().hex)  # checkpoint rotation keeps to this run's own
        self.steps_done, self.tokens_seen = 0, 0
        self.resumed_from: int | None = None
        self.last_checkpoint: Path | None = None
        self.evals: list[dict] = []

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def sharded(self) -> bool:
        """FSDP: parameters, gradients and optimizer state are sharded over the processes."""
        return self.accelerator.distributed_type.name == "FSDP"

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model the loss reads but never trains (a reference policy, a reward model), ready on
        every process: gradients off, eval mode, mixed precision as the policy's
        (`accelerator.prepare_model(model, evaluation_mode=True)`); under FSDP also sharded like
        the policy (accelerate's evaluation mode alone would keep a whole copy on every
        process) and resharded after every forward, each forward then being a collective
        that every rank must run. Not in the optimizer, never saved in a checkpoint. Returns
        the module to call. A LoRA policy's `AdaptersOff` view comes back as it is."""
        if isinstance(model, AdaptersOff):  # the policy with its adapters off: prepared already, no copy
            return model
        model.requires_grad_(False)
        if self.sharded:
            from accelerate.utils import fsdp2_prepare_model

            model = fsdp2_prepare_model(self.accelerator, model.to(self.accelerator.device))
            # No backward will reshard it: every FSDP unit (root and head included) gives its
            # gathered weights back after each forward.
            model.set_reshard_after_forward(True)
        model = self.accelerator.prepare_model(model, evaluation_mode=True)
        model.eval()
        self.frozen.append(model)
        return model

    # ---- one optimizer step -------------------------------------------------------------
    def step(self, micro_batches: list[dict], stage: Stage) -> dict:
        """One optimizer step over this rank's `micro_batches` (see the module docstring).

        Returns the step's reduced figures: loss (sum / N), lr (of the first parameter group;
        `lr/<name>` for a named group with another base lr), grad_norm, targets (N), tokens
        and flops (all processes), each metric's sum / count (left out when its count is 0) and
        what `stage.derived_metrics` computes from those, when the stage has one.
        """
        acc, model, device = self.accelerator, self.model, self.accelerator.device
        model.train()
        batches = [{k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in b.items()}
                   for b in micro_batches]
        n_local = torch.stack([torch.as_tensor(stage.count_targets(b), device=device).long() for b in batches]).sum()
        n_global = int(acc.reduce(n_local, "sum").item()) if self.world_size > 1 else int(n_local.item())
        if n_global == 0:
            raise SproutError(f"step {self.steps_done}: the global batch has no targets")
        scale = self.world_size / n_global
        sums: dict[str, torch.Tensor | float] = {"loss": 0.0, "n": 0.0, "tokens": 0.0, "flops": 0.0}
        metric_names: list[str] = []
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else acc.no_sync(model):
                with acc.autocast():
                    loss_sum, n, metrics = stage.loss(model, batch)
                acc.backward(loss_sum * scale)
            sums["loss"] = sums["loss"] + loss_sum.detach().float()
            sums["n"] = sums["n"] + n
            sums["tokens"] = sums["tokens"] + stage.num_tokens(batch)
            sums["flops"] = sums["flops"] + stage.flops(self.raw_model, batch)
            for k, value in metrics.items():
                if not isinstance(value, tuple) or len(value) != 2:
                    raise TypeError(f"{type(stage).__name__}.loss: metric {k!r} must be a (sum, count) pair")
                if k not in metric_names:
                    metric_names.append(k)
                total, count = value
                sums[f"sum:{k}"] = sums.get(f"sum:{k}", 0.0) + torch.as_tensor(total).detach().double()
                sums[f"count:{k}"] = sums.get(f"count:{k}", 0.0) + torch.as_tensor(count).detach().double()
        totals = all_reduce_sums(acc, sums)
        if int(totals["n"]) != n_global:
            raise RuntimeError(f"loss counted {totals['n']} targets but count_targets counted {n_global}")
        loss = totals["loss"] / n_global
        if not math.isfinite(loss):
            self._stop_non_finite(f"loss is {loss}")
        norm = acc.clip_grad_norm_(model.parameters(), self.grad_clip or float("inf"))
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
        if not math.isfinite(grad_norm):
            self._stop_non_finite(f"gradient norm is {grad_norm}")
        lrs = {}
        first = (self.base_lrs[0], self.optimizer.param_groups[0].get("hold_steps", 0))
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            held = self.steps_done < group.get("hold_steps", 0)  # `build_optimizer`: no update yet
            group["lr"] = 0.0 if held else self.schedule(self.steps_done, peak=base)
            if not lrs:
                lrs["lr"] = group["lr"]
            elif "name" in group and (base, group.get("hold_steps", 0)) != first:  # its own lr, every step
                lrs[f"lr/{group['name']}"] = group["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        self.tokens_seen += int(totals["tokens"])
        result = {"loss": loss, **lrs, "grad_norm": grad_norm, "targets": n_global, "tokens": int(totals["tokens"]),
                  "flops": totals["flops"]}
        for k in metric_names:
            if totals[f"count:{k}"] > 0:
                result[k] = totals[f"sum:{k}"] / totals[f"count:{k}"]
        derived = getattr(stage, "derived_metrics", None)
        if derived is not None:  # figures that are no sum / count (a std), from the reduced metrics
            result.update(derived({k: result[k] for k in metric_names if k in result}))
        return result

    def _stop_non_finite(self, what: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        kept = f"; last good checkpoint: {self.last_checkpoint}" if self.last_checkpoint else "; no checkpoint yet"
        raise NonFiniteLoss(f"{what} at step {self.steps_done + 1}; stopped without updating the weights{kept}")

    # ---- eval, checkpoint, resume -----------------------------------------------------------
    def evaluate(self, stage: Stage, logger: MetricsLogger | None = None) -> dict:
        results = stage.evaluate(self.model)
        record = {"step": self.steps_done, "tokens": self.tokens_seen, **results}
        self.evals.append(record)
        if logger is not None:
            logger.log(record)
        if self.accelerator.is_main_process:  # tqdm.write keeps the progress bar intact
            tqdm.write(f"eval step {self.steps_done}: " + "  ".join(f"{k} {v:.4f}" for k, v in results.items()))
        return record

    def save(self, stage: Stage) -> Path | None:
        """Checkpoint (all ranks call; rank 0 writes). Returns the path on rank 0.

        Under FSDP the weights and optimizer state are gathered into the same full checkpoint
        a single process writes, so it loads anywhere (`load_model`, a resume on any number of
        processes, with or without FSDP).
        """
        acc = self.accelerator
        adapters = has_adapters(self.raw_model)  # a LoRA run keeps its own tensors only: the base is
        if adapters and self.sharded:            # frozen_models' `base`, never gathered
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            weights = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))  # a collective; rank 0's full
        else:
            weights = acc.get_state_dict(self.model)  # a collective under FSDP; full on rank 0 only
        if adapters:
            trained = {name for name, p in self.raw_model.named_parameters() if p.requires_grad}
            weights = {k: v for k, v in weights.items() if k in trained}
        optim_state = self._optimizer_state()
        rngs = gather_object([rng_state()])
        # A stage's tensors (rollout buffer, generator state), one entry per rank, in train_state.pt.
        tensors = gather_object([stage.tensor_state()]) if hasattr(stage, "tensor_state") else None
        path = None
        if acc.is_main_process and self.out_dir is not None:
            meta = {**self.meta, "architecture": architecture_of(self.raw_model), "stage": stage.name, "step": self.steps_done,
                    "tokens_seen": self.tokens_seen, "loader_state": stage.state_dict(), "world_size": self.world_size}
            path = save_rotating(self.out_dir / "checkpoints", self.steps_done, weights, meta=meta,
                                 aliases={} if adapters else tied_aliases(self.raw_model),  # gathered: one copy per tied name
                                 optimizer=optim_state, rng_states=rngs, keep=self.cfg.keep_checkpoints,
                                 extra_state={"stage": tensors} if tensors is not None else None)
            tqdm.write(f"saved checkpoint {path} (step {self.steps_done})")
        acc.wait_for_everyone()
        if self.out_dir is not None:
            self.last_checkpoint = self.out_dir / "checkpoints" / f"step_{self.steps_done:08d}"
        return path

    def _optimizer_state(self) -> dict:
        """`optimizer.state_dict()`, gathered in full under FSDP (a collective; complete on rank 0)."""
        if not self.sharded:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=opts)
        return optimizer_state_by_index(full) if self.accelerator.is_main_process else {}

    def _load_optimizer_state(self, state: dict) -> None:
        """Load a full `optimizer.state_dict()`; under FSDP each rank keeps its own shard of it."""
        if not self.sharded:
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = {id(p): name for name, p in self.model.named_parameters()}
        order = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        set_optimizer_state_dict(self.model, self.optimizer.optimizer, optimizer_state_by_name(state, order),
                                 options=StateDictOptions(full_state_dict=True))

    def check_resume(self, path: str | Path, stage: Stage) -> dict:
        """The meta of the checkpoint at `path` once it may resume this run: every file's sha256
        verified, the same config hash and stage, the same frozen models (`check_frozen_models`).
        No model work: `train_stage` calls it before a stage's setup (a reference pass, say) runs."""
        meta = read_meta(path)  # verifies the sha256 of every file
        if meta.get("config_hash") != self.meta["config_hash"]:
            diffs = _diff(meta.get("resume_config", {}), self.meta["resume_config"])
            raise SproutError(f"{meta['path']}: checkpoint was made with a different config "
                              f"({'; '.join(diffs[:4]) or 'config hash differs'}); refusing to resume")
        if meta.get("stage") != stage.name:
            raise SproutError(f"{meta['path']}: checkpoint is from stage {meta.get('stage')!r}, not {stage.name!r}")
        check_frozen_models(meta, self.meta)
        return meta

    def resume(self, meta: dict, stage: Stage) -> dict:
        """Restore weights, optimizer, RNG, loader position and counters from the checkpoint of
        `meta`, what `check_resume` returned for it."""
        self.meta["run_id"] = meta["run_id"]  # a resumed run continues its rotation
        load_weights(self.raw_model, meta["path"], meta)  # FSDP2 shards it in place: each rank keeps its shard
        state = load_train_state(meta["path"], meta)
        self._load_optimizer_state(state["optimizer"])
        rngs = state["rng"]
        set_rng_state(rngs[self.accelerator.process_index] if len(rngs) == self.world_size else rngs[0])
        stage.load_state_dict(meta["loader_state"])
        if hasattr(stage, "load_tensor_state"):  # this rank's entry (rank 0's when the world size changed)
            tensors = state["extra"]["stage"]
            stage.load_tensor_state(tensors[self.accelerator.process_index] if len(tensors) == self.world_size
                                    else tensors[0])
        self.steps_done, self.tokens_seen = int(meta["step"]), int(meta["tokens_seen"])
        self.resumed_from = self.steps_done
        self.last_checkpoint = Path(meta["path"])
        self.accelerator.print(f"resumed from {meta['path']} at step {self.steps_done}")
        return meta
