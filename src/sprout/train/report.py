"""A run's report.md: what ran, what it measured and where its files are, readable without a browser.

Written by rank 0 at the end of `Trainer.fit`, next to metrics.jsonl and loss.png, from
those records and the checkpoint meta; every figure in it is read from metrics.jsonl, so
the report can be rebuilt from a run folder at any time (`write_report`).
"""

from __future__ import annotations

import statistics
from datetime import datetime, timezone
from pathlib import Path

from sprout.atomic import atomic_write
from sprout.train.metrics import METRICS, read_metrics


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def eval_table(evals: list[dict]) -> list[str]:
    """Markdown rows: one per eval record, a column per val_* field."""
    keys = sorted({k for r in evals for k in r if k.startswith("val_")})
    lines = ["| step | tokens | " + " | ".join(keys) + " |", "| ---: | ---: |" + " ---: |" * len(keys)]
    for r in evals:
        lines.append(f"| {r['step']:,} | {r['tokens']:,} | " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |")
    return lines


def write_report(out_dir: str | Path, *, stage: str, meta: dict, num_params: int, world_size: int,
                 precision: str, checkpoint: str | Path | None = None) -> Path:
    """Write <out_dir>/report.md from <out_dir>/metrics.jsonl and the run's meta; returns its path."""
    out_dir = Path(out_dir)
    records = read_metrics(out_dir / METRICS)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("val_") for k in r)]
    cfg, model = meta.get("config", {}), meta.get("model_config", {})
    tcfg, ocfg = cfg.get("train", {}), cfg.get("optim", {})
    batch = ", ".join(f"{k} {_fmt(v)}" for k, v in cfg.get("batch", {}).items())
    lines = [f"# {stage} run: {out_dir.name}", "",
             f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by sprout at the end of training.", "",
             "## Setup", "",
             f"- model: {num_params:,} parameters; " + ", ".join(f"{k} {model[k]}" for k in
                                                                ("d_model", "n_layers", "n_heads", "vocab_size",
                                                                 "max_seq_len") if k in model),
             f"- tokenizer: `{meta.get('tokenizer')}`",
             f"- {world_size} process(es); batch: {batch or 'n/a'}; "
             f"lr {ocfg.get('lr')} ({ocfg.get('schedule')}); mixed precision {precision}; "
             f"compile {tcfg.get('compile')}",
             "- full config: `config.yaml`", ""]
    if train:
        tps = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
        mfus = [r["mfu"] for r in train if "mfu" in r]
        batch_s = [r["time/batch_s"] for r in train if "time/batch_s" in r]
        gen = [r["generation/tokens_per_s"] for r in train if "generation/tokens_per_s" in r]
        lines += ["## Training", "",
                  f"- steps {train[0]['step']:,} → {train[-1]['step']:,}; tokens seen {train[-1]['tokens']:,}",
                  f"- train loss {train[0]['loss']:.4f} (step {train[0]['step']}) → {train[-1]['loss']:.4f} "
                  f"(step {train[-1]['step']})"]
        if tps:
            lines.append(f"- training throughput (optimizer steps only): median {statistics.median(tps):,.0f} "
                         "tokens/s" + (f", MFU {statistics.median(mfus):.1%}" if mfus else ""))
        if batch_s:
            lines.append(f"- preparing each step's batches (next_micro_batches): median "
                         f"{statistics.median(batch_s):.3f} s per step"
                         + (f"; generation median {statistics.median(gen):,.0f} tokens/s" if gen else ""))
        lines.append("")
    if evals:
        lines += ["## Evaluations", "", *eval_table(evals), ""]
    if (out_dir / "loss.png").is_file():
        lines += ["## Loss", "", "![loss curve](loss.png)", ""]
    if checkpoint is not None:
        lines += ["## Checkpoint", "", f"`{checkpoint}` (safetensors weights, meta.json, training state)", ""]
    path = out_dir / "report.md"
    with atomic_write(path, "w") as f:
        f.write("\n".join(lines))
    return path
