"""benchmarks/gpu_check.py's `decode` stage: greedy decoding eager against the decode step replayed
as a CUDA graph (`sprout.model.static_decode`), on random models of an imported model's shape.

For SmolLM2-135M's shape, and the same with Qwen2's q/k/v biases, in fp32: the graph's logits
fed the eager path's tokens must equal the eager ones to 1e-4 of their scale, with the same
argmax wherever the eager top two are further apart than the largest difference, and
`generate_tokens` must give the same greedy tokens with `cuda_graph` on and off. In both precisions
two graph calls sharing one set of fused weights (`DecodeWeightsCache`, as GRPO's rounds and an
evaluation's batches share it) must give the tokens of a call that builds its own. Then the
tokens/s of both, side by side, in fp32 and under bf16 autocast (as the trainers decode; its
greedy tokens' agreement is reported, not required: bf16 rounds sums of different lengths
apart). Writes --out (JSON) and exits 1 naming what differed. `--device cpu` runs the same in
fp32 on a tiny model, the static step run eagerly (the tests' path; its timings mean nothing).

    python benchmarks/gpu_check_decode.py --out runs/gpu_check/decode.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from sprout.atomic import atomic_write  # noqa: E402
from sprout.model.decode import DecodeWeightsCache, Decoder  # noqa: E402
from sprout.model.generate import generate_tokens  # noqa: E402
from sprout.model.static_decode import StaticDecoder  # noqa: E402
from sprout.model.transformer import ModelConfig, Transformer  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
                    tie_embeddings=True, rope_theta=100000.0, max_seq_len=2048)
SHAPES = {"smollm2_135m": SMOLLM2_135M, "smollm2_135m_qkv_bias": SMOLLM2_135M | {"attention_bias": True}}
TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128, attention_bias=True)
INIT_STD = 0.1  # random weights this wide give peaked logits: few near-ties for greedy decoding to break apart


class DecodeMismatch(Exception):
    """The graph's decoding differs from the eager one; the message says where."""


def random_model(shape: dict, device) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**shape, init_std=INIT_STD)).to(device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, INIT_STD)
    return model


def random_prompts(vocab: int, prompts: int, longest: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts [B, longest] of lengths from longest / 4 to longest, with their mask."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.linspace(longest // 4, longest, prompts).long()
    ids = torch.randint(1, vocab, (prompts, longest), generator=g)
    mask = (torch.arange(longest)[None, :] >= longest - lengths[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


@torch.no_grad()
def teacher_forced(model, ids, mask, G: int, steps: int, graph: bool) -> dict:
    """The static step's logits against `Decoder`'s, both fed the eager argmax each step: the largest
    difference (relative to the logits' scale) and the steps whose argmax differs although the eager
    top two are further apart than that difference."""
    rows, S = ids.shape[0] * G, ids.shape[1] + steps
    eager, static = Decoder(model, rows, S), StaticDecoder(model, rows, S, graph=graph)
    a, b = eager.prefill(ids, mask, repeats=G), static.prefill(ids, mask, repeats=G)
    worst, flips = 0.0, 0
    for _ in range(steps):
        diff = float((a - b).abs().max())
        worst = max(worst, diff / float(a.abs().max()))
        top2 = a.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        flips += int((clear & (a.argmax(-1) != b.argmax(-1))).sum())
        token = a.argmax(-1)
        a, b = eager.step(token), static.step(token).clone()
    return {"max_rel_diff": worst, "clear_argmax_flips": flips}


def timed_greedy(model, ids, mask, G: int, steps: int, cuda_graph: bool, sync,
                 weight_cache: DecodeWeightsCache | None = None) -> tuple[torch.Tensor, float]:
    """(completion ids, seconds) of one greedy `generate_tokens` call, no stop ids: every row runs all steps."""
    sync()
    t0 = time.perf_counter()
    out = generate_tokens(model, ids, mask, max_new_tokens=steps, num_generations=G, greedy=True, stop_ids=(),
                          cuda_graph=cuda_graph, weight_cache=weight_cache)
    sync()
    return out.completion_ids, time.perf_counter() - t0


def check_shape(name: str, shape: dict, device, prompts: int, longest: int, G: int, steps: int) -> dict:
    """One model's figures (see the module doc); DecodeMismatch where fp32 decoding differs."""
    model = random_model(shape, device)
    ids, mask = random_prompts(shape["vocab_size"], prompts, longest, device)
    graph = device.type == "cuda"
    sync = torch.cuda.synchronize if graph else (lambda: None)
    forced = teacher_forced(model, ids, mask, G, steps, graph)
    figures = {"rows": prompts * G, "steps": steps, **forced}
    if forced["max_rel_diff"] > 1e-4 or forced["clear_argmax_flips"]:
        raise DecodeMismatch(f"{name}: graph logits differ from eager: {forced}")
    for precision in ("fp32", "bf16") if graph else ("fp32",):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
        with autocast:
            eager, eager_s = timed_greedy(model, ids, mask, G, steps, False, sync)  # the first call: warm-up
            eager, eager_s = timed_greedy(model, ids, mask, G, steps, False, sync)
            # every call captures its own graph; the first also meets the one-time set-up
            static, first_s = timed_greedy(model, ids, mask, G, steps, True, sync)
            static, static_s = timed_greedy(model, ids, mask, G, steps, True, sync)
            shared_set = DecodeWeightsCache()  # the second call captures its graph on the first call's weights
            shared = [timed_greedy(model, ids, mask, G, steps, True, sync, shared_set)[0] for _ in range(2)]
        tokens = prompts * G * steps
        figures[precision] = {"eager_tokens_per_s": tokens / eager_s, "graph_tokens_per_s": tokens / static_s,
                              "speedup": eager_s / static_s, "graph_first_call_s": first_s,
                              "greedy_equal": bool(torch.equal(eager, static)),
                              "token_agreement": float((eager == static).float().mean()),
                              "shared_weights_equal": all(torch.equal(s, static) for s in shared)}
        if precision == "fp32" and not figures["fp32"]["greedy_equal"]:
            raise DecodeMismatch(f"{name}: fp32 greedy tokens differ ({figures['fp32']['token_agreement']:.4f} "
                                 f"of them agree)")
        if not figures[precision]["shared_weights_equal"]:
            raise DecodeMismatch(f"{name}: {precision} greedy tokens on a shared set of fused weights differ from "
                                 f"those on a set built for the call")
    return figures


def run(device, out: Path, prompts: int, longest: int, G: int, steps: int, shapes: dict) -> dict:
    """Every shape's figures, written to `out` after each; the failures under "failed"."""
    results = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "failed": {}}
    for name, shape in shapes.items():
        try:
            results[name] = check_shape(name, shape, device, prompts, longest, G, steps)
        except DecodeMismatch as exc:
            results["failed"][name] = str(exc)
        with atomic_write(out, "w") as f:
            f.write(json.dumps(results, indent=2) + "\n")
        print(f"{name}: {json.dumps(results.get(name, results['failed'].get(name)))}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON to write")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the tiny model, the static step run eagerly (no graph, no timing)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per call")
    p.add_argument("--num-generations", type=int, default=8, help="rows per prompt")
    p.add_argument("--prompt-length", type=int, default=64, help="the longest prompt's tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy steps per call")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA here (--device cpu runs the comparison without a graph)")
    shapes = SHAPES if args.device == "cuda" else {"tiny": TINY}
    results = run(torch.device(args.device), Path(args.out), args.prompts, args.prompt_length, args.num_generations,
                  args.new_tokens, shapes)
    if results["failed"]:
        raise SystemExit(f"decode: {'; '.join(results['failed'].values())}")


if __name__ == "__main__":
    main()
