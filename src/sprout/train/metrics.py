"""Run metrics: metrics.jsonl, accelerate trackers, MFU and the loss-curve PNG.

`metrics.jsonl` in the run directory holds one JSON record per line: training records
(`step`, `loss`, `lr`, `tokens`, `tokens_per_s`, `mfu`, `time/batch_s`, plus stage metrics,
each averaged over its own denominator; see `sprout.train.loop.Trainer.fit`) and eval records
(`step`, `tokens`, `val_loss`, `val_bpb`, ...). Lines are appended and flushed one at a
time by rank 0 only; a reader skips a torn last line, and a resumed run first rewrites the
file (atomically) without the records past the checkpoint it resumes from, so the file
reads as one uninterrupted run. The same records go to TensorBoard / W&B through
accelerate's trackers when asked: every numeric field (nested dicts flattened to `a.b`) as
a scalar at the record's step; a resumed TensorBoard run purges the events past its
checkpoint, as metrics.jsonl does. MFU (model FLOPs utilisation, PaLM, Chowdhery et al.
2022) = training FLOPs per second ÷ peak FLOP/s of the hardware used.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from sprout.atomic import atomic_path, atomic_write
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
    """Keep only the records up to and including `step` (used when resuming from it)."""
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
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
            self.file = open(self.path, "a")
        if self.trackers:
            # A resumed run hides the events a previous run logged past the checkpoint.
            kwargs = {"tensorboard": {"purge_step": resume_step + 1}} if resume_step is not None else {}
            accelerator.init_trackers("sprout", config=_flatten(run_config or {}), init_kwargs=kwargs)

    def log(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.trackers:
            self.accelerator.log(tracker_scalars(record), step=int(record["step"]))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.trackers:
            # Not accelerator.end_training(): it also destroys the process group, which the
            # run still needs (final barrier in sprout.train.run.end_processes).
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.trackers = []


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


def measure_matmul_flops(n: int = 1024, dtype=torch.float32, device: str = "cpu", seconds: float = 2.0) -> float:
    """Best observed FLOP/s of an n×n×n matmul on this machine (the 'peak' for MFU)."""
    gen = torch.Generator(device).manual_seed(0)  # leaves the global RNG (and so training) untouched
    a = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path) -> Path | None:
    """Train loss (line) and val loss (points) against step, as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(png_path)
