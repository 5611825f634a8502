"""New tokens/s of KV-cache batched generation against full recomputation.

Setup: batch 16, mixed prompt lengths, 256 new tokens, the demo-sized model
(d_model 256, 6 layers, vocab 4096) with random weights, fp32 on this machine's CPU.

- KV cache: `sprout.model.generate.generate`, timed end to end (prefill included).
- Full recomputation: the same left-padded batch, where every step runs the model over
  the whole sequence so far and samples from the last position. Its cost grows with
  the length, so running all 256 steps would take minutes; instead the step is timed at
  `--probes` lengths spread over the whole range and the total for 256 steps is the
  trapezoid sum of those times. The reported rate is 16 x 256 tokens over that total.

    .venv/bin/python benchmarks/generate_throughput.py [--new-tokens 256] [--probes 9]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from sprout.model.generate import generate, left_pad, sample_next
from sprout.model.transformer import ModelConfig, Transformer


@torch.no_grad()
def recompute_step_time(model, ids, segments, positions, generator, repeats: int = 2) -> float:
    """Seconds for one full-recomputation step over the batch as it stands (best of repeats)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits = model(ids, segment_ids=segments, position_ids=positions)[:, -1]
        sample_next(logits, 1.0, generator=generator)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--probes", type=int, default=9, help="recomputation steps timed across the range")
    ap.add_argument("--rounds", type=int, default=2, help="KV-cache runs; the best is reported")
    args = ap.parse_args()
    torch.manual_seed(0)
    N = args.new_tokens
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=8, max_seq_len=args.max_prompt + N)
    model = Transformer(cfg).eval()
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.batch)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lengths]
    g = torch.Generator().manual_seed(0)

    generate(model, prompts, 8, generator=g)  # warm up
    kv_times = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        out = generate(model, prompts, N, temperature=1.0, generator=g)
        kv_times.append(time.perf_counter() - t0)
    assert all(len(t) == N for t in out.tokens)
    kv_rate = args.batch * N / min(kv_times)

    # Full recomputation, probed at evenly spaced steps; the continuation is the KV run's tokens.
    ids, segments, positions = left_pad([p + t for p, t in zip(prompts, out.tokens)], "cpu")
    P = max(lengths)
    probe_steps = np.linspace(0, N - 1, args.probes).round().astype(int)
    probe_times = []
    for k in probe_steps:  # step k sees the left-padded prompts plus k new tokens
        end = P + k
        probe_times.append(recompute_step_time(model, ids[:, :end], segments[:, :end], positions[:, :end], g))
    total = float(np.interp(np.arange(N), probe_steps, probe_times).sum())
    full_rate = args.batch * N / total

    print(f"model: d_model 256, 6 layers, vocab 4096, {model.num_params():,} params, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    print(f"batch {args.batch}, prompt lengths {lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}), "
          f"{N} new tokens per row")
    print(f"KV cache:          {kv_rate:9,.0f} new tokens/s  ({min(kv_times):.2f} s for {args.batch * N} tokens, "
          f"best of {args.rounds})")
    print(f"full recompute:    {full_rate:9,.0f} new tokens/s  (est. {total:.1f} s for {args.batch * N} tokens; "
          f"step time {probe_times[0] * 1e3:.0f} ms at length {P} .. {probe_times[-1] * 1e3:.0f} ms at {P + N - 1}, "
          f"{args.probes} probes)")
    print(f"speed-up: {kv_rate / full_rate:.1f}x")


if __name__ == "__main__":
    main()
