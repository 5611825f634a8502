"""The outer loop of training: `fit(trainer, stage)`.

It repeats `Trainer.step` (`sprout.engine.trainer`) until the run's length or the end of the
data, and hands each step to the callbacks (`sprout.engine.callbacks`), in this order:
stop signals, training records, eval cadence, checkpoint cadence, then at the end samples
and the report. A rank whose data runs out stops every rank at the same step; a signal that
came once training was done (during the samples, say) is agreed on by every rank after the
report (`FitRun.signalled`) and ends the run as stopped. The run's setup
(`sprout.engine.cli.run_lock`) ends after the callbacks' `start`, just before the first step:
until then a signal puts the run folder back as it was.
"""

from __future__ import annotations

import time

from sprout.engine.callbacks import (CheckpointCadence, EvalCadence, FitRun, RunReport, Samples, StopSignals,
                                     TrainingRecords, agreed_signal)
from sprout.engine.cli import setup_finished
from sprout.engine.trainer import Trainer, all_reduce_sums
from sprout.engine.metrics import MetricsLogger
from sprout.engine.stage import Stage


def call(callbacks: list, hook: str, run: FitRun) -> None:
    for callback in callbacks:
        if hasattr(callback, hook):
            getattr(callback, hook)(run)


def fit(trainer: Trainer, stage: Stage, callbacks: list | None = None) -> dict:
    """Train `stage` with `trainer` to cfg.max_steps (or until a rank's data runs out). Returns
    the run's summary: first and last eval, steps, tokens, last checkpoint, `interrupted`, the
    number of the signal that stopped the run (else None), and `signalled`, that of a signal
    any rank received once its training was done (else None)."""
    cfg, acc = trainer.cfg, trainer.accelerator
    logger = MetricsLogger(trainer.out_dir, acc, trackers=cfg.trackers, run_config=trainer.meta.get("config"),
                           resume_step=trainer.resumed_from) if trainer.out_dir else None
    if callbacks is None:
        callbacks = [StopSignals(), TrainingRecords(), EvalCadence(), CheckpointCadence(), Samples(), RunReport()]
    run = FitRun(trainer, stage, logger)
    try:
        run.setting_up = True
        call(callbacks, "start", run)
        run.setting_up = False
        if trainer.out_dir:
            setup_finished(trainer.out_dir)
        while trainer.steps_done < cfg.max_steps:
            t_batch = time.perf_counter()
            batches = stage.next_micro_batches(trainer.steps_done)
            run.batch_s = time.perf_counter() - t_batch
            generated = getattr(stage, "generated_tokens", 0) if batches is not None else 0
            state = all_reduce_sums(acc, {"out": float(batches is None), "generated": generated})
            if state["out"] > 0:
                break  # some rank ran out of data: every rank stops at the same step
            run.metrics, run.generated = trainer.step(batches, stage), state["generated"]
            call(callbacks, "after_step", run)
            if run.stopping:
                break
        call(callbacks, "end", run)
        if run.interrupted is None:
            run.signalled = agreed_signal(acc, run.signalled)
    finally:
        call(callbacks, "close", run)
        if logger:
            logger.close()
    return {"first_eval": trainer.evals[0] if trainer.evals else None,
            "last_eval": trainer.evals[-1] if trainer.evals else None, "steps": trainer.steps_done,
            "tokens": trainer.tokens_seen, "checkpoint": trainer.last_checkpoint, "interrupted": run.interrupted,
            "signalled": run.signalled if run.interrupted is None else None}
