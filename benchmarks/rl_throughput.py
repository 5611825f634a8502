"""RL throughput: rollout generation (new tokens/s), sprout against transformers at equal weights.

The demo-sized model (d_model 256, 6 layers, 8 heads, vocab 4096), random weights, fp32 on this
machine's CPU; prompts of 16..128 random tokens, left-padded; 256 new tokens per row at
temperature 1, no top-k/top-p, no stop id, so every row generates all 256 in every engine.
Shapes: rollouts 4 prompts × 4 samples, chat 16 × 1. Engines, alternating, best of --rounds:
sprout eager and compiled (`sprout.model.generate.generate_tokens`; the compile call is reported
apart) and transformers' `LlamaForCausalLM.generate` on the weights exported by
`sprout.model.export`, its logits first checked against sprout's to 1e-4 (skipped without
transformers). Aim: sprout at >= 2x transformers' new tokens/s. Then, on the rollouts shape,
GRPO's own rollouts (`GRPOStage.sample`) against `generate_tokens` (target >= 0.9) and the
seconds and shares of a GRPO and a PPO step.

With --lora R, also LoRA rollouts at SmolLM2-135M's shape (d_model 576, 30 layers, 9 heads, 3 KV
heads, SwiGLU hidden 1536, vocab 49152, tied embeddings; random weights): `generate_tokens` eager
on the model with rank-R adapters on every linear layer (`sprout.model.lora.add_adapters`,
alpha 2R, lora_B drawn at random so that the adapters change the tokens) against the plain model
with those adapters merged into its weights, on the rollouts shape, alternating, best of --rounds;
their greedy tokens must first be equal. Aim: LoRA at >= 0.9x the plain model's new tokens/s
(decoding merges the adapters into its fused weight copies once per generate call, whose
seconds are printed); then up to 64 decode steps of the two taking turns step by step, a
per-step ratio that a changing load on the machine does not skew.

    .venv/bin/python benchmarks/rl_throughput.py [--new-tokens 256] [--rounds 2] [--no-compile]
                                                 [--no-grpo] [--no-ppo] [--cases rollouts,chat shape]
                                                 [--lora 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from importlib.metadata import version
from types import SimpleNamespace

import numpy as np
import torch

from sprout.model.decode import make_decoder
from sprout.model.generate import generate_tokens, pad_prompts
from sprout.model.heads import padding_inputs
from sprout.model.transformer import ModelConfig, Transformer

CASES = {"rollouts": (4, 4), "chat shape": (16, 1)}  # name -> (prompts, generations per prompt)
SMOLLM2 = {"vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "d_ff": 1536,
           "tie_embeddings": True}  # SmolLM2-135M's shape


def to_transformers(model):
    """`LlamaForCausalLM` with `model`'s weights (None when transformers is not installed)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    from sprout.model.export import hf_config, hf_state_dict

    cfg = hf_config(model)  # no tokenizer: no special ids
    cfg.pop("architectures"), cfg.pop("model_type")
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    weights, _ = hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight" or not model.config.tie_embeddings]:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@torch.no_grad()
def check_logits(model, hf, ids, mask) -> float:
    """Largest |sprout - transformers| logit on the padded prompts' real positions."""
    segments, positions = padding_inputs(mask)
    ours = model(ids, segment_ids=segments, position_ids=positions)
    theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    return float((ours - theirs).abs()[mask.bool()].max())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(name, model, hf, prompts, G, args) -> None:
    ids, mask = pad_prompts(prompts)
    N, rows = args.new_tokens, len(prompts) * G
    seed = iter(range(10**6))

    def sprout(compile):
        g = torch.Generator().manual_seed(next(seed))
        out = generate_tokens(model, ids, mask, max_new_tokens=N, num_generations=G, generator=g, compile=compile)
        assert int(out.lengths.min()) == N

    def transformers():
        torch.manual_seed(next(seed))
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                          max_new_tokens=N, min_new_tokens=N, num_return_sequences=G)
        assert out.shape == (rows, ids.shape[1] + N)

    engines = {"sprout eager": lambda: sprout(False)}
    if not args.no_compile:
        first = timed(lambda: sprout(True))
        engines["sprout compiled"] = lambda: sprout(True)
    if hf is not None:
        err = check_logits(model, hf, ids, mask)
        if err > 1e-4:
            raise SystemExit(f"error: transformers' logits differ from sprout's by {err:.2e} (> 1e-4)")
        engines["transformers"] = transformers
    best = {k: float("inf") for k in engines}
    for _ in range(args.rounds):
        for k, fn in engines.items():
            best[k] = min(best[k], timed(fn))
    lengths = mask.sum(1)
    print(f"\n{name}: {len(prompts)} prompts x {G} samples = {rows} rows, prompt lengths {int(lengths.min())}.."
          f"{int(lengths.max())}, {N} new tokens per row, sampling at temperature 1")
    if not args.no_compile:
        print(f"  sprout compiled, first call (compiles): {first:.1f} s")
    if hf is not None:
        print(f"  transformers logits agree with sprout's to {err:.1e}")
    for k, t in best.items():
        print(f"  {k:16s} {rows * N / t:9,.0f} new tokens/s  ({t:.2f} s, best of {args.rounds})")
    if hf is not None:
        for k in best:
            if k != "transformers":
                print(f"  {k} / transformers: {best['transformers'] / best[k]:.2f}x (aim >= 2)")


def print_breakdown(title: str, phases: dict, rounds: int) -> None:
    """Time each phase (best of `rounds`) and print its seconds and share of their sum."""
    best = {k: min(timed(fn) for _ in range(rounds)) for k, fn in phases.items()}
    total = sum(best.values())
    print(f"\n{title}")
    for k, t in best.items():
        print(f"  {k:22s} {t:6.2f} s  {t / total:6.1%}")
    print(f"  {'total':22s} {total:6.2f} s")


# ---- GRPO: its rollouts against generate_tokens, and its step breakdown -------------------------------
class NoStopTokenizer:
    """The two things generation asks of a tokenizer: `vocab_size`, and a chat template whose
    end-of-turn id (the stop id) is `vocab_size` itself, an id the sampler never draws, so
    every GRPO row runs all --new-tokens steps as the other engines' rows do."""

    spec = "benchmark stub"

    def __init__(self, vocab_size: int):
        self.vocab_size = self.eot_id = vocab_size

    def special_id(self, marker):
        return None

    def encode(self, text):
        return [1]


def grpo_stage(policy, ref, B: int, G: int, new_tokens: int, beta: float = 0.04):
    """A one-process GRPOStage (no Trainer) whose rollouts are B prompts × G samples of `new_tokens`
    tokens, as `sprout.stages.grpo` builds it: `policy` generates, `ref` is the frozen reference."""
    from accelerate import Accelerator

    from sprout.stages.grpo import GRPOLossConfig, GRPOStage
    from sprout.stages.rl_stage import PromptBatchConfig, RolloutConfig

    batch = PromptBatchConfig(global_prompts=B, num_generations=G, micro_completions=B * G)
    loader = SimpleNamespace(per_rank=B)
    stage = GRPOStage(Accelerator(cpu=True), NoStopTokenizer(policy.config.vocab_size), loader, None, batch,
                      RolloutConfig(max_completion_length=new_tokens), [], grpo=GRPOLossConfig(beta=beta),
                      ref_model=ref, seed=0)
    stage.setup(SimpleNamespace(generation_model=policy, sharded=False, prepare_frozen=lambda m: m))
    return stage


def grpo_rollouts(model, prompts, G, args) -> None:
    """GRPO's generation phase (`RLStage.sample`: the call GRPOStage.fill_buffer makes, with the
    stage's generator, autocast context and copies to the CPU; rollout.compile false, the
    default) against `generate_tokens` eager on the same model, prompts and shape, timed in
    alternation, best of --rounds each."""
    stage = grpo_stage(model, None, len(prompts), G, args.new_tokens)
    ids, mask = pad_prompts(prompts)
    N, rows = args.new_tokens, len(prompts) * G

    def engine():
        out = generate_tokens(model.eval(), ids, mask, max_new_tokens=N, num_generations=G,
                              generator=torch.Generator().manual_seed(0))
        assert int(out.lengths.min()) == N

    def grpo():
        out = stage.sample(np.arange(len(prompts)), ids=prompts)
        assert int(out["lengths"].min()) == N

    best = {"generate_tokens": float("inf"), "GRPO rollouts": float("inf")}
    for _ in range(args.rounds):
        for k, fn in (("generate_tokens", engine), ("GRPO rollouts", grpo)):
            best[k] = min(best[k], timed(fn))
    print(f"\nGRPO generation: {len(prompts)} prompts x {G} samples = {rows} rows, {N} new tokens per row "
          f"(GRPOStage.sample against generate_tokens eager; best of {args.rounds})")
    for k, t in best.items():
        print(f"  {k:16s} {rows * N / t:9,.0f} new tokens/s  ({t:.2f} s)")
    print(f"  GRPO rollouts / generate_tokens: {best['generate_tokens'] / best['GRPO rollouts']:.2f}x (target >= 0.9)")


def grpo_breakdown(cfg, prompts, G, args) -> None:
    """One GRPO generation batch (len(prompts) prompts × G samples, beta 0.04 so the reference
    exists, the whole batch one micro-batch, μ = 1), timed phase by phase through the stage's own
    methods, best of --rounds: generation (`sample`), the policy's old log-probs and the
    reference's (`logps_of`, no gradient), and the update (`loss`: forward + backward of the
    clipped loss with its KL term, then the optimizer step). Rewards are string checks on the
    decoded text (no network), not timed here."""
    torch.manual_seed(1)
    policy, ref = Transformer(cfg), Transformer(cfg).eval()
    stage = grpo_stage(policy, ref, len(prompts), G, args.new_tokens)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    idx = np.arange(len(prompts))
    rollout = stage.sample(idx, ids=prompts)
    rollout["old_logps"] = stage.logps_of(policy, rollout)
    rollout["ref_logps"] = stage.logps_of(ref, rollout)
    rollout["advantages"] = torch.randn(rollout["completion_ids"].shape[0])
    rollout["extra_target"] = torch.zeros(rollout["completion_ids"].shape[0], dtype=torch.long)
    rollout.pop("lengths")
    stage.buffer = {"stats": torch.zeros(0, 2), "stat_names": []}
    micro = stage.micro_batches(rollout, rollout["completion_ids"].shape[0])

    def update():
        policy.train()
        for batch in micro:
            loss_sum, n, _ = stage.loss(policy, batch)
            (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    phases = {
        "generation": lambda: stage.sample(idx, ids=prompts),
        "old logps": lambda: stage.logps_of(policy, rollout),
        "reference logps": lambda: stage.logps_of(ref, rollout),
        "policy update": update,
    }
    print_breakdown(f"GRPO step breakdown: {len(prompts)} prompts x {G} samples, {args.new_tokens} new tokens per "
                    f"row (policy and reference of the same size, beta 0.04, loss_type dapo; best of {args.rounds})",
                    phases, args.rounds)


# ---- LoRA rollouts against the plain model's -----------------------------------------------------------
def lora_models(cfg: ModelConfig, r: int):
    """(adapted, merged, scale): a random model of `cfg` with rank-`r` LoRA adapters (alpha 2r) on
    every linear layer, lora_B drawn N(0, 0.02) (peft starts it at 0), and a plain `Transformer`
    holding its base weights with those adapters merged (`merge_adapters`: W + s B A)."""
    from sprout.engine.configs import LoraConfig
    from sprout.lora_weights import lora_scale, merge_adapters
    from sprout.model.lora import add_adapters

    torch.manual_seed(0)
    adapted = Transformer(cfg).eval()
    base = {k: v.clone() for k, v in adapted.state_dict().items()}
    lora = LoraConfig(r=r, alpha=2.0 * r)
    add_adapters(adapted, lora, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    scale = lora_scale(lora.r, lora.alpha)
    adapters = {k: v for k, v in adapted.state_dict().items() if ".lora_" in k}
    merged = Transformer(cfg).eval()
    merged.load_state_dict(merge_adapters(base, adapters, scale))
    return adapted.eval(), merged, scale


def lora_rollouts(args, rng) -> None:
    """`generate_tokens` eager on the LoRA model against the merged plain model at SmolLM2-135M's
    shape, on the rollouts shape (4 prompts x 4 samples of --new-tokens), alternating, best of
    --rounds; first their greedy tokens (which must be equal) and the adapters-off model's
    (which the random lora_B should change); then the seconds of one generate call's fused weight
    copies (`DecodeWeights.of`, the adapters merged in for the LoRA model)."""
    from sprout.model.decode import DecodeWeights
    from sprout.model.lora import adapters_disabled
    from sprout.model.onednn import onednn_available

    cfg = ModelConfig(**SMOLLM2, max_seq_len=128 + args.new_tokens)
    adapted, merged, scale = lora_models(cfg, args.lora)
    B, G = CASES["rollouts"]
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in rng.integers(16, 129, size=B)]
    ids, mask = pad_prompts(prompts)
    N, rows = args.new_tokens, B * G

    def greedy(model):
        return generate_tokens(model, ids, mask, max_new_tokens=N, greedy=True).completion_ids

    lora_tokens, merged_tokens = greedy(adapted), greedy(merged)
    if not torch.equal(lora_tokens, merged_tokens):
        raise SystemExit(f"error: the LoRA model's greedy tokens differ from the merged model's at "
                         f"{int((lora_tokens != merged_tokens).sum())} of {lora_tokens.numel()} places")
    with adapters_disabled(adapted):
        changed = int((greedy(adapted) != lora_tokens).sum())

    def sample(model, seed):
        out = generate_tokens(model, ids, mask, max_new_tokens=N, num_generations=G,
                              generator=torch.Generator().manual_seed(seed))
        assert int(out.lengths.min()) == N

    engines = {"plain (merged)": merged, f"LoRA r {args.lora}": adapted}
    best = {k: float("inf") for k in engines}
    for i in range(args.rounds):
        for k, model in engines.items():
            best[k] = min(best[k], timed(lambda: sample(model, i)))
    onednn = onednn_available(merged.lm_head.weight, cfg.d_model)
    kinds = ("onednn", "onednn") if onednn else ("dense", "dense")
    copies = {k: min(timed(lambda: DecodeWeights.of(m, rows, *kinds)) for _ in range(args.rounds))
              for k, m in engines.items()}
    step_ms = interleaved_steps(engines, ids, mask, G, min(N, 64))
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    print(f"\nLoRA rollouts at SmolLM2-135M's shape ({merged.num_params():,} params, random weights): r {args.lora}, "
          f"alpha {2 * args.lora}, scale {scale:g}, on every linear layer ({trained:,} adapter params); "
          f"{B} prompts x {G} samples = {rows} rows, prompt lengths {int(mask.sum(1).min())}..{int(mask.sum(1).max())}, "
          f"{N} new tokens per row, generate_tokens eager, sampling at temperature 1; best of {args.rounds}")
    print(f"  greedy tokens: LoRA model = merged plain model at all {lora_tokens.numel():,}; "
          f"with the adapters off, {changed:,} of them differ")
    for k, t in best.items():
        print(f"  {k:16s} {rows * N / t:9,.0f} new tokens/s  ({t:.2f} s; fused weight copies {copies[k]:.3f} s "
              f"of it, {kinds[0]})")
    lora_key = f"LoRA r {args.lora}"
    print(f"  LoRA / plain: {best['plain (merged)'] / best[lora_key]:.2f}x (target >= 0.9)")
    n_steps = len(step_ms[lora_key])
    print(f"  decode steps alternating one by one between the two ({n_steps} each, greedy, median ms): "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in step_ms.items())
          + f"; LoRA / plain per step {statistics.median(step_ms['plain (merged)']) / statistics.median(step_ms[lora_key]):.3f}x")


@torch.no_grad()
def interleaved_steps(engines: dict, ids, mask, G: int, steps: int) -> dict[str, list[float]]:
    """Milliseconds of each of `steps` decode steps (`Decoder.step`, greedy) per model of `engines`,
    the models taking turns step by step (the first of a pair alternating), so that a load that
    changes during the run falls on both alike."""
    decoders = {k: make_decoder(m, ids.shape[0] * G, ids.shape[1] + steps) for k, m in engines.items()}
    tokens = {k: d.prefill(ids, mask, repeats=G).argmax(-1) for k, d in decoders.items()}
    out: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(steps):
        for k in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            t0 = time.perf_counter()
            logits = decoders[k].step(tokens[k])
            out[k].append((time.perf_counter() - t0) * 1e3)
            tokens[k] = logits.argmax(-1)
    return out


# ---- PPO's step breakdown ------------------------------------------------------------------------
def ppo_breakdown(cfg, prompts, args) -> None:
    """One PPO generation batch on the rollouts shape (len(prompts) prompts × 4 samples), timed
    phase by phase, best of --rounds: generation, reward-model scoring, the reference forward,
    the policy's old log-probs and values, and the update (forward + backward of the clipped
    policy and value losses, optimizer step) over the whole batch as one mini-batch."""
    from sprout.losses.policy import policy_loss, value_loss
    from sprout.model.heads import PolicyWithValue, RewardModel
    from sprout.stages.ppo import logps_and_values
    from sprout.stages.reward import score_sequences
    from sprout.stages.rl_stage import completion_logps

    torch.manual_seed(1)
    policy, ref, rm = PolicyWithValue(cfg), Transformer(cfg).eval(), RewardModel(cfg).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    ids, mask = pad_prompts(prompts)
    out = generate_tokens(policy.eval(), ids, mask, max_new_tokens=args.new_tokens, num_generations=4,
                          generator=torch.Generator().manual_seed(0))
    batch = {"prompt_ids": out.prompt_ids, "prompt_mask": out.prompt_mask, "completion_ids": out.completion_ids,
             "completion_mask": out.completion_mask}
    full_ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    full_mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
    with torch.no_grad():
        old, old_v, _ = logps_and_values(policy, batch)
    adv, returns = torch.randn_like(old), torch.randn_like(old)

    def update():
        lp, v, _ = logps_and_values(policy.train(), batch)
        vf = value_loss(v, old_v, returns, 0.2)
        loss = policy_loss(lp, old, adv, batch["completion_mask"], epsilon=0.2, per_token_value_loss=vf, vf_coef=0.1)
        (loss.loss_sum / loss.denominator).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def no_grad(fn):
        return lambda: torch.no_grad()(fn)()

    phases = {
        "generation": lambda: generate_tokens(policy.eval(), ids, mask, max_new_tokens=args.new_tokens,
                                              num_generations=4, generator=torch.Generator().manual_seed(0)),
        "reward model": no_grad(lambda: score_sequences(rm, full_ids, full_mask)),
        "reference forward": no_grad(lambda: completion_logps(ref, batch)),
        "old logps + values": no_grad(lambda: logps_and_values(policy.eval(), batch)),
        "value + policy update": update,
    }
    print_breakdown(f"PPO step breakdown: {len(prompts)} prompts x 4 samples, {args.new_tokens} new tokens per row "
                    f"(policy with value head, reference and reward model of the same size; best of {args.rounds})",
                    phases, args.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per engine; the best is reported")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled sprout engine")
    ap.add_argument("--no-ppo", action="store_true", help="skip PPO's step breakdown")
    ap.add_argument("--no-grpo", action="store_true", help="skip GRPO's rollouts and step breakdown")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)} (empty: none)")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="also LoRA rank-R rollouts against the merged plain model at SmolLM2-135M's shape (0: not)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=8, max_seq_len=128 + args.new_tokens)
    model = Transformer(cfg).eval()
    hf = to_transformers(model)
    print(f"model: d_model 256, 6 layers, vocab 4096, {model.num_params():,} params, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"transformers {version('transformers') if hf is not None else 'absent'}, "
          f"load average {os.getloadavg()[0]:.1f}")
    rng = np.random.default_rng(0)
    for name in filter(None, args.cases.split(",")):
        B, G = CASES[name]
        prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in rng.integers(16, 129, size=B)]
        run_case(name, model, hf, prompts, G, args)
    if not args.no_grpo:
        B, G = CASES["rollouts"]
        grpo_prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in rng.integers(16, 129, size=B)]
        grpo_rollouts(model, grpo_prompts, G, args)
        grpo_breakdown(cfg, grpo_prompts, G, args)
    if not args.no_ppo:
        B, _ = CASES["rollouts"]
        ppo_breakdown(cfg, [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in rng.integers(16, 129, size=B)],
                      args)
    if args.lora:
        lora_rollouts(args, rng)


if __name__ == "__main__":
    main()
