"""LoRA against full fine-tuning on the CPU: peak RSS and step time of post-training steps.

Each configuration runs in its own subprocess, so that none shares another's high-water mark,
through sprout's stage code on random weights and tokens, fp32: `Trainer.step` with `SFTStage`,
with `DPOStage` and a live reference, or with `GRPOStage` (rollouts by `GRPOStage.sample`, the
reference's log-probs by `logps_of`, random advantages in place of rewards, then the policy
update: `fill_buffer`'s calls without the reward functions). LoRA: `add_adapters` with r 16,
alpha 32 on every linear layer, the reference the policy with its adapters off (`AdaptersOff`),
as `run_dpo` and `run_grpo` build it; full fine-tuning: a frozen copy of the policy.

Memory is read from /proc/self/status: VmRSS before the first step ("resident": the process,
its weights, adapters and reference), and VmHWM over each phase of a step, reset through
/proc/self/clear_refs before the phase; a phase's working memory is its VmHWM minus the
resident, and a configuration's peak RSS the largest VmHWM it reached, setup included (its
ru_maxrss without the resets). Step time: the median over the steps after --warmup. glibc keeps
freed heap memory resident (its mmap threshold rises as large blocks are freed), so RSS also
holds tensors already freed; --mmap-threshold sets MALLOC_MMAP_THRESHOLD_ in the children (e.g.
131072: every tensor of 128 KiB or more is mapped on its own and returned when freed), so that
RSS follows the live tensors.

Part a: DPO at SmolLM2-135M's shape, full and LoRA, both measured. Part b: a model of over 1e9
parameters in the Llama layout (TinyLlama-1.1B's shape: d_model 2048, 22 layers, 32 heads, 8 KV
heads, SwiGLU hidden 5632, vocab 32000), SFT, DPO and GRPO with LoRA, measured; beside each,
full fine-tuning's estimate: per phase, the LoRA run's resident + 12 bytes per parameter (its
gradient and AdamW's two moments; 8 in phases without gradients, which `Trainer.step` frees after
its optimizer step) + 4 per parameter for the reference copy where the stage has one + the
working memory measured with LoRA; the largest over phases. Part a prints the same estimate
beside its measured full run. Part c (not run by default): GRPO at SmolLM2-135M's shape and the
smollm2 preset's batch (16 prompts x 8 samples of 64 new tokens, micro-batches of 32 completions,
beta 0: no reference phase; the prompt length, 48 tokens by default, is an assumption: the preset
only caps it at 96), full, LoRA, and LoRA with gradient checkpointing, all measured; the same
first rollout shows LoRA starts at the full model, the same gradient norms that checkpointing
changes nothing.

    python benchmarks/lora_memory.py [--parts a,b] [--warmup 1] [--steps 2] [--b-steps 1]
                                     [--gradient-checkpointing] [--mmap-threshold BYTES] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOLLM2 = {"vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "d_ff": 1536,
           "tie_embeddings": True}
LLAMA_1B = {"vocab_size": 32000, "d_model": 2048, "n_layers": 22, "n_heads": 32, "n_kv_heads": 8, "d_ff": 5632,
            "tie_embeddings": False}  # TinyLlama-1.1B's shape
TINY = {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128,
        "tie_embeddings": False}  # --tiny: a smoke run of the same code
SHAPES = {"smollm2": SMOLLM2, "1b": LLAMA_1B, "tiny": TINY}
GIB = 2**30
HAS_GRADIENTS = {"step": True, "rollout": False, "reference log-probs": False, "update": True}


# ---- the child: one configuration ---------------------------------------------------------------
def proc_status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def reset_peak() -> None:
    """Start VmHWM again from the current VmRSS (Linux's clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def child(spec: dict) -> dict:
    import copy
    import gc
    import hashlib
    from importlib.metadata import version
    from types import SimpleNamespace

    import numpy as np
    import torch

    sys.path.insert(0, str(HERE))
    from preference_throughput import pair_batch
    from rl_throughput import NoStopTokenizer

    from sprout.engine.configs import LoraConfig
    from sprout.engine.optim import OptimConfig, build_optimizer
    from sprout.engine.trainer import TrainConfig, Trainer, make_accelerator
    from sprout.model.lora import AdaptersOff, add_adapters
    from sprout.model.transformer import ModelConfig, Transformer

    start_kib = proc_status_kib("VmRSS")
    checks: dict = {}  # what shows two configurations computed the same thing (part c)
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[spec["shape"]], max_seq_len=spec["seq"])
    policy = Transformer(cfg)
    params = policy.num_params()
    stage_name = spec["stage"]
    needs_ref = stage_name == "dpo" or (stage_name == "grpo" and spec.get("beta", 0.04) > 0)
    ref = None
    if spec["lora"]:
        add_adapters(policy, LoraConfig(r=spec["lora"], alpha=2.0 * spec["lora"]), seed=0)
        ref = AdaptersOff(policy) if needs_ref else None
    elif needs_ref:
        ref = copy.deepcopy(policy)  # the frozen copy of the policy's start
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    tcfg = TrainConfig(max_steps=10**6, progress=False, peak_tflops=-1,
                       gradient_checkpointing=spec["gradient_checkpointing"])
    acc = make_accelerator(tcfg)
    trainer = Trainer(acc, policy, build_optimizer(policy, OptimConfig(lr=1e-5)), lambda step, peak: peak, tcfg)
    steps = spec["warmup"] + spec["steps"]
    rows, seq = spec["rows"], spec["seq"]
    if stage_name in ("sft", "dpo"):
        from sprout.stages.dpo import DPOLossConfig, DPOStage
        from sprout.stages.sft import SFTStage

        batches = [pair_batch(rows // 2, seq, cfg.vocab_size, i) for i in range(steps)]
        if stage_name == "sft":  # the same rows as SFT rows: the loss on their second halves
            stage = SFTStage(acc, None, None, 1)
            batches = [{k: b[k] for k in ("input_ids", "targets", "loss_mask", "segment_ids", "position_ids")}
                       for b in batches]
        else:
            stage = DPOStage(acc, SimpleNamespace(batch_size=rows // 2), None, 1, DPOLossConfig(), ref_model=ref)
            stage.setup(trainer)

        def phases(i):
            return {"step": lambda: trainer.step([batches[i]], stage)}
    else:
        from sprout.stages.configs import PromptBatchConfig, RolloutConfig
        from sprout.stages.grpo import GRPOLossConfig, GRPOStage

        B, G = spec["prompts"], rows // spec["prompts"]
        new_tokens = seq - spec["prompt_length"]
        batch = PromptBatchConfig(global_prompts=B, num_generations=G,
                                  micro_completions=spec.get("micro_completions") or B * G)
        stage = GRPOStage(acc, NoStopTokenizer(cfg.vocab_size), SimpleNamespace(per_rank=B), None, batch,
                          RolloutConfig(max_completion_length=new_tokens), [],
                          grpo=GRPOLossConfig(beta=spec.get("beta", 0.04)),
                          ref_model=ref, seed=0)
        stage.setup(trainer)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, cfg.vocab_size, size=spec["prompt_length"]).tolist() for _ in range(B)]
        held: dict = {}

        def rollout():
            held["rollout"] = stage.sample(np.arange(B), ids=prompts)
            checks.setdefault("first_rollout_sha256", hashlib.sha256(
                held["rollout"]["completion_ids"].numpy().tobytes()).hexdigest())

        def reference():
            held["rollout"]["ref_logps"] = stage.logps_of(stage.ref_model, held["rollout"])

        def update():
            r = held.pop("rollout")
            r.pop("lengths")
            n = r["completion_ids"].shape[0]
            r["advantages"] = torch.randn(n, generator=torch.Generator().manual_seed(0))
            r["extra_target"] = torch.zeros(n, dtype=torch.long)
            stage.buffer = {"stats": torch.zeros(0, 2), "stat_names": []}
            return trainer.step(stage.micro_batches(r, n), stage)

        def phases(i):
            return {"rollout": rollout, **({"reference log-probs": reference} if ref is not None else {}),
                    "update": update}

    gc.collect()
    resident_kib, setup_peak_kib = proc_status_kib("VmRSS"), proc_status_kib("VmHWM")
    phase_peak: dict[str, int] = {}
    step_times, losses, grad_norms, phase_times = [], [], [], {}
    for i in range(steps):
        t_step = 0.0
        for name, fn in phases(i).items():
            reset_peak()
            t0 = time.perf_counter()
            out = fn()
            phase_times.setdefault(name, []).append(time.perf_counter() - t0)
            t_step += phase_times[name][-1]
            phase_peak[name] = max(phase_peak.get(name, 0), proc_status_kib("VmHWM"))
            if isinstance(out, dict) and "loss" in out:
                losses.append(float(out["loss"]))
                grad_norms.append(float(out["grad_norm"]))
        if i >= spec["warmup"]:
            step_times.append(t_step)
    return {**spec, "params": params, "trained": trained, "start_kib": start_kib, "resident_kib": resident_kib,
            "peak_kib": max(setup_peak_kib, *phase_peak.values()), "phase_peak_kib": phase_peak,
            "step_s": statistics.median(step_times), "step_times": step_times, "phase_times": phase_times,
            "losses": losses, "grad_norms": grad_norms, **checks,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "peft": version("peft")}


# ---- the parent: run, estimate, print -----------------------------------------------------------
def run_child(spec: dict, mmap_threshold: int = 0) -> dict:
    env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {})}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        sys.exit(f"{spec['name']}: child failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def full_estimate(lora_run: dict) -> tuple[float, str]:
    """(bytes, phase): full fine-tuning's peak estimated from a LoRA run (see the module doc)."""
    n, ref = lora_run["params"], lora_run["stage"] in ("dpo", "grpo")
    best = (0.0, "")
    for phase, peak in lora_run["phase_peak_kib"].items():
        working = (peak - lora_run["resident_kib"]) * 1024
        total = lora_run["resident_kib"] * 1024 + (12 if HAS_GRADIENTS[phase] else 8) * n + (4 * n if ref else 0) \
            + working
        best = max(best, (total, phase))
    return best


def gib(x_bytes: float) -> str:
    return f"{x_bytes / GIB:.2f}"


def part_a(args) -> None:
    shape = "tiny" if args.tiny else "smollm2"
    base = {"stage": "dpo", "shape": shape, "seq": args.a_seq, "rows": 2 * args.a_pairs, "warmup": args.warmup,
            "steps": args.steps, "gradient_checkpointing": args.gradient_checkpointing}
    full = run_child({**base, "name": "full", "lora": 0}, args.mmap_threshold)
    lora = run_child({**base, "name": f"LoRA r {args.r}", "lora": args.r}, args.mmap_threshold)
    print(f"\n## a. DPO with a live reference at {'a tiny' if args.tiny else 'SmolLM2-135M'}'s shape "
          f"({full['params']:,} params, random weights)\n")
    print(f"{args.a_pairs} pairs = {2 * args.a_pairs} rows of {args.a_seq} tokens per step; DPOStage + Trainer.step, "
          f"AdamW, fp32, {full['threads']} threads, torch {full['torch']}, peft {full['peft']}; step time the median "
          f"of {args.steps} steps after {args.warmup} untimed; the two children ran one after the other.\n")
    print("| DPO | reference | trained params | resident GiB | peak RSS GiB | step s | losses |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r, how in ((full, "frozen copy"), (lora, "policy, adapters off")):
        print(f"| {r['name']} | {how} | {r['trained']:,} | {gib(r['resident_kib'] * 1024)} | "
              f"{gib(r['peak_kib'] * 1024)} | {r['step_s']:.2f} | {', '.join(f'{x:.4f}' for x in r['losses'])} |")
    print(f"| LoRA / full | | | {lora['resident_kib'] / full['resident_kib']:.2f}x | "
          f"{lora['peak_kib'] / full['peak_kib']:.2f}x | {lora['step_s'] / full['step_s']:.2f}x | |")
    est, phase = full_estimate(lora)
    print(f"\nfull fine-tuning estimated from the LoRA run (as part b estimates it): {gib(est)} GiB "
          f"(measured: {gib(full['peak_kib'] * 1024)} GiB)")


def part_b(args) -> None:
    shape = "tiny" if args.tiny else "1b"
    rows, seq = args.b_rows, args.b_seq
    base = {"shape": shape, "seq": seq, "rows": rows, "lora": args.r, "warmup": 0, "steps": args.b_steps,
            "gradient_checkpointing": args.gradient_checkpointing, "prompts": args.b_prompts,
            "prompt_length": args.b_prompt_length}
    runs = [run_child({**base, "stage": s, "name": s}, args.mmap_threshold) for s in ("sft", "dpo", "grpo")]
    n = runs[0]["params"]
    if not args.tiny and n < 1e9:
        sys.exit(f"part b: the model has {n:,} parameters, fewer than 1e9")
    c = SHAPES[shape]
    print(f"\n## b. {'A tiny model' if args.tiny else 'A 1.1B model'} with LoRA r {args.r}: "
          f"{n:,} parameters ({n:.3e})\n")
    print(f"Llama layout: d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads "
          f"({c['n_kv_heads']} KV), SwiGLU hidden {c['d_ff']}, vocab {c['vocab_size']}, untied lm_head; random "
          f"weights, fp32, AdamW, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; "
          f"{runs[0]['trained']:,} adapter params trained; {args.b_steps} step(s) each, the step time the "
          f"median; {runs[0]['threads']} threads.\n")
    print("SFT: SFTStage, {r} rows of {s} tokens. DPO: DPOStage, {p} pairs = {r} rows of {s} tokens, the reference "
          "the policy with its adapters off. GRPO: {b} prompts of {pl} tokens x {g} samples of {nt} new tokens "
          "(rollout, reference log-probs, update; beta 0.04).\n".format(
              r=rows, s=seq, p=rows // 2, b=args.b_prompts, pl=args.b_prompt_length, g=rows // args.b_prompts,
              nt=seq - args.b_prompt_length))
    print("| stage | step s | LoRA resident GiB | LoRA peak RSS GiB | full FT: weights, grads, AdamW (+ reference) GiB "
          "| full FT estimate GiB | its largest phase | fits in 24 GiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in runs:
        est, phase = full_estimate(r)
        states = (20 if r["stage"] in ("dpo", "grpo") else 16) * n
        print(f"| {r['stage'].upper()} | {r['step_s']:.1f} | {gib(r['resident_kib'] * 1024)} | "
              f"{gib(r['peak_kib'] * 1024)} | {gib(states)} | {gib(est)} | {phase} | "
              f"{'yes' if est <= 24 * GIB else 'no'} |")
    print("\nworking memory above the resident, GiB, per phase (LoRA, measured):")
    for r in runs:
        print(f"  {r['stage'].upper()}: " + ", ".join(f"{k} {gib((v - r['resident_kib']) * 1024)}"
                                                     for k, v in r["phase_peak_kib"].items())
              + f"; step times {', '.join(f'{t:.1f}' for t in r['step_times'])} s; losses "
              + ", ".join(f"{x:.4f}" for x in r["losses"]))
    print(f"\nfull FT estimate = LoRA resident + 12 B/param ({gib(12 * n)} GiB; 8 B/param, {gib(8 * n)} GiB, in the "
          f"rollout and reference phases) + 4 B/param for the reference copy ({gib(4 * n)} GiB, DPO and GRPO) + "
          f"the phase's working memory measured with LoRA")


def part_c(args) -> None:
    shape = "tiny" if args.tiny else "smollm2"
    base = {"stage": "grpo", "shape": shape, "seq": args.c_prompt_length + args.c_new_tokens,
            "rows": args.c_prompts * args.c_generations,
            "prompts": args.c_prompts, "prompt_length": args.c_prompt_length, "micro_completions": args.c_micro,
            "beta": 0.0, "warmup": args.warmup, "steps": args.steps}
    runs = [run_child({**base, "name": "full", "lora": 0, "gradient_checkpointing": False}, args.mmap_threshold),
            run_child({**base, "name": f"LoRA r {args.r}", "lora": args.r, "gradient_checkpointing": False},
                      args.mmap_threshold),
            run_child({**base, "name": f"LoRA r {args.r}, gradient checkpointing", "lora": args.r,
                       "gradient_checkpointing": True}, args.mmap_threshold)]
    full = runs[0]
    print(f"\n## c. GRPO at {'a tiny model' if args.tiny else 'SmolLM2-135M'}'s shape and the smollm2 preset's batch "
          f"({full['params']:,} params, random weights)\n")
    print(f"{args.c_prompts} prompts of {args.c_prompt_length} tokens x {args.c_generations} samples of {args.c_new_tokens} new tokens, "
          f"micro-batches of {args.c_micro} completions, beta 0 (no reference phase); GRPOStage + Trainer.step, AdamW, "
          f"fp32, {full['threads']} threads, torch {full['torch']}, peft {full['peft']}; step time the median of "
          f"{args.steps} steps after {args.warmup} untimed (rollout + update); the children ran one after the other.\n")
    print("| GRPO | trained params | resident GiB | peak RSS GiB | step s | rollout s | update s | x full step | "
          "x full peak RSS |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        ph = {k: statistics.median(v[args.warmup:]) for k, v in r["phase_times"].items()}
        print(f"| {r['name']} | {r['trained']:,} | {gib(r['resident_kib'] * 1024)} | {gib(r['peak_kib'] * 1024)} | "
              f"{r['step_s']:.2f} | {ph['rollout']:.2f} | {ph['update']:.2f} | {r['step_s'] / full['step_s']:.2f}x | "
              f"{r['peak_kib'] / full['peak_kib']:.2f}x |")
    print("\nfirst rollout's tokens (sha256) and gradient norms per step (the losses are -mean(advantages), "
          "random, alike in every run):")
    for r in runs:
        print(f"  {r['name']}: {r['first_rollout_sha256'][:16]}; " + ", ".join(f"{x:.6g}" for x in r["grad_norms"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b", help="comma-separated, of: a, b, c")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (alpha 2r)")
    p.add_argument("--a-seq", type=int, default=256, help="part a: tokens per row")
    p.add_argument("--a-pairs", type=int, default=4, help="part a: pairs per step")
    p.add_argument("--warmup", type=int, default=1, help="parts a and c: untimed steps")
    p.add_argument("--steps", type=int, default=2, help="parts a and c: timed steps")
    p.add_argument("--b-seq", type=int, default=128, help="part b: tokens per row (GRPO: prompt + new tokens)")
    p.add_argument("--b-rows", type=int, default=4, help="part b: rows per step (DPO: 2 per pair; GRPO: completions)")
    p.add_argument("--b-prompts", type=int, default=2, help="part b: GRPO prompts (rows / prompts samples each)")
    p.add_argument("--b-prompt-length", type=int, default=64, help="part b: GRPO prompt tokens")
    p.add_argument("--b-steps", type=int, default=1, help="part b: steps per stage (all timed)")
    p.add_argument("--c-prompts", type=int, default=16, help="part c: GRPO prompts")
    p.add_argument("--c-generations", type=int, default=8, help="part c: samples per prompt")
    p.add_argument("--c-prompt-length", type=int, default=48, help="part c: GRPO prompt tokens")
    p.add_argument("--c-new-tokens", type=int, default=64, help="part c: new tokens per sample")
    p.add_argument("--c-micro", type=int, default=32, help="part c: completions per micro-batch")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="train.gradient_checkpointing in every run of parts a and b (part c runs both ways)")
    p.add_argument("--mmap-threshold", type=int, default=0, metavar="BYTES",
                   help="MALLOC_MMAP_THRESHOLD_ of the children (0: glibc's default, a threshold that rises)")
    p.add_argument("--tiny", action="store_true", help="a tiny model in every part (a smoke run of the code)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("lora_memory.py reads peak RSS per phase through /proc/self/clear_refs: Linux only")
    mem = proc_status_kib("VmRSS")  # the parent's own, for the record
    total = int(re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1))
    malloc = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "glibc's default malloc"
    print(f"# LoRA against full fine-tuning: peak RSS and step time (MemTotal {total / 2**20:.2f} GiB; "
          f"parent RSS {mem / 2**20:.2f} GiB; children on {malloc})")
    parts = args.parts.split(",")
    if "a" in parts:
        part_a(args)
    if "b" in parts:
        part_b(args)
    if "c" in parts:
        part_c(args)


if __name__ == "__main__":
    main()
