"""The outer loop of training: `fit(trainer, stage)`, what `Trainer.fit` runs.

It repeats `Trainer.step` (`sprout.engine.loop`) until the run's length or the end of the
data, and around the steps: the training records (metrics.jsonl, trackers, the progress bar
or plain log lines) with their throughput and MFU, the evals and checkpoints on their
cadence, samples from a chat stage, a clean stop on Ctrl-C or SIGTERM (`StopSignals`), and
at the end loss.png and report.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from sprout.engine.loop import TrainConfig, Trainer, all_reduce_sums
from sprout.engine.metrics import MetricsLogger, log_line, measure_matmul_flops, mfu, plot_loss_curve
from sprout.engine.report import start_record, write_report
from sprout.engine.stage import Stage


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (what SLURM and Kubernetes send before they kill) during
    `Trainer.fit`: the first asks the loop to stop after the current step, with a checkpoint,
    the plot and report.md (`signum` is then set); a second one exits at once (SIGINT raises
    KeyboardInterrupt, SIGTERM takes its default: the process ends). Installed only in the
    main thread, and not over a signal the process ignores; the old handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # the second signal: exit now
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if os.environ.get("RANK", "0") == "0":
            again = "Ctrl-C" if signum == signal.SIGINT else "send it"
            print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint; "
                  f"{again} again to exit at once", file=sys.stderr, flush=True)


def peak_flops(cfg: TrainConfig, acc: Accelerator) -> tuple[float, str]:
    """Peak FLOP/s of one process for MFU, and where it comes from: `train.peak_tflops`
    ("config"), or when it is 0 a matmul this process measures now ("measured": the median
    of 5 probes of 0.1 s; bf16 on a GPU under bf16 autocast, else fp32; on a shared CPU the
    processes measure together, so each sees its share); 0.0 when `train.peak_tflops` < 0
    switches MFU off. Every call (so every resume) measures again."""
    if cfg.peak_tflops != 0:
        return max(0.0, cfg.peak_tflops * 1e12), "config"
    gpu = acc.device.type == "cuda"
    dtype = torch.bfloat16 if gpu and acc.mixed_precision == "bf16" else torch.float32
    n = 4096 if gpu else 1024
    peak = measure_matmul_flops(n, dtype, acc.device, probes=5, seconds=0.1)
    acc.print(f"MFU against a measured {dtype} matmul peak of {peak / 1e12:.3g} TFLOP/s per process "
              f"(set train.peak_tflops to use the hardware's figure instead)")
    return peak, "measured"


def log_samples(trainer: Trainer, stage: Stage, logger: MetricsLogger | None) -> list[tuple[str, str]]:
    """`stage.samples(trainer.generation_model)`: (prompt, answer) pairs generated now, logged
    as a `samples` record for report.md (all ranks call: generation may be a collective)."""
    trainer.generation_model.eval()
    samples = stage.samples(trainer.generation_model)
    trainer.model.train()
    if logger:
        logger.log({"event": "samples", "step": trainer.steps_done, "samples": [{"prompt": p, "answer": a}
                    for p, a in samples], "decoding": getattr(stage, "sample_decoding", "greedy")}, track=False)
    return samples


def fit(trainer: Trainer, stage: Stage) -> dict:
    """Train `stage` with `trainer` to cfg.max_steps (or until a rank's data runs out): log every
    log_every steps, evaluate and checkpoint on their cadence and at the end, then write
    loss.png and report.md.

    A training record holds the step's figures (`step`) plus, over the steps since the
    last record: `tokens_per_s` and `mfu` of the training itself (optimizer steps only),
    `step_time_s` (wall time per step, everything included), `time/batch_s` (of which in
    next_micro_batches, e.g. generating rollouts) and `generation/tokens_per_s` (tokens the
    stage generated there, all processes, per second of that time; only when it generated).
    Eval and checkpoint time counts in none of them.

    Ctrl-C or SIGTERM (`StopSignals`) stops the run after the current step: every rank
    stops at the same step (the flag is all-reduced after each step), which is logged and
    checkpointed, without the final eval; loss.png and report.md are written as usual and
    the summary's `interrupted` is the signal number (else None).
    """
    cfg, acc = trainer.cfg, trainer.accelerator
    logger = MetricsLogger(trainer.out_dir, acc, trackers=cfg.trackers, run_config=trainer.meta.get("config"),
                           resume_step=trainer.resumed_from) if trainer.out_dir else None
    peak, peak_source = peak_flops(cfg, acc)
    if logger and acc.is_main_process:
        logger.log(start_record(trainer.steps_done, peak_flops=peak, peak_source=peak_source,
                                device=acc.device, world_size=trainer.world_size,
                                precision=acc.mixed_precision), track=False)
    # A bar only on a terminal; in a log file (or with train.progress off) plain lines instead.
    bar = tqdm(total=cfg.max_steps, initial=trainer.steps_done, desc=stage.name, dynamic_ncols=True,
               disable=not (cfg.progress and acc.is_main_process and sys.stderr.isatty()))
    t_start, steps_start, shown = time.perf_counter(), trainer.steps_done, {}
    stop, interrupted = StopSignals().__enter__(), None
    try:
        if trainer.steps_done == 0:
            trainer.evaluate(stage, logger)
        last_eval = last_save = trainer.steps_done
        t0, steps0 = time.perf_counter(), trainer.steps_done
        window = {"tokens": 0, "flops": 0.0, "batch_s": 0.0, "generated": 0.0}
        while trainer.steps_done < cfg.max_steps:
            t_batch = time.perf_counter()
            batches = stage.next_micro_batches(trainer.steps_done)
            window["batch_s"] += time.perf_counter() - t_batch
            generated = getattr(stage, "generated_tokens", 0) if batches is not None else 0
            state = all_reduce_sums(acc, {"out": float(batches is None), "generated": generated})
            if state["out"] > 0:
                break  # some rank ran out of data: every rank stops at the same step
            m = trainer.step(batches, stage)
            window["tokens"] += m["tokens"]
            window["flops"] += m["flops"]
            window["generated"] += state["generated"]
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", gnorm=f"{m['grad_norm']:.3f}", **shown)
            # A signal on any rank stops every rank after this same step.
            flags = all_reduce_sums(acc, {"stop": float(stop.signum is not None), "signum": stop.signum or 0})
            stopping = flags["stop"] > 0 and trainer.steps_done < cfg.max_steps
            if stopping:
                interrupted = round(flags["signum"] / flags["stop"])  # the signal the ranks received
            s, done = trainer.steps_done, trainer.steps_done == cfg.max_steps or stopping
            if s % cfg.log_every == 0 or done:
                wall = time.perf_counter() - t0
                train_s = wall - window["batch_s"]
                tps = window["tokens"] / train_s if train_s > 0 else 0.0
                record = {"step": s, "loss": m["loss"], "lr": m["lr"], "tokens": trainer.tokens_seen,
                          "tokens_per_s": tps, "step_time_s": wall / max(1, s - steps0),
                          "time/batch_s": window["batch_s"] / max(1, s - steps0),
                          **{k: v for k, v in m.items() if k not in ("loss", "lr", "tokens", "flops")}}
                if window["generated"] > 0 and window["batch_s"] > 0:
                    record["generation/tokens_per_s"] = window["generated"] / window["batch_s"]
                if peak > 0 and window["flops"] > 0 and train_s > 0:
                    record["mfu"] = mfu(window["flops"], train_s, peak * trainer.world_size)
                record["elapsed_s"] = time.perf_counter() - t_start  # this segment, evals included
                if logger:
                    logger.log(record)
                shown = {"tok/s": f"{tps:,.0f}", **({"MFU": f"{record['mfu']:.1%}"} if "mfu" in record else {})}
                if bar.disable and acc.is_main_process:  # no bar: a plain log line
                    eta = record["elapsed_s"] / (s - steps_start) * (cfg.max_steps - s)
                    print(log_line(record, cfg.max_steps, eta), flush=True)
                t0, steps0 = time.perf_counter(), s
                window = dict.fromkeys(window, 0)
            paused = time.perf_counter()
            if (cfg.eval_every and s % cfg.eval_every == 0) or (done and not stopping):
                trainer.evaluate(stage, logger)
                last_eval = s
            if (cfg.ckpt_every and s % cfg.ckpt_every == 0) or done:
                trainer.save(stage)
                last_save = s
            t0 += time.perf_counter() - paused  # eval and checkpoint time is not training time
            if stopping:
                break
        if last_eval != trainer.steps_done and interrupted is None:  # stopped early (data exhausted)
            trainer.evaluate(stage, logger)
        if last_save != trainer.steps_done:
            trainer.save(stage)
        if hasattr(stage, "samples") and interrupted is None:  # a chat stage shows what it now answers (every rank generates)
            log_samples(trainer, stage, logger)
        if logger:
            logger.log({"event": "end", "step": trainer.steps_done, "elapsed_s": time.perf_counter() - t_start},
                       track=False)
    finally:
        stop.__exit__()
        bar.close()
        if logger:
            logger.close()
    if trainer.out_dir and acc.is_main_process:
        png = plot_loss_curve(trainer.out_dir / "metrics.jsonl", trainer.out_dir / "loss.png",
                              loss_label=getattr(stage, "loss_label", "loss"), title=trainer.out_dir.name)
        n_params = sum(p.numel() for p in trainer.raw_model.parameters())  # a tied matrix counts once
        ckpt = os.path.relpath(trainer.last_checkpoint, trainer.out_dir) if trainer.last_checkpoint else None
        report = write_report(trainer.out_dir, stage=stage.name, meta=trainer.meta, num_params=n_params,
                              world_size=trainer.world_size, precision=acc.mixed_precision, checkpoint=ckpt)
        print(f"report: {report}" + (f"\nloss curve: {png}" if png else ""), flush=True)
    return {"first_eval": trainer.evals[0] if trainer.evals else None,
            "last_eval": trainer.evals[-1] if trainer.evals else None, "steps": trainer.steps_done,
            "tokens": trainer.tokens_seen, "checkpoint": trainer.last_checkpoint, "interrupted": interrupted}
