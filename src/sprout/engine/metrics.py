"""Run metrics: metrics.jsonl, accelerate trackers, MFU and the loss-curve PNG.

`metrics.jsonl` in the run directory holds one JSON record per line: training records (`step`,
`loss`, `lr`, `grad_norm`, `tokens`, `tokens_per_s`, `mfu`, `time/batch_s`, `elapsed_s` of the
run segment, plus stage metrics, each averaged over its own denominator; see
`sprout.engine.callbacks.TrainingRecords`), eval records (`step`, `tokens`, `val_loss`,
`val_bpb`, ...) and event records (`event`: "start" for each run segment, with the matmul peak
MFU is measured against, "samples", "end"). Rank 0 alone appends and flushes one line at a time
(never through a symbolic link: `sprout.atomic.open_append`);
a reader skips a torn last line, and a resumed run first rewrites the file (atomically) without
the records past its checkpoint, so the file reads as one uninterrupted run. TensorBoard/W&B
(accelerate's trackers, when asked) get every numeric field (nested dicts flattened to `a.b`)
as a scalar at the record's step; a resumed TensorBoard run purges its events past the
checkpoint too. MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022) =
training FLOPs per second ÷ peak FLOP/s of the hardware used. `log_line`: the plain line a run
prints per record when no progress bar shows.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from sprout.atomic import atomic_path, atomic_write, open_append, write_error
from sprout.errors import SproutError

METRICS = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict]:
    """All complete records of a metrics.jsonl (a torn last line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_metrics(path: str | Path, step: int) -> None:
    """Keep only the records up to and including `step` (used when resuming from it), less a
    run-start record at `step` itself: that segment is the one being replaced."""
    kept = [r for r in read_metrics(path)
            if r.get("step", 0) < step or (r.get("step", 0) == step and r.get("event") != "start")]
    with atomic_write(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)


def _flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys; 0-d tensors and numpy scalars as Python numbers,
    anything else that is not a number, string or bool as its str()."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
            continue
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
            v = v.item()
        out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def tracker_scalars(record: dict) -> dict[str, float | int]:
    """The numeric fields of a record for trackers (`_flatten`ed; strings and the rest left
    out); `step` is not a field but the step the values are logged at."""
    return {k: v for k, v in _flatten(record).items() if isinstance(v, (int, float)) and k != "step"}


class MetricsLogger:
    """Writes records to metrics.jsonl and to accelerate's trackers; a no-op off rank 0."""

    def __init__(self, out_dir: str | Path, accelerator, *, trackers=(), run_config: dict | None = None,
                 resume_step: int | None = None):
        self.accelerator, self.trackers = accelerator, list(trackers)
        self.main = accelerator.is_main_process
        self.path = Path(out_dir) / METRICS
        self.file = None
        if self.main:
            if resume_step is not None:
                truncate_metrics(self.path, resume_step)
            else:
                with atomic_write(self.path, "w"):
                    pass  # a fresh run starts a fresh file
            self.file = open_append(self.path, "trainer")  # never through a link put there meanwhile
        if self.trackers:
            # A resumed run hides the events a previous run logged past the checkpoint.
            kwargs = {"tensorboard": {"purge_step": resume_step + 1}} if resume_step is not None else {}
            accelerator.init_trackers("sprout", config=_flatten(run_config or {}), init_kwargs=kwargs)

    def log(self, record: dict, track: bool = True) -> None:
        """Append `record`; also send its numbers to the trackers unless `track` is False (run
        start records and samples: facts about the run, not curves)."""
        if self.file is not None:
            try:  # a full disk: one line naming the file
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as exc:
                self._drop_file()
                raise write_error(self.path, exc) from None
        if self.trackers and track:
            self.accelerator.log(tracker_scalars(record), step=int(record["step"]))

    def _drop_file(self) -> None:
        """Close the file after a failed write without flushing what it could not write."""
        try:
            self.file.close()
        except OSError:
            pass
        self.file = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.trackers:
            # Not accelerator.end_training(): it also destroys the process group, which the
            # run still needs (final barrier in sprout.engine.run_stage.end_processes).
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.trackers = []


def duration(seconds: float) -> str:
    """Seconds as h:mm:ss (e.g. 3725.2 -> "1:02:05")."""
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def log_line(record: dict, max_steps: int, eta_s: float | None) -> str:
    """One training record as a plain log line: step, loss, lr, gradient norm, training tokens/s,
    MFU (when measured), elapsed time of this run segment and the estimated time left."""
    parts = [f"step {record['step']}/{max_steps}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"grad norm {record['grad_norm']:.3f}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    parts.append(f"elapsed {duration(record.get('elapsed_s', 0.0))}")
    parts.append(f"ETA {duration(eta_s) if eta_s is not None else '?'}")
    return " | ".join(parts)


def check_trackers(trackers) -> list[str]:
    """Validate tracker names and that their packages are installed (before training)."""
    import importlib.util

    packages = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for name in trackers:
        if name not in packages:
            raise SproutError(f"unknown tracker {name!r} (expected tensorboard or wandb)")
        if importlib.util.find_spec(packages[name]) is None:
            raise SproutError(f"tracker {name!r} asked for but the {packages[name]!r} package is not installed")
    return list(trackers)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: training FLOPs done in `seconds`, per second, over the hardware peak."""
    return flops / seconds / peak_flops if peak_flops > 0 and seconds > 0 else float("nan")


def measure_matmul_flops(n: int = 1024, dtype=torch.float32, device: str = "cpu", *, probes: int = 5,
                         seconds: float = 0.1) -> float:
    """FLOP/s of an n×n×n matmul on this machine (the 'peak' for MFU): the median over `probes`
    short windows of `seconds` each, so one lucky or unlucky window on a busy machine moves it
    little. Runs on its own generator: the global RNG (and so training) is left untouched."""
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    rates = []
    for _ in range(max(1, probes)):
        calls, t0 = 0, time.perf_counter()
        while True:
            a @ b
            calls += 1
            if calls % 4 == 0:
                sync()
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds:
                    break
        rates.append(calls * 2 * n**3 / elapsed)
    return statistics.median(rates)


EVAL_EXTRAS = ("val_bpb", "val_accuracy")  # drawn beside the loss when a stage logs them


FEW_RECORDS = 30  # training records up to which `loss_figure` marks each one


def loss_figure(records: list[dict], *, loss_label: str = "loss", title: str | None = None):
    """The run's figure from its metrics records, or None when there is no loss to draw.

    Top panel: train loss (line) and val loss (points) against step, with val bits per byte
    or val accuracy on a right-hand axis when the stage logs them. Bottom panel: the learning
    rate and, on a right-hand axis, the gradient norm. The training lines mark each record
    when there are at most `FEW_RECORDS` of them (a single record is a point, not an invisible
    line), and the step axis has integer ticks. `loss_label` names the loss on the y axis
    (e.g. "masked loss"); `title` is the run's name.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [r for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        return None
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True, height_ratios=(3, 2))
    marker = "o" if len(train) <= FEW_RECORDS else None
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"train {loss_label}", lw=1.2,
                marker=marker, ms=3)
    if val:
        ax.plot(*zip(*val), "o-", label=f"val {loss_label}", ms=4)
    ax.set_ylabel(f"{loss_label} (nats/token)")
    handles, labels = ax.get_legend_handles_labels()
    extra = next((k for k in EVAL_EXTRAS if any(k in r for r in records)), None)
    if extra:
        right = ax.twinx()
        points = [(r["step"], r[extra]) for r in records if extra in r]
        right.plot(*zip(*points), "s--", color="tab:green", ms=3, lw=1, label=extra)
        right.set_ylabel(extra)
        h, lab = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    lr = [(r["step"], r["lr"]) for r in train if "lr" in r]
    norm = [(r["step"], r["grad_norm"]) for r in train if "grad_norm" in r]
    if lr:
        ax_lr.plot(*zip(*lr), color="tab:purple", lw=1.2, label="lr", marker=marker, ms=3)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared with the top panel
    ax_lr.grid(alpha=0.3)
    handles, labels = ax_lr.get_legend_handles_labels()
    if norm:
        right = ax_lr.twinx()
        right.plot(*zip(*norm), color="tab:red", lw=1, alpha=0.8, label="grad norm", marker=marker, ms=3)
        right.set_ylabel("gradient norm (before clipping)")
        h, lab = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        ax_lr.legend(handles, labels)
    fig.tight_layout()
    return fig


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, *, loss_label: str = "loss",
                    title: str | None = None) -> Path | None:
    """`loss_figure` of a metrics.jsonl written as a PNG (matplotlib Agg); None when nothing to draw."""
    import matplotlib.pyplot as plt

    fig = loss_figure(read_metrics(metrics_path), loss_label=loss_label, title=title)
    if fig is None:
        return None
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(png_path)
