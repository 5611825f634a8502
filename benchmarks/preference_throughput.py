"""Preference-stage throughput: a DPO step and a reward-model step against an SFT step over the same tokens, in one run.

Every row is one `Trainer.step` of a real stage on the same micro-batch of B pairs, each side a
row of T tokens (a prompt of T/2 tokens, then the response): 2B rows, 2B·T real tokens, on the
same model shape (d_model 256, 6 layers, 8 heads, vocab 4096, seq 256, untied lm_head as the
demo's, fp32 on CPU by default). Rows: SFT (`SFTStage.loss` on the 2B rows); DPO with the
reference log-probs in the batch (as `dpo.precompute_ref_logps` gives them); DPO with a live
frozen reference (`Trainer.prepare_frozen`); the reward model (`RewardStage`). Steps alternate
between the rows (ABCD ABCD ...); each row's time is the median of its timed steps. Ratios are
step times over the SFT step's (lower is better): targets ≤ 1.1× (DPO precomputed, reward
model), ≤ 1.45× (DPO live: the reference forward is about a third of a step's work).

    python benchmarks/preference_throughput.py [--steps 10] [--pairs 8] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from sprout.model.heads import RewardModel
from sprout.model.transformer import ModelConfig, Transformer
from sprout.stages.dpo import DPOLossConfig, DPOStage
from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
from sprout.engine.optim import OptimConfig, build_optimizer
from sprout.stages.reward import RewardLossConfig, RewardStage
from sprout.stages.sft import SFTStage


def pair_batch(pairs: int, seq: int, vocab: int, seed: int) -> dict:
    """A micro-batch of `pairs` pairs as the preference loader gives it (chosen rows, then
    rejected rows), every row `seq` real tokens: prompt seq/2 tokens (shared by both sides),
    then the response; loss_mask marks the targets that are response tokens."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt = 2 * pairs, seq // 2
    tokens = torch.randint(8, vocab, (rows, seq + 1), generator=g)
    tokens[pairs:, :prompt] = tokens[:pairs, :prompt]  # both sides share their prompt
    input_ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    loss_mask = torch.zeros(rows, seq, dtype=torch.bool)
    loss_mask[:, prompt - 1:] = True
    return {"input_ids": input_ids, "targets": targets, "loss_mask": loss_mask,
            "attention_mask": torch.ones(rows, seq, dtype=torch.bool),
            "segment_ids": torch.ones(rows, seq, dtype=torch.long),
            "position_ids": torch.arange(seq).expand(rows, seq).contiguous(),
            "response_lengths": loss_mask.sum(1), "end_index": torch.full((rows,), seq - 1),
            "pair_mask": torch.ones(pairs, dtype=torch.bool), "margin": torch.zeros(pairs),
            "pair_index": torch.arange(pairs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--pairs", type=int, default=8, help="pairs per step (2 x pairs rows)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                         max_seq_len=args.seq, tie_embeddings=False)
    cfg = TrainConfig(max_steps=10**6, progress=False, peak_tflops=-1)
    acc = make_accelerator(cfg)
    fake_loader = SimpleNamespace(batch_size=args.pairs)  # the preference stages read micro_pairs from it

    def trainer(cls) -> Trainer:
        torch.manual_seed(0)  # every model starts from the same weights (the reward model lacks lm_head)
        model = cls(config)
        return Trainer(acc, model, build_optimizer(model, OptimConfig(lr=1e-5)), lambda step, peak: peak, cfg)

    batches = [pair_batch(args.pairs, args.seq, args.vocab, i) for i in range(args.warmup + args.steps)]
    ref_model = trainer(Transformer).raw_model  # the reference: the policy's initial weights
    with torch.no_grad():  # what dpo.precompute_ref_logps would have cached for these pairs
        from sprout.losses.tokens import sequence_logps

        for b in batches:
            logits = ref_model(b["input_ids"], segment_ids=b["segment_ids"], position_ids=b["position_ids"])
            b["ref_logps"] = sequence_logps(logits, b["targets"], b["loss_mask"])[0]

    rows = {}
    sft = trainer(Transformer)
    rows["SFT (same tokens)"] = (sft, SFTStage(acc, None, None, 1))
    dpo_pre = trainer(Transformer)
    rows["DPO, precomputed reference"] = (dpo_pre, DPOStage(acc, fake_loader, None, 1, DPOLossConfig()))
    dpo_live = trainer(Transformer)
    live = DPOStage(acc, fake_loader, None, 1, DPOLossConfig(), ref_model=ref_model)
    live.setup(dpo_live)  # prepares the frozen reference
    rows["DPO, live reference"] = (dpo_live, live)
    rows["reward model"] = (trainer(RewardModel), RewardStage(acc, fake_loader, None, 1, RewardLossConfig()))

    times = {name: [] for name in rows}
    for i, batch in enumerate(batches):
        for name, (tr, stage) in rows.items():
            b = batch if name == "DPO, precomputed reference" else {k: v for k, v in batch.items() if k != "ref_logps"}
            t0 = time.perf_counter()
            tr.step([b], stage)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    tokens = 2 * args.pairs * args.seq
    print(f"shape: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}, "
          f"seq {args.seq}; {args.pairs} pairs = {2 * args.pairs} rows = {tokens:,} tokens per step, fp32, "
          f"{torch.get_num_threads()} thread(s), median of {args.steps} steps")
    base = statistics.median(times["SFT (same tokens)"])
    targets = {"DPO, precomputed reference": 1.1, "DPO, live reference": 1.45, "reward model": 1.1}
    print(f"{'':28s} {'step ms':>9s} {'tokens/s':>10s} {'vs SFT':>8s} {'target':>8s}")
    for name in rows:
        step = statistics.median(times[name])
        target = f"<= {targets[name]:.2f}" if name in targets else ""
        print(f"{name:28s} {step * 1e3:>9.1f} {tokens / step:>10,.0f} {step / base:>7.2f}x {target:>8s}")


if __name__ == "__main__":
    main()
