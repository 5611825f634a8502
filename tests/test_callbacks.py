"""The outer loop's callbacks (sprout.engine.callbacks), each on its own, with a stand-in
trainer: when evals and checkpoints happen, what a training record counts (paused time
left out), how a signal stops the run, the samples record and the end of the report.
The whole loop with a real Trainer is tested in test_train.py and test_protocol.py."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from sprout.engine import callbacks as cb
from sprout.engine.callbacks import (CheckpointCadence, EvalCadence, FitRun, RunReport, Samples, StopSignals,
                                     TrainingRecords)
from sprout.engine.training_loop import fit
from sprout.engine.trainer import TrainConfig
from sprout.engine.metrics import MetricsLogger, read_metrics


class FakeTrainer:
    """What the callbacks read of a Trainer; evaluate and save record the step they ran at."""

    def __init__(self, tmp_path=None, **cfg):
        self.cfg = TrainConfig(**{"max_steps": 7, "progress": False, "peak_tflops": -1, **cfg})
        self.accelerator = Accelerator(cpu=True)
        self.world_size, self.steps_done, self.tokens_seen = 1, 0, 0
        self.out_dir, self.meta, self.last_checkpoint, self.resumed_from = tmp_path, {}, None, None
        self.evals, self.saves = [], []
        self.raw_model = self.model = self.generation_model = torch.nn.Linear(2, 2)

    def evaluate(self, stage, logger=None):
        self.evals.append({"step": self.steps_done, "val_loss": 1.0})

    def save(self, stage):
        self.saves.append(self.steps_done)

    def step(self, batches, stage):
        self.steps_done += 1
        self.tokens_seen += 10
        return {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "targets": 10, "tokens": 10, "flops": 0.0}


def run_steps(trainer, callback, steps, stop_at=None):
    run = FitRun(trainer, SimpleNamespace(name="test"), None)
    callback.start(run)
    for _ in range(steps):
        run.metrics = trainer.step(None, None)
        run.stopping = trainer.steps_done == stop_at
        callback.after_step(run)
        if run.stopping:
            run.interrupted = signal.SIGTERM
            break
    callback.end(run)
    return run


def test_evals_before_training_on_cadence_and_at_the_end():
    trainer = FakeTrainer(eval_every=3)
    run_steps(trainer, EvalCadence(), 7)
    assert [e["step"] for e in trainer.evals] == [0, 3, 6, 7]


def test_no_eval_after_a_signal_and_a_resumed_run_does_not_eval_first():
    trainer = FakeTrainer(eval_every=3)
    run_steps(trainer, EvalCadence(), 7, stop_at=4)
    assert [e["step"] for e in trainer.evals] == [0, 3]
    resumed = FakeTrainer(eval_every=0)
    resumed.steps_done = 2
    run_steps(resumed, EvalCadence(), 5)
    assert [e["step"] for e in resumed.evals] == [7]


def test_evals_at_the_last_step_when_the_data_ran_out_early():
    trainer = FakeTrainer(eval_every=4)
    run_steps(trainer, EvalCadence(), 5)  # the loop ended at step 5 of 7
    assert [e["step"] for e in trainer.evals] == [0, 4, 5]


def test_checkpoints_on_cadence_at_the_end_and_on_a_signal():
    trainer = FakeTrainer(ckpt_every=2)
    run_steps(trainer, CheckpointCadence(), 7)
    assert trainer.saves == [2, 4, 6, 7]
    stopped = FakeTrainer(ckpt_every=2)
    run_steps(stopped, CheckpointCadence(), 7, stop_at=3)
    assert stopped.saves == [2, 3]
    early = FakeTrainer(ckpt_every=4)
    run_steps(early, CheckpointCadence(), 5)  # data ran out at step 5
    assert early.saves == [4, 5]


def test_training_records_leave_paused_time_out(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(cb.time, "perf_counter", lambda: clock[0])
    trainer = FakeTrainer(tmp_path, log_every=2, max_steps=4)
    logger = MetricsLogger(tmp_path, trainer.accelerator)
    run, records = FitRun(trainer, SimpleNamespace(name="test"), logger), TrainingRecords()
    records.start(run)
    for _ in range(4):
        clock[0] += 1.0  # one second of training per step
        run.metrics, run.batch_s, run.generated = trainer.step(None, None), 0.25, 5.0
        records.after_step(run)
        with run.paused():
            clock[0] += 7.0  # an eval or a checkpoint after every step
    logger.close()
    train = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert r["step_time_s"] == pytest.approx(1.0)  # the 7 paused seconds are not counted
        assert r["time/batch_s"] == pytest.approx(0.25)
        assert r["tokens_per_s"] == pytest.approx(20 / (2.0 - 0.5))  # batch time is not training time
        assert r["generation/tokens_per_s"] == pytest.approx(10 / 0.5)
        assert "mfu" not in r  # peak_tflops < 0: no MFU
    assert train[1]["elapsed_s"] == pytest.approx(4 * 1.0 + 3 * 7.0)  # the wall time so far, pauses included


def test_a_signal_stops_after_the_step_and_names_itself():
    trainer, stop = FakeTrainer(), StopSignals()
    run = FitRun(trainer, SimpleNamespace(name="test"), None)
    stop.start(run)
    try:
        stop.after_step(run)
        assert not run.stopping
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the test process goes on
        trainer.steps_done = 3
        stop.after_step(run)
        assert run.stopping and run.done and run.interrupted == signal.SIGTERM
    finally:
        stop.close(run)
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_samples_record_and_no_samples_after_a_signal(tmp_path):
    trainer = FakeTrainer(tmp_path)
    stage = SimpleNamespace(name="sft", samples=lambda model: [("2+2?", "4")], sample_decoding="greedy")
    logger = MetricsLogger(tmp_path, trainer.accelerator)
    Samples().end(FitRun(trainer, stage, logger))
    Samples().end(FitRun(trainer, stage, logger, interrupted=signal.SIGINT))
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"event": "samples", "step": 0, "samples": [{"prompt": "2+2?", "answer": "4"}],
                      "decoding": "greedy"}]


def test_the_report_follows_the_end_record(tmp_path):
    trainer = FakeTrainer(tmp_path)
    run = FitRun(trainer, SimpleNamespace(name="test"), MetricsLogger(tmp_path, trainer.accelerator))
    RunReport().end(run)
    assert (tmp_path / "report.md").is_file()
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["event"] == "end"


def test_no_report_after_an_exception(tmp_path):
    class Boom:
        def after_step(self, run):
            raise RuntimeError("boom")

    stage = SimpleNamespace(name="test", next_micro_batches=lambda step: [{}])
    trainer = FakeTrainer(tmp_path, max_steps=3)
    with pytest.raises(RuntimeError, match="boom"):
        fit(trainer, stage, callbacks=[Boom(), RunReport()])
    assert not (tmp_path / "report.md").exists()


def test_fit_runs_the_callbacks_in_order_and_stops_when_data_runs_out():
    calls = []

    class Log:
        def __init__(self, name):
            self.name = name

        def start(self, run):
            calls.append((self.name, "start"))

        def after_step(self, run):
            calls.append((self.name, run.trainer.steps_done))

        def end(self, run):
            calls.append((self.name, "end"))

        def close(self, run):
            calls.append((self.name, "close"))

    stage = SimpleNamespace(name="test", next_micro_batches=lambda step: [{}] if step < 2 else None)
    summary = fit(FakeTrainer(max_steps=5), stage, callbacks=[Log("a"), Log("b")])
    assert calls == [("a", "start"), ("b", "start"), ("a", 1), ("b", 1), ("a", 2), ("b", 2),
                     ("a", "end"), ("b", "end"), ("a", "close"), ("b", "close")]
    assert summary["steps"] == 2 and summary["interrupted"] is None
