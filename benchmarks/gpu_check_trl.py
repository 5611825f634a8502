"""The trl_compare stage of benchmarks/gpu_check.py: benchmarks/trl_compare.py's rows (GRPO, DPO
and SFT steps, generation) against TRL and transformers on an imported model.

On a GPU the model is SmolLM2-135M-Instruct, imported by scripts/import_model.py from the data
mirror's GGUF (`SMOLLM2_GGUF` under `sprout.mirror.mirror_dir()`: $SPROUT_MIRROR, else
../shared/data), and trl_compare runs with --device cuda (bf16 autocast on both sides) for a
few steps; with --tiny, a random model of SmolLM2's kind (grouped-query attention, tied
embeddings) with the check's SentencePiece tokenizer, exported and imported the same way, with
--device cpu. The stage's figures are trl_compare's --json table. Without trl or transformers
(the 'bench' extra) the stage is recorded as skipped with the reason; a first-batch check
beyond its tolerance fails it, its table kept.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import gpu_check_inputs as inputs

SMOLLM2_GGUF = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"  # under the data mirror
BENCH_EXTRA = ("trl", "transformers", "datasets")  # what trl_compare's default rows import
GPU_SIZES = ("--steps", "5", "--warmup", "2")  # the rows' own batch sizes (trl_compare's defaults)
TINY_SIZES = ("--steps", "1", "--warmup", "1", "--threads", "1", "--prompts", "2", "--generations", "2",
              "--micro-completions", "2", "--completion-length", "4", "--pairs", "2", "--rows", "2",
              "--gen-rows", "2", "--new-tokens", "4")


def missing_bench_extra() -> str | None:
    """Why trl_compare cannot run here (a package of the 'bench' extra missing), or None."""
    missing = [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]
    return f"{', '.join(missing)} not installed (pip install -e '.[bench]')" if missing else None


def model_source(out: Path, gpu: bool, failed: type[Exception]) -> Path:
    """What the stage imports: the mirror's SmolLM2 GGUF on a GPU (`failed` raised naming the
    path when it is not there), else a tiny exported model."""
    if gpu:
        from sprout.mirror import ENV, mirror_dir

        root = mirror_dir()
        gguf = root / SMOLLM2_GGUF if root is not None else None
        if gguf is None or not gguf.is_file():
            raise failed(f"trl_compare: no SmolLM2 GGUF at {gguf or '$' + ENV + '/' + SMOLLM2_GGUF} "
                              f"(set {ENV} to the data mirror)")
        return gguf
    return inputs.tiny_export(out / "trl_compare_source", inputs.train_tokenizer(out / "trl_compare_tokenizer"))


def trl_compare_command(out: Path, run: Path, gpu: bool) -> list[str]:
    """trl_compare.py on the imported `run`, its table to <out>/trl_compare.json."""
    return [sys.executable, "benchmarks/trl_compare.py", "--run", str(run), "--device", "cuda" if gpu else "cpu",
            "--json", str(out / "trl_compare.json"), *(GPU_SIZES if gpu else TINY_SIZES)]


def trl_compare_stage(check, gpu: bool, failed: type[Exception]) -> dict:
    """The stage's body for `Check.stage` (gpu_check.Check; `failed`: gpu_check.StageFailed):
    import, run trl_compare, return its table and wall time."""
    reason = missing_bench_extra()
    if reason:
        print(f"\n== trl_compare: skipped, {reason}", flush=True)
        return {"skipped": reason}
    out = check.out
    run = out / "trl_compare_model"
    check.run("trl_compare import", [sys.executable, "scripts/import_model.py", str(model_source(out, gpu, failed)),
                                     "--out", str(run), "--overwrite"], "trl_compare_import")
    report = out / "trl_compare.json"
    report.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        wall = check.run("trl_compare", trl_compare_command(out, run, gpu))
    except failed:
        if report.is_file():  # a check beyond its tolerance: the table stays in gpu_check.json
            check.results["trl_compare"] = {"wall_s": time.perf_counter() - t0, **json.loads(report.read_text())}
        raise
    return {"wall_s": wall, **json.loads(report.read_text())}


def summary(figures: dict) -> str:
    """trl_compare's rows under the check's table: each speed ratio and first-batch verdict."""
    lines = [f"  {figures['precision']}"]
    for r in figures["rows"]:
        checks = ", ".join(f"{k} {v:.1e}" for k, v in r["check"].items())
        verdict = "FAILED: " + "; ".join(r["check_failures"]) if r["check_failures"] else "ok"
        lines.append(f"  {r['name']:14s} {r['speedup']:6.2f}x (target {r['target']:.1f}x)  {checks}  {verdict}")
    return "\n".join(lines)
