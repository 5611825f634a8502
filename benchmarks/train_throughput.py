"""Training throughput: sprout's trainer against a plain nanoGPT-style loop, in one run.

Both train the same shape (d_model 256, 6 layers, 8 heads, vocab 4096, seq 256, batch 16,
fp32 on CPU by default) on the same random tokens:
- sprout: `Transformer` (tied embeddings, so the parameter count matches the reference's)
  driven by `Trainer.step`, i.e. the real loop: target counting, loss normalisation,
  clipping, lr schedule, fused AdamW, metrics;
- reference: `benchmarks/reference_gpt.py` (nanoGPT: learned positions, LayerNorm, GELU)
  with nanoGPT's own step: forward with loss, backward, clip, AdamW step.
A third row runs sprout's model under the plain loop (no Trainer), which separates the
cost of the model from the cost of the loop. Steps alternate between the rows (ABCABC...)
so that load from other processes hits all of them
alike; tokens/s is the median over the timed steps. MFU = FLOPs per token (6 N_matmul +
12 L d T, PaLM appendix B, for both models) × tokens/s ÷ the fp32 matmul peak measured
at the start of this same run.

    python benchmarks/train_throughput.py [--steps 20] [--batch 16] [--threads N] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_gpt import ReferenceGPT  # noqa: E402

from sprout.losses import token_nll_sum  # noqa: E402
from sprout.model import ModelConfig, Transformer  # noqa: E402
from sprout.train.loop import TrainConfig, Trainer, build_optimizer, make_accelerator  # noqa: E402
from sprout.train.metrics import measure_matmul_flops  # noqa: E402


def reference_flops_per_token(model: ReferenceGPT, n_layers: int, d_model: int, seq_len: int) -> float:
    n_matmul = model.num_params() - model.wpe.weight.numel()  # the tied wte is the lm_head matmul
    return 6.0 * n_matmul + 12.0 * n_layers * d_model * seq_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--compile", action="store_true", help="torch.compile sprout's model")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    T, B = args.seq, args.batch
    tokens = B * T

    peak = max(measure_matmul_flops(n, seconds=1.5) for n in (512, 1024, 2048))

    cfg = TrainConfig(global_batch_tokens=tokens, micro_batch_tokens=tokens, max_steps=10**6, warmup_steps=0,
                      schedule="constant", lr=6e-4, compile=args.compile, progress=False)
    model = Transformer(ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                                    n_heads=args.heads, max_seq_len=T, tie_embeddings=True))
    trainer = Trainer(make_accelerator(cfg), model, build_optimizer(model, cfg), lambda s: cfg.lr, cfg)

    def sprout_loss(m, batch):
        nll, n = token_nll_sum(m(batch["input_ids"]), batch["targets"])
        return nll, n, {}

    ref = ReferenceGPT(args.vocab, args.d_model, args.layers, args.heads, T)
    ref_opt = ref.configure_optimizers(weight_decay=0.1, learning_rate=6e-4)

    def ref_step(x, y):
        _, loss = ref(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        return loss.item()

    plain = Transformer(ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                                    n_heads=args.heads, max_seq_len=T, tie_embeddings=True))
    if args.compile:
        plain.compile()
    plain_opt = build_optimizer(plain, cfg)

    def plain_step(x, y):
        loss = torch.nn.functional.cross_entropy(plain(x).view(-1, args.vocab), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        return loss.item()

    steps = {"sprout": lambda x, y: trainer.step([{"input_ids": x, "targets": y}], sprout_loss),
             "reference": ref_step, "sprout model, plain loop": plain_step}
    data = torch.randint(0, args.vocab, (args.warmup + args.steps, B, T + 1))
    times = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        x, y = data[i, :, :-1].contiguous(), data[i, :, 1:].contiguous()
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(x, y)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    ref_flops = reference_flops_per_token(ref, args.layers, args.d_model, T)
    flops = {"sprout": model.flops_per_token(T), "reference": ref_flops,
             "sprout model, plain loop": plain.flops_per_token(T)}
    params = {"sprout": model.num_params(), "reference": ref.num_params(),
              "sprout model, plain loop": plain.num_params()}
    print(f"shape: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, "
          f"seq {T}, batch {B} ({tokens:,} tokens/step), fp32, {torch.get_num_threads()} threads"
          + (", sprout compiled" if args.compile else ""))
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"{'':26s} {'params':>10s} {'MFLOP/tok':>10s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>6s}")
    tps = {}
    for name in steps:
        step = statistics.median(times[name])
        tps[name] = tokens / step
        print(f"{name:26s} {params[name]:>10,} {flops[name] / 1e6:>10.1f} {step * 1e3:>9.1f} {tps[name]:>10,.0f} "
              f"{flops[name] * tps[name] / peak:>6.1%}")
    print(f"sprout / reference tokens/s: {tps['sprout'] / tps['reference']:.2f}x; "
          f"Trainer overhead (plain loop / Trainer, sprout's model): "
          f"{tps['sprout model, plain loop'] / tps['sprout']:.3f}x")


if __name__ == "__main__":
    main()
