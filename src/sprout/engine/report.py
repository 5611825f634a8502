"""A run's report.md: what ran, what it measured and where its files are, readable without a browser.

Written by rank 0 at the end of `sprout.engine.training_loop.fit`, next to metrics.jsonl and loss.png, from
those records and the checkpoint meta; every figure in it is read from metrics.jsonl, so
the report can be rebuilt from a run folder at any time (`write_report`).

Besides training and eval records, metrics.jsonl holds one run-start record per segment
of the run (the first start and every resume; `start_record`): its step, the UTC time, the
command line (shell-quoted: it pastes back into a shell), the git commit of the code, the
hardware, world size and precision, and the matmul peak its MFU is measured against with where
that figure came from ("measured" at the start of that segment, or "config":
`train.peak_tflops`). A segment's wall-clock time is the last `elapsed_s` it logged. Chat
stages log a `samples` record: prompts and the answers the model generated at the end of
training (or, when a signal stopped them, the signal's name in `stopped`).
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from sprout.atomic import atomic_write, sha256_file
from sprout.engine.metrics import METRICS, duration, read_metrics


def code(value, cell: bool = False) -> str:
    """`value` as a markdown code span: between more backticks than its longest run of them (a space
    inside each end where it starts or ends with one), so a command or a path holding backticks
    stays one span; a line break shown as `\\n` (the exact command is the start record's, in
    metrics.jsonl), so it stays on its line; in a table `cell`, its `|` escaped, so the row keeps
    its columns."""
    value = re.sub(r"\r\n?|\n", r"\\n", str(value))
    value = value.replace("|", "\\|") if cell else value
    fence = "`" * (1 + max(map(len, re.findall("`+", value)), default=0))
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{value}{pad}{fence}"


_INLINE = re.compile(r"([\\`*_\[\]<>~|&])")  # emphasis, code, links, html, strike, cells, entities
_LINE_START = re.compile(r"^(\d*)([#>+=.)-])", re.MULTILINE)  # a heading, quote, list or rule mark
_INDENT = re.compile(r"^[ \t]+", re.MULTILINE)


def text(value, one_line: bool = False) -> str:
    """`value` as markdown that shows its characters as they are (a prompt, a model's answer):
    the marks of emphasis, code, links, html, strikethrough, table cells and entities
    backslash-escaped, a line's leading heading, quote or list mark too, and its indentation
    as non-breaking spaces (indented lines would be a code block, which shows the escapes), so
    `2*3 and 4*5` stays two products rather than turning italic; a `\\r` line break is
    `\\n`, for the lines to be the markdown's own. `one_line`: every run of whitespace one
    space, for text inside `**...**` or a list item, which a line break would end."""
    value = " ".join(str(value).split()) if one_line else re.sub(r"\r\n?", "\n", str(value))
    value = _INLINE.sub(r"\\\1", value)
    value = _INDENT.sub(lambda m: m[0].expandtabs(4).replace(" ", "&nbsp;"), value)
    return _LINE_START.sub(lambda m: m[1] + "\\" + m[2], value)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


# ---- facts about the run, recorded at its start -------------------------------------------------
def git_commit(where: str | Path | None = None) -> str:
    """The commit checked out where the sprout code lies ("-dirty" when files differ from it), or
    "unknown" outside a git checkout or without git; never raises."""
    where = Path(where or Path(__file__).resolve().parent)
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)

        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else `platform.processor()`), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def hardware(device="cuda") -> dict:
    """{"cpu": model, "cpu_count": n, "gpu": name or None, "gpu_count": n} of this machine; the GPU
    only when `device` is a cuda one and there is one."""
    import torch

    gpu = str(device).startswith("cuda") and torch.cuda.is_available()
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count() or 0,
            "gpu": torch.cuda.get_device_name(0) if gpu else None,
            "gpu_count": torch.cuda.device_count() if gpu else 0}


def hardware_line(hw: dict) -> str:
    """`hardware`'s record in words: "<cpu> (<n> cores); <n> × <gpu>" or "...; no GPU"."""
    cpu = f"{hw.get('cpu', 'unknown')} ({hw.get('cpu_count', '?')} cores)"
    gpu = f"{hw['gpu_count']} × {hw['gpu']}" if hw.get("gpu") else "no GPU"
    return f"{cpu}; {gpu}"


def start_record(step: int, *, peak_flops: float, peak_source: str, device, world_size: int,
                 precision: str) -> dict:
    """The run-start record of a segment (see the module docstring); `peak_flops` per process."""
    return {"event": "start", "step": step, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "peak_tflops": peak_flops / 1e12, "peak_source": peak_source, "world_size": world_size,
            "precision": precision, "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "git_commit": git_commit(), "hardware": hardware(device)}


# ---- report sections ---------------------------------------------------------------------------
def eval_table(evals: list[dict]) -> list[str]:
    """Markdown rows: one per eval record, a column per val_* field."""
    keys = sorted({k for r in evals for k in r if k.startswith("val_")})
    lines = ["| step | tokens | " + " | ".join(keys) + " |", "| ---: | ---: |" + " ---: |" * len(keys)]
    for r in evals:
        lines.append(f"| {r['step']:,} | {r['tokens']:,} | " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |")
    return lines


def segments(records: list[dict]) -> list[dict]:
    """The run's segments in order: each start record with `records` (what it logged after it)."""
    out: list[dict] = []
    for r in records:
        if r.get("event") == "start":
            out.append({**r, "records": []})
        elif out:
            out[-1]["records"].append(r)
    return out


def _wall_s(segment: dict) -> float | None:
    times = [r["elapsed_s"] for r in segment["records"] if "elapsed_s" in r]
    return max(times) if times else None


def _peak(seg: dict) -> str:
    if seg.get("peak_tflops", 0) <= 0:
        return "no MFU (train.peak_tflops < 0)"
    how = "measured at this start" if seg.get("peak_source") == "measured" else "train.peak_tflops"
    return f"{seg['peak_tflops']:.3g} TFLOP/s per process ({how})"


def run_section(segs: list[dict]) -> list[str]:
    """Command line, commit, hardware, world size, precision, wall-clock time, then every resume."""
    first = segs[0]
    walls = [w for w in map(_wall_s, segs) if w is not None]
    lines = ["## Run", "",
             f"- command: {code(first.get('command', 'unknown'))}",
             f"- git commit: `{first.get('git_commit', 'unknown')}`",
             f"- hardware: {hardware_line(first.get('hardware', {}))}",
             f"- world size {first.get('world_size')}; precision {first.get('precision')}",
             f"- started {first.get('time')}; wall-clock time {duration(sum(walls)) if walls else 'unknown'}"
             + (f" over {len(segs)} segments" if len(segs) > 1 else ""), ""]
    lines += ["| segment | from step | started (UTC) | wall time | MFU against | command |",
              "| ---: | ---: | --- | ---: | --- | --- |"]
    for i, seg in enumerate(segs):
        wall = _wall_s(seg)
        what = "start" if i == 0 and seg["step"] == 0 else "resume"
        lines.append(f"| {i + 1} ({what}) | {seg['step']:,} | {seg.get('time')} | "
                     f"{duration(wall) if wall is not None else '—'} | {_peak(seg)} | {code(seg.get('command', ''), cell=True)} |")
    for i, seg in enumerate(segs[1:], 2):
        if seg.get("git_commit") != first.get("git_commit") or seg.get("hardware") != first.get("hardware"):
            lines.append(f"\nSegment {i} ran on commit `{seg.get('git_commit')}`, "
                         f"{hardware_line(seg.get('hardware', {}))}, world size {seg.get('world_size')}.")
    return lines + [""]


def _data_files(meta: dict) -> list[tuple[str, str, str]]:
    """(role, path, sha256) of the run's data: the config's data paths, hashed now."""
    data = meta.get("config", {}).get("data", {})
    out = []
    for role, key in (("train", "path"), ("val", "val_path")):
        path = data.get(key)
        if role == "val" and not path and data.get("path", "").endswith(".h5"):
            path = data["path"][:-3] + "_val.h5"
        if path and Path(path).is_file():
            out.append((role, path, sha256_file(path)))
    return out


def provenance_section(meta: dict) -> list[str]:
    """The init checkpoint and the data, with their sha256, for stages that start from a checkpoint."""
    init = meta.get("init")
    if not isinstance(init, dict):
        return []
    lines = ["## Inputs", "",
             f"- init checkpoint: {code(init.get('path'))} ({init.get('stage')} step {init.get('step')}); "
             f"weights sha256 `{init.get('weights_sha256')}`"]
    for role, path, digest in _data_files(meta):
        lines.append(f"- {role} data: {code(path)}; sha256 `{digest}` (at the end of the run)")
    return lines + [""]


def samples_section(records: list[dict]) -> list[str]:
    """The last samples record: each prompt and the answer generated at the end of training."""
    rec = next((r for r in reversed(records) if r.get("event") == "samples"), None)
    if rec is None:
        return []
    if rec.get("stopped"):
        return ["## Samples", "", f"None: {rec['stopped']} stopped them at step {rec['step']:,}.", ""]
    lines = ["## Samples", "", f"Generated at step {rec['step']:,} ({rec.get('decoding', 'greedy')}).", ""]
    for s in rec["samples"]:
        answer = text(s["answer"].strip()).replace("\n", "\n> ") or "(empty answer)"
        lines += [f"**{text(s['prompt'], one_line=True)}**", "", f"> {answer}", ""]
    return lines


def write_report(out_dir: str | Path, *, stage: str, meta: dict, num_params: int, world_size: int,
                 precision: str, checkpoint: str | Path | None = None) -> Path:
    """Write <out_dir>/report.md from <out_dir>/metrics.jsonl and the run's meta; returns its path."""
    out_dir = Path(out_dir)
    records = read_metrics(out_dir / METRICS)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("val_") for k in r)]
    segs = segments(records)
    cfg, model = meta.get("config", {}), meta.get("model_config", {})
    tcfg, ocfg = cfg.get("train", {}), cfg.get("optim", {})
    batch = ", ".join(f"{k} {_fmt(v)}" for k, v in cfg.get("batch", {}).items())
    lines = [f"# {stage} run: {out_dir.name}", "",
             f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC by sprout at the end of training.", ""]
    if segs:
        lines += run_section(segs)
    lines += ["## Setup", "",
              f"- model: {num_params:,} parameters; " + ", ".join(f"{k} {model[k]}" for k in
                                                                 ("d_model", "n_layers", "n_heads", "vocab_size",
                                                                  "max_seq_len") if k in model),
              f"- tokenizer: {code(meta.get('tokenizer'))}",
              f"- {world_size} process(es); batch: {batch or 'n/a'}; "
              f"lr {ocfg.get('lr')} ({ocfg.get('schedule')}); mixed precision {precision}; "
              f"compile {tcfg.get('compile')}",
              "- full config: `config.yaml`", ""]
    if isinstance(meta.get("lora"), dict):  # a LoRA run: what trained, and on which base
        lora, base = meta["lora"], meta.get("frozen_models", {}).get("base", {})
        lines.insert(-2, f"- LoRA: r {lora.get('r')}, alpha {lora.get('alpha')} (scale {lora.get('scale'):g}) on "
                         f"{', '.join(lora.get('target_modules', []))}; base {code(base.get('path'))}; checkpoints "
                         f"hold the trained tensors only (adapters, and a scalar head where the model has one)")
    lines += provenance_section(meta)
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
        for i, seg in enumerate(segs if mfus else [], 1):
            seg_mfu = [r["mfu"] for r in seg["records"] if "mfu" in r]
            if seg_mfu:
                lines.append(f"  - segment {i} (from step {seg['step']:,}): MFU median {statistics.median(seg_mfu):.1%}"
                             f" against {_peak(seg)}")
        if mfus and max(mfus) > 1:
            lines.append("  - an MFU above 100 % means the peak it is measured against is below what training "
                         "reached (a peak measured at start under other load, or a train.peak_tflops set too low)")
        if batch_s:
            lines.append(f"- preparing each step's batches (next_micro_batches): median "
                         f"{statistics.median(batch_s):.3f} s per step"
                         + (f"; generation median {statistics.median(gen):,.0f} tokens/s" if gen else ""))
        lines.append("")
    if evals:
        lines += ["## Evaluations", "", *eval_table(evals), ""]
    lines += samples_section(records)
    if (out_dir / "loss.png").is_file():
        lines += ["## Loss", "", "![loss curve](loss.png)", ""]
    if checkpoint is not None:
        lines += ["## Checkpoint", "", f"{code(checkpoint)} (safetensors weights, meta.json, training state)", ""]
    path = out_dir / "report.md"
    with atomic_write(path, "w") as f:
        f.write("\n".join(lines))
    return path
