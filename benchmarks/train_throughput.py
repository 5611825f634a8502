"""Training throughput: sprout's trainer against a plain nanoGPT-style loop, in one run.

All rows train the same shape (d_model 256, 6 layers, 8 heads, vocab 4096, seq 256, batch 16,
fp32 on CPU by default) on the same random tokens at equal parameter count (sprout's SwiGLU
hidden: the multiple of 16 nearest 8/3 d_model, 688 for 256). Rows: sprout's `Trainer.step`
(tied embeddings; eager and under torch.compile); the reference (`benchmarks/reference_gpt.py`)
with nanoGPT's own step; sprout's eager model under the reference's step, which separates the
cost of the model from the cost of the Trainer. Steps alternate between the rows (ABCD ABCD
...); tokens/s is the median over the timed steps. MFU = FLOPs per token (6 N_matmul + 12 L d T,
PaLM appendix B, for both models) × tokens/s ÷ the best fp32 matmul FLOP/s measured at the start
of this same run.

    python benchmarks/train_throughput.py [--steps 10] [--threads N] [--no-compile]
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

from sprout.losses.tokens import token_nll_sum  # noqa: E402
from sprout.model.transformer import ModelConfig, Transformer  # noqa: E402
from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator  # noqa: E402
from sprout.engine.metrics import measure_matmul_flops  # noqa: E402
from sprout.engine.optim import OptimConfig, build_optimizer  # noqa: E402
from sprout.engine.stage import TokenStage  # noqa: E402


def reference_flops_per_token(model: ReferenceGPT, n_layers: int, d_model: int, seq_len: int) -> float:
    n_matmul = model.num_params() - model.wpe.weight.numel()  # the tied wte is the lm_head matmul
    return 6.0 * n_matmul + 12.0 * n_layers * d_model * seq_len


class NextToken(TokenStage):
    name = "bench"

    def loss(self, model, batch):
        nll, n = token_nll_sum(model(batch["input_ids"]), batch["targets"], overwrite_logits=True)
        return nll, n, {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-ff", type=int, default=0, help="SwiGLU hidden (0: multiple of 16 nearest 8/3 d_model)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row (compilation happens here)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    T, B, V = args.seq, args.batch, args.vocab
    tokens = B * T
    peak = max(measure_matmul_flops(n, seconds=0.3) for n in (512, 1024, 2048))
    d_ff = args.d_ff or 16 * round(8 * args.d_model / 3 / 16)

    def sprout_model() -> Transformer:
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=V, d_model=args.d_model, n_layers=args.layers,
                                       n_heads=args.heads, d_ff=d_ff, max_seq_len=T, tie_embeddings=True))

    def trainer_step(compile_: bool):
        cfg = TrainConfig(max_steps=10**6, compile=compile_, progress=False)
        model = sprout_model()
        trainer = Trainer(make_accelerator(cfg), model, build_optimizer(model, OptimConfig(lr=6e-4)),
                          lambda step, peak: peak, cfg)
        return model, lambda x, y: trainer.step([{"input_ids": x, "targets": y}], NextToken())

    def plain_step(model, optimizer, forward_loss):
        def step(x, y):
            loss = forward_loss(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()
        return step

    torch.manual_seed(0)
    ref = ReferenceGPT(V, args.d_model, args.layers, args.heads, T)
    plain = sprout_model()
    rows = {"sprout Trainer": trainer_step(False)}
    if not args.no_compile:
        rows["sprout Trainer, compiled"] = trainer_step(True)
    ref_opt = ref.configure_optimizers(weight_decay=0.1, learning_rate=6e-4)
    rows["reference (nanoGPT)"] = (ref, plain_step(ref, ref_opt, lambda m, x, y: m(x, y)[1]))
    rows["sprout model, plain loop"] = (plain, plain_step(
        plain, build_optimizer(plain, OptimConfig()),
        lambda m, x, y: torch.nn.functional.cross_entropy(m(x).view(-1, V), y.view(-1))))

    data = torch.randint(0, V, (args.warmup + args.steps, B, T + 1))
    times = {name: [] for name in rows}
    for i in range(args.warmup + args.steps):
        x, y = data[i, :, :-1].contiguous(), data[i, :, 1:].contiguous()
        for name, (_, step) in rows.items():
            t0 = time.perf_counter()
            step(x, y)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    print(f"shape: d_model {args.d_model} (SwiGLU hidden {d_ff}), {args.layers} layers, {args.heads} heads, vocab {V}, seq {T}, "
          f"batch {B} ({tokens:,} tokens/step), fp32, {torch.get_num_threads()} thread(s)")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"{'':26s} {'params':>10s} {'MFLOP/tok':>10s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>6s}")
    tps = {}
    for name, (model, _) in rows.items():
        flops = (reference_flops_per_token(model, args.layers, args.d_model, T) if model is ref
                 else model.flops_per_token(T))
        step = statistics.median(times[name])
        tps[name] = tokens / step
        print(f"{name:26s} {model.num_params():>10,} {flops / 1e6:>10.1f} {step * 1e3:>9.1f} {tps[name]:>10,.0f} "
              f"{flops * tps[name] / peak:>6.1%}")
    ref_tps = tps["reference (nanoGPT)"]
    for name in [n for n in rows if n.startswith("sprout Trainer")]:
        print(f"{name} / reference tokens/s: {tps[name] / ref_tps:.2f}x")
    print(f"Trainer overhead (plain loop / Trainer, same eager model): "
          f"{tps['sprout model, plain loop'] / tps['sprout Trainer']:.3f}x")


if __name__ == "__main__":
    main()
