"""One short, prepared GPU check of every training path (for a session lent a GPU).

Every stage runs as its real CLI on inputs this script makes itself (benchmarks/gpu_check_inputs.py),
so nothing is downloaded and no data mirror is needed. On a GPU each run is bf16
(`--train.mixed_precision bf16`); `--tiny` runs the same on the CPU in fp32 ("no") with the
demo-size model, to check the script itself where there is no GPU.

  peak      the best bf16 (GPU) or fp32 (CPU) matmul FLOP/s measured here, the MFU denominator
            (passed to every run as --train.peak_tflops);
  eager     scripts/pretrain.py, gpt2-small (124M, configs/gpt2-small/pretrain.yaml) on random
            token shards of its 50,257-token vocabulary, a few steps;
  compiled  the same with torch.compile (the first steps include compilation);
  fsdp      the same model under `accelerate launch` with configs/accelerate/fsdp.yaml on the
            GPUs present; then a second run resumed from the first run's half-way checkpoint
            (FSDP save, then FSDP load): its losses must equal the uninterrupted run's;
  base      scripts/pretrain.py, the same model shape with the vocabulary of a 512-piece
            SentencePiece tokenizer trained here, on synthetic text it encodes (val_bpb too):
            the checkpoint every post-training run starts from, which records that tokenizer;
  sft       scripts/train_sft.py from base, on packed arithmetic chat rows (the real SFT prep);
  reward    scripts/train_reward.py from sft, on arithmetic preference pairs (the real prep);
  dpo       scripts/train_dpo.py from sft, the same pairs, reference run live;
  dpo_precomputed  the same with --dpo.precompute_ref_logps true (reference log-probs cached first);
  ppo       scripts/train_ppo.py from sft, with the reward model of `reward` (also the value
            head's start) and the correctness/format verifiers, on arithmetic RL prompts;
  grpo      scripts/train_grpo.py from sft, on the same prompts;
  evaluate  scripts/evaluate.py on the grpo policy: the held-out prompts, sampled and greedy.

Each post-training stage is its configs/demo/*.yaml with the batch, lengths and steps set
small here. The script prints one table (tokens/s and MFU of the last logged window of
each run, generation tokens/s for PPO and GRPO, the last loss, wall time) and writes
<out>/gpu_check.json, each run's log beside it (<out>/<stage>.log). A stage that fails, logs
a non-finite loss, or (fsdp) does not shard or resume exactly is reported by name; the
stages that do not depend on it still run, and the script then exits with status 1 naming
every failed stage.

    python benchmarks/gpu_check.py --out runs/gpu_check            # on a GPU machine (not yet run on one)
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_check     # dry run on CPU, about 2 minutes
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
from sprout.engine.metrics import measure_matmul_flops, read_metrics  # noqa: E402

STAGES = ("eager", "compiled", "fsdp", "base", "sft", "reward", "dpo", "dpo_precomputed", "ppo", "grpo", "evaluate")
NEEDS = {"sft": "base", "reward": "sft", "dpo": "sft", "dpo_precomputed": "sft", "ppo": "reward", "grpo": "sft",
         "evaluate": "grpo"}  # the run a stage starts from (ppo: sft, and the reward model)


@dataclass
class Sizes:
    """How big each run is: the GPU check's, or the CPU dry run's (`--tiny`)."""
    pretrain_config: str
    vocab: int              # of the random shards
    model_vocab: int        # the pretraining model's (the vocab padded for matmuls)
    seq: int                # sequence length of pretraining and SFT rows
    micro: int              # pretraining tokens per micro-batch (base: per step)
    micro_steps: int        # pretraining micro-batches per step (on each GPU; on the CPU in all)
    steps: int              # pretraining steps
    trainer_steps: int      # steps of base and of each post-training run
    sft_problems: int       # arithmetic problems packed into SFT rows
    sft_rows: int           # SFT rows per step ...
    sft_micro_rows: int     # ... and per micro-batch
    pairs: int              # preference pairs (about a tenth held out)
    global_pairs: int
    micro_pairs: int
    prompts: int            # RL train prompts (a tenth as many held out)
    ppo_prompts: int        # prompts per PPO generation batch (2 completions each)
    grpo_prompts: int       # prompts per GRPO generation batch ...
    group: int              # ... and completions per prompt
    completion: int         # max new tokens of a rollout
    eval_prompts: int       # held-out prompts per RL eval (greedy) and for evaluate.py


GPU = Sizes(pretrain_config="configs/gpt2-small/pretrain.yaml", vocab=50257, model_vocab=50304, seq=1024,
            micro=32768, micro_steps=4, steps=20, trainer_steps=8, sft_problems=2000, sft_rows=16, sft_micro_rows=16,
            pairs=1000, global_pairs=64, micro_pairs=32, prompts=400, ppo_prompts=32, grpo_prompts=8, group=8,
            completion=64, eval_prompts=32)
TINY = Sizes(pretrain_config="configs/demo/pretrain.yaml", vocab=4096, model_vocab=4096, seq=256,
             micro=4096, micro_steps=2, steps=6, trainer_steps=3, sft_problems=400, sft_rows=8, sft_micro_rows=4,
             pairs=120, global_pairs=8, micro_pairs=4, prompts=60, ppo_prompts=4, grpo_prompts=2, group=4,
             completion=16, eval_prompts=4)


class StageFailed(Exception):
    """A stage that did not give what it must; the message names the stage."""


def train_figures(stage: str, run_dir: Path) -> dict:
    """The figures of a run's last training record; StageFailed if it has none, or if any
    record holds a non-finite loss (training or eval)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    for r in records:
        for k, v in r.items():
            if "loss" in k and isinstance(v, float) and not math.isfinite(v):
                raise StageFailed(f"{stage}: {k} {v} at step {r.get('step')} ({run_dir / 'metrics.jsonl'})")
    train = [r for r in records if "loss" in r and "tokens_per_s" in r]
    if not train:
        raise StageFailed(f"{stage}: no training record in {run_dir / 'metrics.jsonl'}")
    last = train[-1]
    return {"tokens_per_s": last["tokens_per_s"], "mfu": last.get("mfu"), "loss": last["loss"],
            "generation_tokens_per_s": last.get("generation/tokens_per_s")}


class Check:
    """The runs of one check: where they go, how they are launched, what each gave."""

    def __init__(self, out: Path, env: dict, results: dict):
        self.out, self.env, self.results = out, env, results
        self.failed: dict[str, str] = results.setdefault("failed", {})

    def run(self, stage: str, cmd: list[str], log_name: str | None = None) -> float:
        """Run one command, its output in <out>/<stage>.log (the end printed); returns its wall time."""
        log = self.out / f"{log_name or stage}.log"
        print(f"\n== {stage}: {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT, text=True)
        text = log.read_text()
        print(text[-3000:] if proc.returncode else text[-600:], flush=True)
        if proc.returncode:
            raise StageFailed(f"{stage}: exit status {proc.returncode} (log: {log})")
        return time.perf_counter() - t0

    def train(self, stage: str, cmd: list[str]) -> dict:
        """Run a training command whose --out is <out>/<stage>; its figures and wall time."""
        wall = self.run(stage, cmd + ["--out", str(self.out / stage), "--overwrite"])
        return {**train_figures(stage, self.out / stage), "wall_s": wall}

    def stage(self, name: str, body) -> None:
        """Record `body()` (the stage's figures) as stage `name`, or its failure; not run when
        the stage it starts from failed."""
        need = NEEDS.get(name)
        if need and need not in self.results:
            self.failed[name] = f"{name}: not run ({need} failed)"
            print(f"\n== {name}: not run, {need} failed", flush=True)
            return
        try:
            self.results[name] = body()
        except StageFailed as exc:
            self.failed[name] = str(exc)
            print(f"\n== FAILED {exc}", flush=True)


def pretraining(check: Check, size: Sizes, steps: int, global_batch: int, n_gpu: int, fsdp_config: Path,
                train_flags: list[str]) -> None:
    """eager, compiled and fsdp: the pretraining model at its real shape on random token shards."""
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
    """base, then every trainer from it (each its configs/demo/*.yaml, sized here), then evaluate."""
    out = check.out
    tok = inputs.train_tokenizer(out / "tokenizer")
    text = inputs.text_shards(out / "text_data", tok, size.micro * (steps + 2) + size.seq + 1, 8 * size.seq + 1)
    sft_data = inputs.sft_rows(out / "sft_data" / "sft.h5", tok, size.seq, size.sft_problems)
    pairs = inputs.preference_pairs(out / "pref_data", size.pairs)
    prompts = inputs.rl_prompts(out / "prompt_data", size.prompts, max(size.eval_prompts, size.prompts // 10))
    print(f"inputs: {tok.spec} ({tok.vocab_size} pieces), {text}, {sft_data}, {pairs}, {prompts}", flush=True)
    flags = ["--train.max_steps", str(steps), "--train.log_every", str(max(1, steps // 2)), "--train.eval_every", "0",
             "--train.ckpt_every", "0", "--train.compile", "false"] + train_flags

    def trainer(script: str, config: str, init: str, data: Path, extra: list[str]) -> list[str]:
        return [sys.executable, f"scripts/{script}", "--config", config, "--init", str(out / init),
                "--data", str(data)] + flags + extra

    base = [sys.executable, "scripts/pretrain.py", "--config", size.pretrain_config, "--data", str(text),
            "--data.tokenizer", tok.spec, "--model.vocab_size", str(tok.vocab_size), "--data.seq_len", str(size.seq),
            "--data.seq_warmup_frac", "0", "--data.eval_tokens", str(4 * size.seq),
            "--batch.global_tokens", str(size.micro), "--batch.micro_tokens", str(size.micro),
            "--optim.warmup_steps", "1"] + flags
    sft = trainer("train_sft.py", "configs/demo/sft.yaml", "base", sft_data, [
        "--batch.global_tokens", str(size.sft_rows * size.seq), "--batch.micro_tokens",
        str(size.sft_micro_rows * size.seq), "--optim.warmup_steps", "1", "--sample_prompts", '["What is 3 + 4?"]'])
    pair_flags = ["--batch.global_pairs", str(size.global_pairs), "--batch.micro_pairs", str(size.micro_pairs),
                  "--optim.warmup_steps", "1"]
    reward = trainer("train_reward.py", "configs/demo/reward.yaml", "sft", pairs, pair_flags)
    dpo = trainer("train_dpo.py", "configs/demo/dpo.yaml", "sft", pairs, pair_flags)
    dpo_precomputed = dpo + ["--dpo.precompute_ref_logps", "true"]
    rl_flags = ["--data.max_prompt_length", "64", "--data.eval_prompts", str(size.eval_prompts),
                "--data.eval_batch", str(size.eval_prompts), "--data.eval_num_generations", "0",
                "--rollout.max_completion_length", str(size.completion)]
    ppo = trainer("train_ppo.py", "configs/demo/ppo.yaml", "sft", prompts, rl_flags + [
        "--reward-model", str(out / "reward"), "--batch.global_prompts", str(size.ppo_prompts),
        "--batch.num_generations", "2", "--batch.micro_completions", str(2 * size.ppo_prompts),
        "--batch.num_mini_batches", "1", "--ppo.num_ppo_epochs", "1"])
    grpo = trainer("train_grpo.py", "configs/demo/grpo.yaml", "sft", prompts, rl_flags + [
        "--batch.global_prompts", str(size.grpo_prompts), "--batch.num_generations", str(size.group),
        "--batch.micro_completions", str(size.group * size.grpo_prompts), "--grpo.num_iterations", "1",
        "--grpo.mask_truncated_completions", "false"])  # short rollouts of a fresh model are all truncated
    for name, cmd in (("base", base), ("sft", sft), ("reward", reward), ("dpo", dpo),
                      ("dpo_precomputed", dpo_precomputed), ("ppo", ppo), ("grpo", grpo)):
        check.stage(name, functools.partial(check.train, name, cmd))

    def evaluate() -> dict:
        report = out / "evaluate.json"
        wall = check.run("evaluate", [
            sys.executable, "scripts/evaluate.py", str(out / "grpo"), "--prompts",
            str(prompts.with_name("prompts_test.jsonl")), "--max-examples", str(size.eval_prompts), "--n", "2",
            "--k", "1", "--greedy", "--max-new-tokens", str(size.completion), "--batch-size", str(size.eval_prompts),
            "--out", str(report)])
        metrics = json.loads(report.read_text())["metrics"]
        return {"wall_s": wall, "prompts": metrics["prompts"], "pass@1": metrics["pass@1"],
                "greedy_accuracy": metrics["greedy/accuracy"]}

    check.stage("evaluate", evaluate)


def print_table(results: dict) -> None:
    print(f"\n{results['device']}; peak {results['peak_tflops']:.1f} TFLOP/s measured here")
    print(f"{'run':16s} {'tokens/s':>12s} {'MFU':>7s} {'gen tok/s':>10s} {'loss':>8s} {'wall s':>8s}")
    failed = results["failed"]
    for name in STAGES:
        r = results.get(name)
        if r is None:
            print(f"{name:16s} FAILED: {failed[name]}")
            continue
        cells = [f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-",
                 f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
                 f"{r['generation_tokens_per_s']:,.0f}" if r.get("generation_tokens_per_s") is not None else "-",
                 f"{r['loss']:.4f}" if "loss" in r else "-"]
        print(f"{name:16s} {cells[0]:>12s} {cells[1]:>7s} {cells[2]:>10s} {cells[3]:>8s} {r['wall_s']:>8.1f}"
              + (f"  FAILED: {failed[name]}" if name in failed else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu_check")
    p.add_argument("--tiny", action="store_true", help="demo-size model on the CPU (checks this script)")
    p.add_argument("--steps", type=int, default=0, help="pretraining steps (default 20 on GPU, 6 tiny)")
    p.add_argument("--trainer-steps", type=int, default=0, help="steps of base and each post-training run "
                   "(default 8 on GPU, 3 tiny)")
    args = p.parse_args()
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
    # every run: bf16 autocast on the GPU, fp32 on the CPU ("no" quoted: YAML reads a bare no as false)
    train_flags = ["--train.mixed_precision", "bf16" if gpu else '"no"', "--train.progress", "false",
                   "--train.peak_tflops", f"{peak / 1e12:.4f}"]
    check = Check(out, env, {"device": device, "peak_tflops": peak / 1e12})
    results = check.results
    pretraining(check, size, args.steps or size.steps, global_batch, n_gpu, fsdp_config, train_flags)
    post_training(check, size, args.trainer_steps or size.trainer_steps, train_flags)
    print_table(results)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    if results["failed"]:
        raise SystemExit(f"gpu_check failed: {'; '.join(results['failed'].values())}")


if __name__ == "__main__":
    main()
