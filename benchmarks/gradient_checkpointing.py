"""train.gradient_checkpointing on and off, side by side: step time, peak RSS, and the losses.

Each variant runs `Trainer.step` in its own subprocess, so that the two do not share a
high-water mark: peak RSS is the child's `resource.getrusage(RUSAGE_SELF).ru_maxrss`, weights,
AdamW state and activations together. Default shape: SmolLM2-135M's (d_model 576, 30 layers,
9 heads, 3 KV heads, SwiGLU hidden 1536, vocab 49152, tied embeddings), seq 1024, micro-batch 4,
fp32 on CPU; random weights and tokens, the same in both children (seed 0). Step time is the
median over the timed steps; the children run one after the other (off, then on), so a load
that changes between them shows in the times. The losses of every step must agree within 1e-6.

    python benchmarks/gradient_checkpointing.py [--steps 2] [--warmup 1] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(args) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_throughput import NextToken

    from sprout.engine.optim import OptimConfig, build_optimizer
    from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
    from sprout.model.transformer import ModelConfig, Transformer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                                    n_heads=args.heads, n_kv_heads=args.kv_heads, d_ff=args.d_ff,
                                    max_seq_len=args.seq, tie_embeddings=True))
    cfg = TrainConfig(max_steps=10**6, progress=False, gradient_checkpointing=args.child == "on")
    trainer = Trainer(make_accelerator(cfg), model, build_optimizer(model, OptimConfig(lr=6e-4)),
                      lambda step, peak: peak, cfg)
    data = torch.randint(0, args.vocab, (args.warmup + args.steps, args.batch, args.seq + 1),
                         generator=torch.Generator().manual_seed(0))
    times, loss = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        out = trainer.step([{"input_ids": data[i, :, :-1], "targets": data[i, :, 1:]}], NextToken())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        loss.append(float(out["loss"]))
    print(json.dumps({"step_s": statistics.median(times), "times": times, "loss": loss,
                      "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "params": model.num_params(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--d-ff", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="rows per step (one micro-batch)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    results = {}
    for variant in ("off", "on"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", variant],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"gradient checkpointing {variant}: child failed\n{proc.stderr[-3000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = results["off"], results["on"]
    print(f"shape: d_model {args.d_model}, {args.layers} layers, {args.heads} heads ({args.kv_heads} KV), "
          f"SwiGLU hidden {args.d_ff}, vocab {args.vocab}, {off['params']:,} params; seq {args.seq}, "
          f"micro-batch {args.batch} ({args.seq * args.batch:,} tokens/step), fp32, {off['threads']} thread(s), "
          f"torch {off['torch']}; {args.warmup} untimed + {args.steps} timed steps each")
    print(f"{'gradient_checkpointing':24s} {'step s':>8s} {'peak RSS GiB':>13s}")
    for name, r in (("false", off), ("true", on)):
        print(f"{name:24s} {r['step_s']:>8.2f} {r['peak_rss_kib'] / 2**20:>13.2f}")
    print(f"{'true / false':24s} {on['step_s'] / off['step_s']:>7.2f}x {on['peak_rss_kib'] / off['peak_rss_kib']:>12.2f}x")
    diff = max(abs(a - b) for a, b in zip(off["loss"], on["loss"]))
    print(f"losses per step: false {off['loss']}, true {on['loss']}; max |difference| {diff:.2e}")
    if diff > 1e-6:
        sys.exit("losses differ by more than 1e-6")


if __name__ == "__main__":
    main()
