"""One short, prepared GPU check of the pretraining path (for a session lent a GPU).

What runs, each as the real CLI (`scripts/pretrain.py`) on synthetic token shards, so
nothing is downloaded and no tokenizer file is needed (val_bpb is therefore not reported;
bits-per-byte is tested on CPU):

  1. peak: the best bf16 (GPU) or fp32 (CPU) matmul FLOP/s measured here, the MFU denominator;
  2. eager: gpt2-small (124M, configs/gpt2-small/pretrain.yaml) with bf16 autocast, a few steps;
  3. compiled: the same with torch.compile (the first steps include compilation);
  4. fsdp: the same model under `accelerate launch` with configs/accelerate/fsdp.yaml on
     the GPUs present; then a second run resumed from the first run's half-way checkpoint
     (FSDP save, then FSDP load): its losses must equal the uninterrupted run's.

It prints one table (tokens/s and MFU of the last logged window of each run) and writes
<out>/gpu_check.json. `--tiny` runs the same on the CPU with the demo-size model and
configs/accelerate/cpu_fsdp.yaml, to check the script itself where there is no GPU.

    python benchmarks/gpu_check.py --out runs/gpu_check            # on a GPU machine (not yet run on one)
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_check     # dry run on CPU, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from sprout.formats.manifest import write_shard_manifest  # noqa: E402
from sprout.formats.shards import shard_name, write_shard  # noqa: E402
from sprout.train.metrics import measure_matmul_flops, read_metrics  # noqa: E402


def synthetic_shards(folder: Path, vocab: int, train_tokens: int, val_tokens: int) -> Path:
    """Random uint16 token shards with a manifest giving the vocab (no tokenizer spec)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(folder / shard_name("synthetic", "train", 0), rng.integers(0, vocab, train_tokens), np.uint16)
    write_shard(folder / shard_name("synthetic", "val", 0), rng.integers(0, vocab, val_tokens), np.uint16)
    write_shard_manifest(folder, "synthetic", vocab)
    return folder


def run(cmd: list[str], log: Path, env: dict) -> float:
    """Run one command, tee its output to `log`; returns its wall time. Raises on failure."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    text = log.read_text()
    print(text[-1500:], flush=True)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; log: {log}")
    return time.perf_counter() - t0


def last_train_record(out: Path) -> dict:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r][-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check")
    p.add_argument("--tiny", action="store_true", help="demo-size model on the CPU (checks this script)")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default 20 on GPU, 6 tiny)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available() and not args.tiny
    n_gpu = torch.cuda.device_count() if gpu else 2
    steps = args.steps or (20 if gpu else 6)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PYTHONUNBUFFERED": "1"}
    if not gpu:
        env["OMP_NUM_THREADS"] = "1"

    if gpu:
        peak = max(measure_matmul_flops(n, torch.bfloat16, "cuda", seconds=0.4) for n in (4096, 8192))
        config, vocab, seq, micro = "configs/gpt2-small/pretrain.yaml", 50257, 1024, 32768
        global_batch = micro * 4 * n_gpu
        fsdp_config = out / "fsdp.yaml"
        fsdp_config.write_text((ROOT / "configs/accelerate/fsdp.yaml").read_text()
                               .replace("num_processes: 8", f"num_processes: {n_gpu}"))
        device = f"{n_gpu} × {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16"
    else:
        peak = max(measure_matmul_flops(n, seconds=0.2) for n in (512, 1024))
        config, vocab, seq, micro = "configs/demo/pretrain.yaml", 4096, 256, 4096
        global_batch = micro * 2
        fsdp_config = ROOT / "configs/accelerate/cpu_fsdp.yaml"
        device = f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, fp32"
    print(f"{device}: measured matmul peak {peak / 1e12:.2f} TFLOP/s", flush=True)
    data = synthetic_shards(out / "data", vocab, global_batch * (steps + 2) + seq + 1, 8 * seq + 1)

    common = [sys.executable, "scripts/pretrain.py", "--config", config, "--data", str(data),
              "--data.seq_len", str(seq), "--data.seq_warmup_frac", "0", "--data.eval_tokens", str(4 * seq),
              "--batch.global_tokens", str(global_batch), "--batch.micro_tokens", str(micro),
              "--train.max_steps", str(steps), "--optim.warmup_steps", "2", "--train.log_every", str(max(1, steps // 4)),
              "--train.eval_every", "0", "--train.progress", "false", "--train.peak_tflops", f"{peak / 1e12:.4f}"]
    if gpu:
        common += ["--model.vocab_size", "50304"]
    results: dict = {"device": device, "peak_tflops": peak / 1e12}
    for name, extra in (("eager", ["--train.compile", "false"]), ("compiled", ["--train.compile", "true"])):
        run_out = out / name
        wall = run(common + ["--out", str(run_out)] + extra, out / f"{name}.log", env)
        rec = last_train_record(run_out)
        results[name] = {"tokens_per_s": rec["tokens_per_s"], "mfu": rec.get("mfu"), "loss": rec["loss"], "wall_s": wall}

    # FSDP: an uninterrupted run, then one resumed from its half-way checkpoint; same losses after it.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(fsdp_config),
              "--num_processes", str(n_gpu), "--main_process_port", "29563"]
    fsdp_common = launch + common[1:] + ["--train.ckpt_every", str(steps // 2), "--train.compile", "false"]
    full, part = out / "fsdp_full", out / "fsdp_resumed"
    wall = run(fsdp_common + ["--out", str(full)], out / "fsdp_full.log", env)
    mid = full / "checkpoints" / f"step_{steps // 2:08d}"  # the state of a run stopped half-way
    run(fsdp_common + ["--out", str(part), "--resume", str(mid)], out / "fsdp_resume.log", env)
    a = {r["step"]: r["loss"] for r in read_metrics(full / "metrics.jsonl") if "loss" in r}
    b = {r["step"]: r["loss"] for r in read_metrics(part / "metrics.jsonl") if "loss" in r}
    after = [s for s in a if s > steps // 2]
    sharded = "FSDP: parameters sharded" in (out / "fsdp_full.log").read_text()
    rec = last_train_record(full)
    results["fsdp"] = {"tokens_per_s": rec["tokens_per_s"], "mfu": rec.get("mfu"), "loss": rec["loss"], "wall_s": wall,
                       "sharded": sharded, "resume_max_abs_diff": max(abs(a[s] - b[s]) for s in after)}

    print(f"\n{device}; peak {peak / 1e12:.1f} TFLOP/s measured here")
    print(f"{'run':10s} {'tokens/s':>12s} {'MFU':>7s} {'loss':>8s} {'wall s':>8s}")
    for name in ("eager", "compiled", "fsdp"):
        r = results[name]
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        print(f"{name:10s} {r['tokens_per_s']:>12,.0f} {mfu:>7s} {r['loss']:>8.4f} {r['wall_s']:>8.1f}")
    f = results["fsdp"]
    print(f"fsdp: sharded={f['sharded']}, resumed vs uninterrupted losses after step {steps // 2}: "
          f"max |diff| {f['resume_max_abs_diff']:.3g}")
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    if not sharded or f["resume_max_abs_diff"] > 1e-4:
        raise SystemExit("FSDP check failed (see above)")


if __name__ == "__main__":
    main()
