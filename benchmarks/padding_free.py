"""Padded against padding-free post-training forwards, side by side in one run: the DPO forward
(`sprout.stages.dpo.side_logps`, both sides of B pairs) and the RL forward
(`sprout.stages.rl_stage.completion_logps`, N prompt + completion rows), each with a backward.

Random weights at SmolLM2-135M's shape (`--tiny`: a small model), random tokens, lengths drawn
uniformly (sides in [seq/8, seq]; prompts in [8, 128], completions in [8, 256]), fp32 or bf16
autocast. Per forward: the tokens the model computes (rows × width), the median seconds of
forward + backward over --steps after --warmup, peak memory (CUDA: max_memory_allocated; CPU:
not measured), and the largest difference of the per-sequence values between the two paths
(float rounding: every value is the same sum). Exits 1 when a difference passes --tolerance.

    python benchmarks/padding_free.py [--device cpu|cuda] [--dtype fp32|bf16] [--steps 5]
                                      [--warmup 2] [--pairs 8] [--seq 512] [--rows 32] [--tiny]
                                      [--tolerance 1e-4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sprout.atomic import atomic_write, check_writable  # noqa: E402
from sprout.errors import run_main  # noqa: E402
from sprout.model.config import ModelConfig  # noqa: E402
from sprout.model.transformer import Transformer  # noqa: E402
from sprout.stages.dpo import side_logps  # noqa: E402
from sprout.stages.packing import PackedRows  # noqa: E402
from sprout.stages.rl_stage import completion_logps  # noqa: E402

SMOLLM2 = {"vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "d_ff": 1536,
           "tie_embeddings": True, "rope_theta": 100000.0}
TINY = {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4}


def pair_batch(g: torch.Generator, pairs: int, seq: int, vocab: int, device) -> dict:
    """2B right-padded sides as `PreferenceLoader.collate` lays them, the latter half of each the response."""
    lengths = torch.randint(max(2, seq // 8), seq + 1, (2 * pairs,), generator=g)
    width = int(lengths.max())
    col = torch.arange(width)
    inside = col[None, :] < lengths[:, None]
    ids = torch.where(inside, torch.randint(1, vocab, (2 * pairs, width), generator=g), 0)
    targets = torch.cat([ids[:, 1:], torch.zeros(2 * pairs, 1, dtype=ids.dtype)], dim=1)
    loss_mask = (col[None, :] >= lengths[:, None] // 2) & (col[None, :] < lengths[:, None] - 1)
    batch = {"input_ids": ids, "targets": targets, "loss_mask": loss_mask, "attention_mask": inside,
             "segment_ids": inside.long(), "position_ids": torch.where(inside, col[None, :], 0)}
    return {k: v.to(device) for k, v in batch.items()}


def rollout_batch(g: torch.Generator, rows: int, vocab: int, device) -> dict:
    """Left-padded prompts and right-padded completions as the RL stages' micro-batches."""
    p, c = torch.randint(8, 129, (rows,), generator=g), torch.randint(8, 257, (rows,), generator=g)
    P, L = int(p.max()), int(c.max())
    prompt_mask = torch.arange(P)[None, :] >= (P - p)[:, None]
    completion_mask = torch.arange(L)[None, :] < c[:, None]
    batch = {"prompt_ids": torch.randint(1, vocab, (rows, P), generator=g) * prompt_mask,
             "prompt_mask": prompt_mask.long(), "completion_ids": torch.randint(1, vocab, (rows, L), generator=g)
             * completion_mask, "completion_mask": completion_mask.long()}
    return {k: v.to(device) for k, v in batch.items()}


def measure(fn, model, args, device) -> dict:
    """Median seconds of forward + backward of fn(model, padding_free) for both paths, their values."""
    out = {}
    for free in (False, True):
        times, values = [], None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                values, mask = fn(model, free)
            torch.where(mask, values, 0).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
        out["padding_free" if free else "padded"] = {"seconds": statistics.median(times), "peak_mib": peak,
                                                     "values": torch.where(mask, values, 0).detach().float()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=8, help="pairs per DPO micro-batch")
    ap.add_argument("--seq", type=int, default=512, help="longest side of a pair")
    ap.add_argument("--rows", type=int, default=32, help="completions per RL micro-batch")
    ap.add_argument("--tiny", action="store_true", help="a small model (a CPU dry run)")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest difference allowed, relative to the values' scale")
    ap.add_argument("--json", type=Path, help="write the table here as JSON")
    args = ap.parse_args()
    if args.json:
        check_writable(args.json)
    device = torch.device(args.device)
    cfg = ModelConfig(**(TINY if args.tiny else SMOLLM2), max_seq_len=max(args.seq, 384))
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    pairs = pair_batch(g, args.pairs, args.seq, cfg.vocab_size, device)
    rollout = rollout_batch(g, args.rows, cfg.vocab_size, device)
    cases = {
        "dpo": (lambda m, free: (side_logps(m, pairs, free)[0], torch.ones(2 * args.pairs, dtype=torch.bool,
                                                                         device=device)),
                pairs["attention_mask"]),
        "rl": (lambda m, free: (completion_logps(m, rollout, padding_free=free)[0], rollout["completion_mask"].bool()),
               torch.cat([rollout["prompt_mask"], rollout["completion_mask"]], dim=1)[:, :-1].bool()),
    }
    table, worst = {}, 0.0
    print(f"{args.device} {args.dtype}, {cfg.n_layers} layers × d_model {cfg.d_model}; median of {args.steps} steps")
    for name, (fn, mask) in cases.items():
        rows = PackedRows(mask)
        got = measure(fn, model, args, device)
        a, b = got["padded"]["values"], got["padding_free"]["values"]
        diff = float((a - b).abs().max()) / max(1.0, float(a.abs().max()))
        worst = max(worst, diff)
        table[name] = {"tokens_padded": mask.numel(), "tokens_packed": rows.rows * rows.width,
                       "real_tokens": int(mask.sum()), "max_rel_diff": diff,
                       **{f"{k}_{q}": v[q] for k, v in got.items() for q in ("seconds", "peak_mib")}}
        t = table[name]
        print(f"{name}: tokens {t['tokens_padded']:,} padded, {t['tokens_packed']:,} packed ({t['real_tokens']:,} real); "
              f"seconds {t['padded_seconds']:.4f} padded, {t['padding_free_seconds']:.4f} packed "
              f"(ratio {t['padding_free_seconds'] / t['padded_seconds']:.2f}); peak MiB {t['padded_peak_mib']:.0f} "
              f"padded, {t['padding_free_peak_mib']:.0f} packed; max difference {diff:.2g} of the scale")
    if args.json:
        with atomic_write(args.json, "w") as f:
            f.write(json.dumps(table, indent=1) + "\n")
    if worst > args.tolerance:
        print(f"FAIL: a difference of {worst:.3g} passes --tolerance {args.tolerance}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
