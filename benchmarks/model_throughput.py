"""Forward + backward tokens/s: sprout's Transformer against the nanoGPT-style reference.

Same shape for both (default: d_model 256, 6 layers, 8 heads, vocab 4096, seq 256,
batch 16), fp32, on this machine's CPU. The models take one step each in turn, for
several rounds, so load from other processes hits all alike; the best step per model
gives the ratio (the least disturbed run) and the median is printed beside it.
This isolates the model (no optimizer, no loader); benchmarks/train_throughput.py times a
whole optimizer step.

At equal d_model, sprout's SwiGLU (3 matrices of d x 8/3 d, rounded up to a multiple of
64) holds about the parameters of the reference's 4d GELU MLP (2 matrices of d x 4d).

    .venv/bin/python benchmarks/model_throughput.py [--tie] [--compile] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_gpt import ReferenceGPT  # noqa: E402

from sprout.model import ModelConfig, Transformer  # noqa: E402


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=6)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8, help="timed fwd+bwd steps per model")
    ap.add_argument("--tie", action="store_true", help="tie sprout's embeddings, as the reference does")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(sprout)")
    args = ap.parse_args()
    torch.manual_seed(0)
    B, T = args.batch, args.seq_len
    sprout = Transformer(ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers,
                                     n_heads=args.n_heads, max_seq_len=T, tie_embeddings=args.tie))
    ref = ReferenceGPT(args.vocab, args.d_model, args.n_layers, args.n_heads, T)
    x = torch.randint(0, args.vocab, (B, T))
    y = torch.randint(0, args.vocab, (B, T))

    def sprout_step(model=sprout):
        loss = F.cross_entropy(model(x).view(-1, args.vocab), y.view(-1))
        loss.backward()

    def ref_step():
        _, loss = ref(x, y)
        loss.backward()

    steps = {"sprout": sprout_step, "reference": ref_step}
    if args.compile:
        compiled = torch.compile(sprout)
        t0 = time.perf_counter()
        sprout_step(compiled)
        print(f"torch.compile warm-up: {time.perf_counter() - t0:.0f} s")
        steps["sprout compiled"] = lambda: sprout_step(compiled)
    for step in steps.values():  # warm up
        step()
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            times[k].append(timed(step))
    print(f"shape: B={B} T={T} d={args.d_model} L={args.n_layers} H={args.n_heads} V={args.vocab}, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print(f"params: sprout {sprout.num_params():,} (tied={args.tie}), reference {ref.num_params():,} (tied)")
    best = {k: B * T / min(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>16}: {best[k]:8,.0f} tokens/s fwd+bwd best, {B * T / statistics.median(v):8,.0f} median "
              f"({args.rounds} steps)")
    for k in steps:
        if k != "reference":
            print(f"ratio {k}/reference: {best[k] / best['reference']:.3f}x")


if __name__ == "__main__":
    main()
