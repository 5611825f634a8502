"""What happens around the training steps, one job each; `sprout.engine.training_loop` runs them.

A callback has any of four hooks, each called with the `FitRun` (the trainer, the stage, the
metrics logger, the last step's figures, whether the run is ending): `start(run)` before the
first step of this segment (after a resume), `after_step(run)` after each optimizer step in the
order the callbacks are listed, `end(run)` after the last step unless the loop raised, and
`close(run)` always, last, to give back what start took.

    StopSignals         Ctrl-C and SIGTERM stop every rank after the same step; during the
                        end-of-run samples before the same prompt; before the first step, the
                        setup's handler (`sprout.engine.cli.run_lock`) puts the run folder back
    TrainingRecords     training records: throughput, MFU, the progress bar or log lines
    EvalCadence         evals before training, every train.eval_every steps and at the end
    CheckpointCadence   checkpoints every train.ckpt_every steps and at the end
    Samples             what a chat stage answers after training, for report.md
    RunReport           loss.png and report.md (rank 0)

Eval and checkpoint time is paused time (`FitRun.paused`): no training record counts it.
Where the ranks must agree on a signal, each asks `agreed_signal` at the same point.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from sprout.engine.run_setup import Stopped, pass_on
from sprout.engine.trainer import TrainConfig, Trainer
from sprout.engine.metrics import MetricsLogger, log_line, measure_matmul_flops, mfu, plot_loss_curve
from sprout.engine.report import start_record, write_report
from sprout.engine.stage import Stage


@dataclass
class FitRun:
    """What the callbacks share: `metrics` is the last step's figures (`Trainer.step`),
    `batch_s` the time its `next_micro_batches` took and `generated` the tokens it generated
    (all processes); `stopping` is set when a signal stops the run, `interrupted` to its number;
    `signalled` is the signal this process received (also once training is done: then `fit`
    sets it on every process to the one any received); `setting_up` is set while the callbacks'
    `start` runs (the run's setup), `sampling` while the end-of-run samples are generated."""
    trainer: Trainer
    stage: Stage
    logger: MetricsLogger | None
    metrics: dict | None = None
    batch_s: float = 0.0
    generated: float = 0.0
    stopping: bool = False
    interrupted: int | None = None
    signalled: int | None = None
    setting_up: bool = False
    sampling: bool = False
    paused_s: float = 0.0
    t_start: float = 0.0  # when this segment's training records start counting

    @property
    def done(self) -> bool:
        """The last step of this run: its length reached, or a signal stops it."""
        return self.trainer.steps_done >= self.trainer.cfg.max_steps or self.stopping

    @contextlib.contextmanager
    def paused(self):
        """Time inside is not training time (evals, checkpoints)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t


def agreed_signal(accelerator: Accelerator, signum: int | None) -> int | None:
    """The largest signal number any process received (`signum` here; None when none did), the
    same on every process: one collective, so every process calls it at the same point."""
    if accelerator.num_processes == 1:
        return signum
    flag = torch.tensor(signum or 0, dtype=torch.int64, device=accelerator.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item()) or None


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (what SLURM and Kubernetes send before they kill): the first
    asks the loop to stop after the current step, with a checkpoint, the plot and report.md;
    a second one exits at once (SIGINT raises KeyboardInterrupt, SIGTERM takes its default:
    the process ends). A signal on any rank stops every rank after the same step (the flag is
    all-reduced after each step). During the end-of-run samples the first one stops them, the
    report follows and the trainer exits with 128 + its number: one process at once (`Stopped`),
    several before the same prompt (`Samples`); in the callbacks' `start`
    (`FitRun.setting_up`) it goes to the handler this one replaced (the setup's). Installed
    only in the main thread, and not over a signal the process ignores; the old handlers come
    back on close."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self.run: FitRun | None = None
        self._old: dict = {}

    def start(self, run: FitRun) -> None:
        self.run = run
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)

    def after_step(self, run: FitRun) -> None:
        signum = agreed_signal(run.trainer.accelerator, self.signum)
        if signum is not None and run.trainer.steps_done < run.trainer.cfg.max_steps:
            run.stopping = True
            run.interrupted = signum

    def close(self, run: FitRun | None = None) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _handle(self, signum: int, frame) -> None:
        run = self.run
        if run is not None and run.setting_up:  # still the setup: its handler puts the folder back
            pass_on(self._old.get(signum, signal.SIG_DFL), signum, frame)
            return
        if self.signum is not None:  # the second signal: exit now
            self.close()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if run is not None:
            run.signalled = signum
        name, again = signal.Signals(signum).name, "Ctrl-C" if signum == signal.SIGINT else "send it"
        if os.environ.get("RANK", "0") == "0":
            if run is not None and (run.sampling or run.trainer.steps_done >= run.trainer.cfg.max_steps):
                what = "stopping the end-of-run samples; the report follows"
            else:
                what = "stopping after this step with a checkpoint"
            print(f"\n{name}: {what}; {again} again to exit at once", file=sys.stderr, flush=True)
        if run is not None and run.sampling and run.trainer.accelerator.num_processes == 1:
            raise Stopped(signum)  # with more, every process stops before the same prompt (`Samples`)


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


class TrainingRecords:
    """A training record every train.log_every steps and at the last step: the step's figures
    (`Trainer.step`) plus, over the steps since the last record, `tokens_per_s` and `mfu` of
    the training itself (optimizer steps only), `step_time_s` (wall time per step, everything
    but paused time included), `time/batch_s` (of which in next_micro_batches, e.g. generating
    rollouts) and `generation/tokens_per_s` (tokens the stage generated there, all processes,
    per second of that time; only when it generated); `elapsed_s` is this segment's wall
    time, evals included. A progress bar on a terminal, else (or with train.progress off)
    one plain line per record; a run-start record first."""

    def start(self, run: FitRun) -> None:
        trainer, acc, cfg = run.trainer, run.trainer.accelerator, run.trainer.cfg
        self.peak, peak_source = peak_flops(cfg, acc)
        self.peak_source, self.mfu_warned = peak_source, False
        if run.logger and acc.is_main_process:
            run.logger.log(start_record(trainer.steps_done, peak_flops=self.peak, peak_source=peak_source,
                                        device=acc.device, world_size=trainer.world_size,
                                        precision=acc.mixed_precision), track=False)
        self.bar = tqdm(total=cfg.max_steps, initial=trainer.steps_done, desc=run.stage.name, dynamic_ncols=True,
                        disable=not (cfg.progress and acc.is_main_process and sys.stderr.isatty()))
        run.t_start, self.steps_start, self.shown = time.perf_counter(), trainer.steps_done, {}
        self._new_window(run)

    def _new_window(self, run: FitRun) -> None:
        self.t0, self.paused0, self.steps0 = time.perf_counter(), run.paused_s, run.trainer.steps_done
        self.window = {"tokens": 0, "flops": 0.0, "batch_s": 0.0, "generated": 0.0}

    def after_step(self, run: FitRun) -> None:
        m, s, w = run.metrics, run.trainer.steps_done, self.window
        w["tokens"] += m["tokens"]
        w["flops"] += m["flops"]
        w["batch_s"] += run.batch_s
        w["generated"] += run.generated
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", gnorm=f"{m['grad_norm']:.3f}",
                             **self.shown)
        if s % run.trainer.cfg.log_every and not run.done:
            return
        wall = time.perf_counter() - self.t0 - (run.paused_s - self.paused0)
        train_s, steps = wall - w["batch_s"], max(1, s - self.steps0)
        tps = w["tokens"] / train_s if train_s > 0 else 0.0
        record = {"step": s, "loss": m["loss"], "lr": m["lr"], "tokens": run.trainer.tokens_seen,
                  "tokens_per_s": tps, "step_time_s": wall / steps, "time/batch_s": w["batch_s"] / steps,
                  **{k: v for k, v in m.items() if k not in ("loss", "lr", "tokens", "flops")}}
        if w["generated"] > 0 and w["batch_s"] > 0:
            record["generation/tokens_per_s"] = w["generated"] / w["batch_s"]
        if self.peak > 0 and w["flops"] > 0 and train_s > 0:
            record["mfu"] = mfu(w["flops"], train_s, self.peak * run.trainer.world_size)
            if record["mfu"] > 1 and not self.mfu_warned:
                self.mfu_warned = True
                where = ("measured at start: other load on the machine then lowers it" if self.peak_source == "measured"
                         else "train.peak_tflops")
                run.trainer.accelerator.print(
                    f"note: MFU {100 * record['mfu']:.0f} % is above 100 %: the peak it is measured against, "
                    f"{self.peak / 1e12:.3g} TFLOP/s per process ({where}), is below what training reached; "
                    f"set train.peak_tflops to the hardware's figure")
        record["elapsed_s"] = time.perf_counter() - run.t_start
        if run.logger:
            run.logger.log(record)
        self.shown = {"tok/s": f"{tps:,.0f}", **({"MFU": f"{record['mfu']:.1%}"} if "mfu" in record else {})}
        if self.bar.disable and run.trainer.accelerator.is_main_process:  # no bar: a plain log line
            eta = record["elapsed_s"] / (s - self.steps_start) * (run.trainer.cfg.max_steps - s)
            print(log_line(record, run.trainer.cfg.max_steps, eta), flush=True)
        self._new_window(run)

    def close(self, run: FitRun) -> None:
        if hasattr(self, "bar"):
            self.bar.close()


class EvalCadence:
    """`Trainer.evaluate`: before the first step of a fresh run, every train.eval_every steps,
    and at the end (also when the data ran out early), but not after a signal."""

    def start(self, run: FitRun) -> None:
        if run.trainer.steps_done == 0:
            with run.paused():
                run.trainer.evaluate(run.stage, run.logger)
        self.last = run.trainer.steps_done

    def after_step(self, run: FitRun) -> None:
        s, every = run.trainer.steps_done, run.trainer.cfg.eval_every
        if (every and s % every == 0) or (run.done and not run.stopping):
            with run.paused():
                run.trainer.evaluate(run.stage, run.logger)
            self.last = s

    def end(self, run: FitRun) -> None:
        if self.last != run.trainer.steps_done and run.interrupted is None:
            run.trainer.evaluate(run.stage, run.logger)


class CheckpointCadence:
    """`Trainer.save`: every train.ckpt_every steps and at the last step (a signal's included)."""

    def start(self, run: FitRun) -> None:
        self.last = run.trainer.steps_done

    def after_step(self, run: FitRun) -> None:
        s, every = run.trainer.steps_done, run.trainer.cfg.ckpt_every
        if (every and s % every == 0) or run.done:
            with run.paused():
                run.trainer.save(run.stage)
            self.last = s

    def end(self, run: FitRun) -> None:
        if self.last != run.trainer.steps_done:
            run.trainer.save(run.stage)


class Samples:
    """A chat stage (one with `samples(model)`, which yields (prompt, answer) one prompt at a
    time) shows what it answers after training, as a `samples` record for report.md; every rank
    generates (it may be a collective). Not after a signal that stopped training; a signal
    received since the last step or during the samples, on any rank, stops them (`StopSignals`;
    before each prompt every rank asks `agreed_signal`, so all stop before the same one): the
    record then has no samples and `stopped`, the signal's name."""

    def end(self, run: FitRun) -> None:
        trainer, stage = run.trainer, run.stage
        if not hasattr(stage, "samples") or run.interrupted is not None:
            return
        samples, stopped = [], None
        run.sampling = True  # from here a signal stops the samples
        try:
            trainer.generation_model.eval()
            answers = iter(stage.samples(trainer.generation_model))
            while (signum := agreed_signal(trainer.accelerator, run.signalled)) is None:
                answer = next(answers, None)
                if answer is None:
                    break
                samples.append(answer)
            else:
                raise Stopped(signum)
        except Stopped as exc:
            samples, stopped = [], signal.Signals(exc.signum).name
        finally:
            run.sampling = False
            trainer.model.train()
        record = {"event": "samples", "step": trainer.steps_done, "samples": [
            {"prompt": p, "answer": a} for p, a in samples], "decoding": getattr(stage, "sample_decoding", "greedy")}
        if stopped:
            record["stopped"] = stopped
            if trainer.accelerator.is_main_process:
                print(f"samples: stopped by {stopped}; the report has none", flush=True)
        if run.logger:
            run.logger.log(record, track=False)


class RunReport:
    """The end record, last in metrics.jsonl; then the metrics closed, loss.png and report.md
    in the run folder (rank 0). Not after an exception."""

    def end(self, run: FitRun) -> None:
        trainer, acc = run.trainer, run.trainer.accelerator
        if run.logger:
            run.logger.log({"event": "end", "step": trainer.steps_done, "elapsed_s": time.perf_counter() - run.t_start},
                           track=False)
            run.logger.close()
        if not (trainer.out_dir and acc.is_main_process):
            return
        png = plot_loss_curve(trainer.out_dir / "metrics.jsonl", trainer.out_dir / "loss.png",
                              loss_label=getattr(run.stage, "loss_label", "loss"), title=trainer.out_dir.name)
        n_params = sum(p.numel() for p in trainer.raw_model.parameters())  # a tied matrix counts once
        ckpt = os.path.relpath(trainer.last_checkpoint, trainer.out_dir) if trainer.last_checkpoint else None
        report = write_report(trainer.out_dir, stage=run.stage.name, meta=trainer.meta, num_params=n_params,
                              world_size=trainer.world_size, precision=acc.mixed_precision, checkpoint=ckpt)
        print(f"report: {report}" + (f"\nloss curve: {png}" if png else ""), flush=True)
