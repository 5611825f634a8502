"""One short, prepared GPU check of every training path, for a machine with a GPU.

Every stage runs as its real CLI (bf16 on a GPU) on inputs this script makes itself
(benchmarks/gpu_check_inputs.py), so nothing is downloaded: the matmul peak (the MFU
denominator); gpt2-small pretraining eager, compiled and under FSDP with a resume that must give
the same losses; then a base, SFT, reward, DPO (live and precomputed reference), PPO, GRPO and
evaluate.py with the gpt2-small presets' configs, and the same chain (smollm2_*) with
smollm2-gpu's, each a few steps; then benchmarks/trl_compare.py on SmolLM2-135M-Instruct imported
from the data mirror (`trl_compare`: benchmarks/gpu_check_trl.py). `--tiny` runs the same on the
CPU in fp32 with the demo-size model, to check the script itself. Prints one table, writes
<out>/gpu_check.json after every stage with each run's log beside it, and exits 1 naming every
stage that failed, logged a non-finite loss, (fsdp) did not shard or resume exactly, or
(trl_compare) gave a first-batch check beyond its tolerance.

    python benchmarks/gpu_check.py --out runs/gpu_check            # on a GPU machine
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_check     # dry run on CPU, a few minutes

As two shorter commands, each with its own --out:
`--stages eager,compiled,fsdp,dpo,dpo_precomputed,ppo,evaluate` and
`--stages smollm2_dpo,smollm2_ppo,smollm2_grpo,decode,trl_compare`. The `decode` stage
(benchmarks/gpu_check_decode.py) decodes greedily eager and as a CUDA graph on random models
of SmolLM2-135M's shape: the same tokens, and tokens/s both ways (on the CPU: no graph).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
import gpu_check_inputs as inputs  # noqa: E402  (beside this file)
import gpu_check_trl  # noqa: E402
from sprout.atomic import atomic_write  # noqa: E402
from sprout.engine.metrics import measure_matmul_flops, read_metrics  # noqa: E402

STAGES = ("eager", "compiled", "fsdp", "base", "sft", "reward", "dpo", "dpo_precomputed", "ppo", "grpo", "evaluate",
          "smollm2_base", "smollm2_sft", "smollm2_reward", "smollm2_dpo", "smollm2_ppo", "smollm2_grpo", "decode",
          "trl_compare")
# the run each post-training run starts from (ppo: sft, and the reward model)
CHAIN_NEEDS = {"sft": "base", "reward": "sft", "dpo": "sft", "dpo_precomputed": "sft", "ppo": "reward", "grpo": "sft",
               "evaluate": "grpo"}


@dataclass(frozen=True)
class Chain:
    """The post-training runs of one GPU preset: `<prefix>base`, then `<prefix>sft`, ... from
    the preset's configs/<preset>/{sft,reward,dpo,ppo,grpo}.yaml."""
    preset: str
    prefix: str
    compile_rollouts: bool  # on a GPU PPO and GRPO keep their configs' rollout.compile (else eager decoding)


CHAINS = (Chain("gpt2-small", "", compile_rollouts=True), Chain("smollm2-gpu", "smollm2_", compile_rollouts=False))
NEEDS = {c.prefix + stage: c.prefix + need for c in CHAINS for stage, need in CHAIN_NEEDS.items()
         if c.prefix + stage in STAGES}
PRETRAINING = ("eager", "compiled", "fsdp")  # on random token shards; the other stages need the made-up inputs
# the check as two commands (each with its own --out) where one command may run 10 minutes at most
TWO_COMMANDS = ("eager,compiled,fsdp,dpo,dpo_precomputed,ppo,evaluate",
                "smollm2_dpo,smollm2_ppo,smollm2_grpo,decode,trl_compare")


def with_needs(stages) -> list[str]:
    """`stages` and every run they start from (NEEDS, transitively), in STAGES order:
    `--stages smollm2_ppo` runs smollm2_base, smollm2_sft, smollm2_reward and smollm2_ppo."""
    if not stages:
        raise ValueError("no stage named")
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; the stages are {', '.join(STAGES)}")
    wanted = set(stages)
    for stage in stages:
        while stage in NEEDS:
            stage = NEEDS[stage]
            wanted.add(stage)
    return [s for s in STAGES if s in wanted]


SMOLLM2_135M = ("--model.d_model", "576", "--model.n_layers", "30", "--model.n_heads", "9", "--model.n_kv_heads", "3",
                "--model.d_ff", "1536", "--model.tie_embeddings", "true", "--model.rope_theta", "100000",
                "--model.max_seq_len", "2048")  # SmolLM2-135M's shape (its vocabulary aside)


@dataclass
class Sizes:
    """How big each run is: the GPU check's, or the CPU dry run's (`--tiny`). A post-training
    size of 0 keeps the preset config's own."""
    pretrain_config: str
    vocab: int              # of the random shards
    model_vocab: int        # the pretraining model's (the vocab padded for matmuls)
    seq: int                # sequence length of pretraining and SFT rows
    micro: int              # pretraining tokens per micro-batch (base: per step)
    micro_steps: int        # pretraining micro-batches per step (on each GPU; on the CPU in all)
    steps: int              # pretraining steps
    trainer_steps: int      # steps of each base and of each post-training run
    shapes: dict            # preset -> the flags that give its base model's shape (on size.pretrain_config)
    sft_problems: int       # arithmetic problems packed into SFT rows
    pairs: int              # preference pairs (about a tenth held out)
    prompts: int            # RL train prompts (a tenth as many held out)
    eval_prompts: int       # held-out prompts per RL eval (greedy) and for evaluate.py
    new_tokens: int         # evaluate.py's max new tokens
    compile_rollouts: bool  # whether any run may compile its decode step (a chain's compile_rollouts)
    sft_rows: int = 0       # SFT rows per step ...
    sft_micro_rows: int = 0  # ... and per micro-batch
    global_pairs: int = 0
    micro_pairs: int = 0
    ppo_prompts: int = 0    # prompts per PPO generation batch (2 completions each, one optimizer step)
    grpo_prompts: int = 0   # prompts per GRPO generation batch ...
    group: int = 0          # ... and completions per prompt
    prompt_length: int = 0  # RL data.max_prompt_length ...
    completion: int = 0     # ... and rollout.max_completion_length


# On a GPU every post-training run keeps its preset's batch and lengths; the inputs are sized for
# a few of its steps (gpt2-small's SFT takes 128 rows of 1,024 tokens a step).
GPU = Sizes(pretrain_config="configs/gpt2-small/pretrain.yaml", vocab=50257, model_vocab=50304, seq=1024,
            micro=32768, micro_steps=4, steps=20, trainer_steps=4,
            shapes={"gpt2-small": (), "smollm2-gpu": SMOLLM2_135M}, sft_problems=8000, pairs=1000, prompts=400,
            eval_prompts=32, new_tokens=128, compile_rollouts=True)
# The demo-size model (d_model 128, 4 layers, context 256); the smollm2-gpu chain's base with
# SmolLM2's kind of attention and head (grouped-query, tied embeddings).
TINY = Sizes(pretrain_config="configs/demo/pretrain.yaml", vocab=4096, model_vocab=4096, seq=256,
             micro=4096, micro_steps=2, steps=6, trainer_steps=3,
             shapes={"gpt2-small": (), "smollm2-gpu": ("--model.n_kv_heads", "2", "--model.tie_embeddings", "true")},
             sft_problems=400, pairs=120, prompts=60, eval_prompts=4, new_tokens=16, compile_rollouts=False,
             sft_rows=8, sft_micro_rows=4, global_pairs=8, micro_pairs=4, ppo_prompts=4, grpo_prompts=2, group=4,
             prompt_length=64, completion=16)


def sized(*flags: tuple[str, int]) -> list[str]:
    """The (option, size) pairs whose size is set (not 0), as command-line flags."""
    return [arg for option, size in flags if size for arg in (option, str(size))]


class StageFailed(Exception):
    """A stage that did not give what it must; the message names the stage."""


def train_figures(stage: str, run_dir: Path) -> dict:
    """The figures of a run's last training record (generation tokens/s: of the last record
    that has them, since a PPO generation batch can serve several optimizer steps); StageFailed
    if it has none, or if any record holds a non-finite loss (training or eval)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    for r in records:
        for k, v in r.items():
            if "loss" in k and isinstance(v, float) and not math.isfinite(v):
                raise StageFailed(f"{stage}: {k} {v} at step {r.get('step')} ({run_dir / 'metrics.jsonl'})")
    train = [r for r in records if "loss" in r and "tokens_per_s" in r]
    if not train:
        raise StageFailed(f"{stage}: no training record in {run_dir / 'metrics.jsonl'}")
    last = train[-1]
    generation = [r["generation/tokens_per_s"] for r in train if "generation/tokens_per_s" in r]
    return {"tokens_per_s": last["tokens_per_s"], "mfu": last.get("mfu"), "loss": last["loss"],
            "generation_tokens_per_s": generation[-1] if generation else None}


class Check:
    """The runs of one check: where they go, how they are launched, what each gave."""

    def __init__(self, out: Path, env: dict, results: dict, stages=STAGES):
        self.out, self.env, self.results, self.stages = out, env, results, tuple(stages)
        self.failed: dict[str, str] = results.setdefault("failed", {})

    def run(self, stage: str, cmd: list[str], log_name: str | None = None) -> float:
        """Run one command, its output in <out>/<stage>.log (the end printed); returns its wall time."""
        log = self.out / f"{log_name or stage}.log"
        print(f"\n== {stage}: {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        status = self.execute(cmd, log)
        text = log.read_text()
        print(text[-3000:] if status else text[-600:], flush=True)
        if status:
            raise StageFailed(f"{stage}: exit status {status} (log: {log})")
        return time.perf_counter() - t0

    def execute(self, cmd: list[str], log: Path) -> int:
        """Run `cmd` in its own process from the repository root, its stdout and stderr in `log`; its exit status."""
        with open(log, "w") as f:
            return subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT, text=True).returncode

    def train(self, stage: str, cmd: list[str]) -> dict:
        """Run a training command whose --out is <out>/<stage>; its figures and wall time."""
        wall = self.run(stage, cmd + ["--out", str(self.out / stage), "--overwrite"])
        return {**train_figures(stage, self.out / stage), "wall_s": wall}

    def stage(self, name: str, body) -> None:
        """Record `body()` (the stage's figures) as stage `name`, or its failure; not run when
        the stage it starts from failed, nor when it is not among this check's stages."""
        if name not in self.stages:
            return
        need = NEEDS.get(name)
        if need and need not in self.results:
            self.failed[name] = f"{name}: not run ({need} failed)"
            print(f"\n== {name}: not run, {need} failed", flush=True)
        else:
            try:
                self.results[name] = body()
            except StageFailed as exc:
                self.failed[name] = str(exc)
                print(f"\n== FAILED {exc}", flush=True)
        self.save()

    def save(self) -> None:
        """Write the figures so far to <out>/gpu_check.json (atomically): a check stopped part-way
        (a time limit) keeps those of the stages it finished."""
        with atomic_write(self.out / "gpu_check.json", "w") as f:
            f.write(json.dumps(self.results, indent=2) + "\n")


def pretraining(check: Check, size: Sizes, steps: int, global_batch: int, n_gpu: int, fsdp_config: Path,
                train_flags: list[str]) -> None:
    """eager, compiled and fsdp: the pretraining model at its real shape on random token shards."""
    if not set(PRETRAINING) & set(check.stages):
        return
    out = check.out
    data = inputs.random_shards(out / "data", size.vocab, global_batch * (steps + 2) + size.seq + 1, 8 * size.seq + 1)
    common = [sys.executable, "scripts/pretrain.py", "--config", size.pretrain_config, "--data", str(data),
              "--data.seq_len", str(size.seq), "--data.seq_warmup_frac", "0", "--data.eval_tokens", str(4 * size.seq),
              "--batch.global_tokens", str(global_batch), "--batch.micro_tokens", str(size.micro),
              "--train.max_steps", str(steps), "--optim.warmup_steps", "2", "--train.log_every", str(max(1, steps // 4)),
              "--train.eval_every", "0", "--model.vocab_size", str(size.model_vocab)] + train_flags
    check.stage("eager", lambda: check.train("eager", common + ["--train.compile", "false"]))
    check.stage("compiled", lambda: check.train("compiled", common + ["--train.compile", "true"]))

    def fsdp() -> dict:
        """An uninterrupted run, then one resumed from its half-way checkpoint: the same losses after it."""
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(fsdp_config),
                  "--num_processes", str(n_gpu), "--main_process_port", "29563"]
        fsdp_common = launch + common[1:] + ["--train.ckpt_every", str(steps // 2), "--train.compile", "false"]
        full, part = out / "fsdp_full", out / "fsdp_resumed"
        wall = check.run("fsdp", fsdp_common + ["--out", str(full), "--overwrite"])
        mid = full / "checkpoints" / f"step_{steps // 2:08d}"  # the state of a run stopped half-way
        check.run("fsdp resume", fsdp_common + ["--out", str(part), "--resume", str(mid)], "fsdp_resume")
        a = {r["step"]: r["loss"] for r in read_metrics(full / "metrics.jsonl") if "loss" in r}
        b = {r["step"]: r["loss"] for r in read_metrics(part / "metrics.jsonl") if "loss" in r}
        diff = max(abs(a[s] - b.get(s, math.inf)) for s in a if s > steps // 2)
        sharded = "FSDP: parameters sharded" in (out / "fsdp.log").read_text()
        figures = {**train_figures("fsdp", full), "wall_s": wall, "sharded": sharded, "resume_max_abs_diff": diff}
        print(f"fsdp: sharded={sharded}, resumed vs uninterrupted losses after step {steps // 2}: max |diff| {diff:.3g}")
        if not sharded or diff > 1e-4:
            check.results["fsdp"] = figures  # the figures stay in the table and the JSON
            raise StageFailed(f"fsdp: sharded={sharded}, resume max |diff| {diff:.3g} (log: {out / 'fsdp.log'})")
        return figures

    check.stage("fsdp", fsdp)


def post_training(check: Check, size: Sizes, steps: int, train_flags: list[str]) -> None:
    """Each chain's base, then every trainer from it with the chain's preset configs (sized
    here), then evaluate on the first chain's GRPO policy."""
    if set(check.stages) <= {*PRETRAINING, "decode", "trl_compare"}:  # no run needs the inputs
        return
    out = check.out
    tok = inputs.train_tokenizer(out / "tokenizer")
    text = inputs.text_shards(out / "text_data", tok, size.micro * (steps + 2) + size.seq + 1, 8 * size.seq + 1)
    sft_data = inputs.sft_rows(out / "sft_data" / "sft.h5", tok, size.seq, size.sft_problems)
    pairs = inputs.preference_pairs(out / "pref_data", size.pairs)
    prompts = inputs.rl_prompts(out / "prompt_data", size.prompts, max(size.eval_prompts, size.prompts // 10))
    print(f"inputs: {tok.spec} ({tok.vocab_size} pieces), {text}, {sft_data}, {pairs}, {prompts}", flush=True)
    flags = ["--train.max_steps", str(steps), "--train.log_every", str(max(1, steps // 2)), "--train.eval_every", "0",
             "--train.ckpt_every", "0", "--train.compile", "false"] + train_flags
    for chain in CHAINS:
        chain_runs(check, chain, size, flags, tok, text, sft_data, pairs, prompts)

    def evaluate() -> dict:
        report = out / "evaluate.json"
        wall = check.run("evaluate", [
            sys.executable, "scripts/evaluate.py", str(out / "grpo"), "--prompts",
            str(prompts.with_name("prompts_test.jsonl")), "--max-examples", str(size.eval_prompts), "--n", "2",
            "--k", "1", "--greedy", "--max-new-tokens", str(size.new_tokens), "--batch-size", str(size.eval_prompts),
            "--out", str(report)])
        metrics = json.loads(report.read_text())["metrics"]
        return {"wall_s": wall, "prompts": metrics["prompts"], "pass@1": metrics["pass@1"],
                "greedy_accuracy": metrics["greedy/accuracy"]}

    check.stage("evaluate", evaluate)


def chain_runs(check: Check, chain: Chain, size: Sizes, flags: list[str], tok, text: Path, sft_data: Path,
               pairs: Path, prompts: Path) -> None:
    """One chain's runs: its base (the preset's model shape), then SFT, the reward model, DPO
    (the gpt2-small chain also with precomputed reference log-probs), PPO and GRPO, each from
    configs/<preset>/<trainer>.yaml with `flags`."""
    out = check.out

    def name(stage: str) -> str:
        return chain.prefix + stage

    def trainer(script: str, config: str, init: str, data: Path, extra: list[str]) -> list[str]:
        return [sys.executable, f"scripts/{script}", "--config", f"configs/{chain.preset}/{config}",
                "--init", str(out / name(init)), "--data", str(data)] + flags + extra

    base = [sys.executable, "scripts/pretrain.py", "--config", size.pretrain_config, *size.shapes[chain.preset],
            "--data", str(text), "--data.tokenizer", tok.spec, "--model.vocab_size", str(tok.vocab_size),
            "--data.seq_len", str(size.seq), "--data.seq_warmup_frac", "0", "--data.eval_tokens", str(4 * size.seq),
            "--batch.global_tokens", str(size.micro), "--batch.micro_tokens", str(size.micro),
            "--optim.warmup_steps", "1"] + flags
    sft = trainer("train_sft.py", "sft.yaml", "base", sft_data, [
        *sized(("--batch.global_tokens", size.sft_rows * size.seq),
               ("--batch.micro_tokens", size.sft_micro_rows * size.seq)),
        "--optim.warmup_steps", "1", "--sample_prompts", '["What is 3 + 4?"]'])
    pair_flags = [*sized(("--batch.global_pairs", size.global_pairs), ("--batch.micro_pairs", size.micro_pairs)),
                  "--optim.warmup_steps", "1"]
    reward = trainer("train_reward.py", "reward.yaml", "sft", pairs, pair_flags)
    dpo = trainer("train_dpo.py", "dpo.yaml", "sft", pairs, pair_flags)
    compile_rollouts = size.compile_rollouts and chain.compile_rollouts
    rl_flags = ["--data.eval_prompts", str(size.eval_prompts), "--data.eval_batch", str(size.eval_prompts),
                "--data.eval_num_generations", "0",
                *sized(("--data.max_prompt_length", size.prompt_length),
                       ("--rollout.max_completion_length", size.completion)),
                *([] if compile_rollouts else ["--rollout.compile", "false"])]
    ppo_batch = ["--batch.global_prompts", str(size.ppo_prompts), "--batch.num_generations", "2",
                 "--batch.micro_completions", str(2 * size.ppo_prompts), "--batch.num_mini_batches", "1",
                 "--ppo.num_ppo_epochs", "1"] if size.ppo_prompts else []  # one optimizer step per generation batch
    ppo = trainer("train_ppo.py", "ppo.yaml", "sft", prompts,
                  rl_flags + ["--reward-model", str(out / name("reward"))] + ppo_batch)
    grpo = trainer("train_grpo.py", "grpo.yaml", "sft", prompts, rl_flags + [
        *sized(("--batch.global_prompts", size.grpo_prompts), ("--batch.num_generations", size.group),
               ("--batch.micro_completions", size.group * size.grpo_prompts)),
        "--grpo.mask_truncated_completions", "false",  # short rollouts of a fresh model are all truncated
        # dynamic sampling (smollm2-gpu) redraws while every group scores alike, as every group of a
        # base a few steps old does: at most 2 rounds a step
        "--grpo.max_generation_rounds", "2"])
    runs = [("base", base), ("sft", sft), ("reward", reward), ("dpo", dpo),
            ("dpo_precomputed", dpo + ["--dpo.precompute_ref_logps", "true"]), ("ppo", ppo), ("grpo", grpo)]
    for stage, cmd in runs:
        if name(stage) in STAGES:
            check.stage(name(stage), functools.partial(check.train, name(stage), cmd))


def decode(check: Check, gpu: bool) -> None:
    """The `decode` stage: benchmarks/gpu_check_decode.py in its own process (on the CPU its tiny
    model, the static step run eagerly: no CUDA graph), its figures from its JSON; the table's
    generation tokens/s is the graph's under bf16 on SmolLM2-135M's shape."""
    def body() -> dict:
        report = check.out / "decode.json"
        cmd = [sys.executable, "benchmarks/gpu_check_decode.py", "--out", str(report)]
        wall = check.run("decode", cmd + ([] if gpu else ["--device", "cpu", "--new-tokens", "16"]))
        figures = json.loads(report.read_text())
        figures.pop("failed")
        bf16 = figures.get("smollm2_135m", {}).get("bf16", {})
        return {"wall_s": wall, "graph": gpu, "generation_tokens_per_s": bf16.get("graph_tokens_per_s"), **figures}

    check.stage("decode", body)


def print_table(results: dict, stages=STAGES) -> None:
    print(f"\n{results['device']}; peak {results['peak_tflops']:.1f} TFLOP/s measured here")
    print(f"{'run':16s} {'tokens/s':>12s} {'MFU':>7s} {'gen tok/s':>10s} {'loss':>8s} {'wall s':>8s}")
    failed = results["failed"]
    for name in stages:
        r = results.get(name)
        if r is None:
            print(f"{name:16s} FAILED: {failed[name]}")
            continue
        if "skipped" in r:
            print(f"{name:16s} skipped: {r['skipped']}")
            continue
        cells = [f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-",
                 f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
                 f"{r['generation_tokens_per_s']:,.0f}" if r.get("generation_tokens_per_s") is not None else "-",
                 f"{r['loss']:.4f}" if "loss" in r else "-"]
        print(f"{name:16s} {cells[0]:>12s} {cells[1]:>7s} {cells[2]:>10s} {cells[3]:>8s} {r['wall_s']:>8.1f}"
              + (f"  FAILED: {failed[name]}" if name in failed else ""))
        if name == "trl_compare":
            print(gpu_check_trl.summary(r))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check")
    p.add_argument("--tiny", action="store_true", help="demo-size model on the CPU (checks this script)")
    p.add_argument("--steps", type=int, default=0, help="pretraining steps (default 20 on GPU, 6 tiny)")
    p.add_argument("--trainer-steps", type=int, default=0, help="steps of base and each post-training run "
                   "(default 4 on GPU, 3 tiny)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help="comma-separated stages to run, with the runs they start from (default: all): "
                   + ", ".join(STAGES) + f"; all of them in two commands: {TWO_COMMANDS[0]}, then {TWO_COMMANDS[1]}")
    args = p.parse_args()
    try:
        stages = with_needs([s.strip() for s in args.stages.split(",") if s.strip()])
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available() and not args.tiny
    size = GPU if gpu else TINY
    n_gpu = torch.cuda.device_count() if gpu else 2
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PYTHONUNBUFFERED": "1"}
    if gpu:
        peak = max(measure_matmul_flops(n, torch.bfloat16, "cuda", seconds=0.4) for n in (4096, 8192))
        global_batch = size.micro * size.micro_steps * n_gpu
        fsdp_config = out / "fsdp.yaml"
        fsdp_config.write_text((ROOT / "configs/accelerate/fsdp.yaml").read_text()
                               .replace("num_processes: 8", f"num_processes: {n_gpu}"))
        device = f"{n_gpu} × {torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16"
    else:
        env["OMP_NUM_THREADS"] = "1"
        peak = max(measure_matmul_flops(n, seconds=0.2) for n in (512, 1024))
        global_batch = size.micro * size.micro_steps  # 1 process × 2 micro-steps, or the 2 FSDP processes × 1
        fsdp_config = ROOT / "configs/accelerate/cpu_fsdp.yaml"
        device = f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, fp32"
    print(f"{device}: measured matmul peak {peak / 1e12:.2f} TFLOP/s", flush=True)
    # every run: bf16 autocast on the GPU, fp32 on the CPU
    train_flags = ["--train.mixed_precision", "bf16" if gpu else "no", "--train.progress", "false",
                   "--train.peak_tflops", f"{peak / 1e12:.4f}"]
    check = Check(out, env, {"device": device, "peak_tflops": peak / 1e12}, stages)
    check.save()  # the device and its peak, before any stage
    results = check.results
    pretraining(check, size, args.steps or size.steps, global_batch, n_gpu, fsdp_config, train_flags)
    post_training(check, size, args.trainer_steps or size.trainer_steps, train_flags)
    decode(check, gpu)
    check.stage("trl_compare", functools.partial(gpu_check_trl.trl_compare_stage, check, gpu, StageFailed))
    print_table(results, stages)  # gpu_check.json: saved after each stage
    if results["failed"]:
        raise SystemExit(f"gpu_check failed: {'; '.join(results['failed'].values())}")


if __name__ == "__main__":
    main()
