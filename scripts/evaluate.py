"""Evaluate a policy on held-out problems (pass@k, greedy accuracy, format rate), or rank pairs.

    python scripts/evaluate.py runs/demo/grpo_model --task arith --n 16 --k 1,8 --greedy
    python scripts/evaluate.py runs/demo/grpo_model --task arith --split test --n 16 --greedy
    python scripts/evaluate.py runs/demo/sft_model --task gsm8k --max-examples 100 --n 0 --greedy
    python scripts/evaluate.py runs/demo/sft_model --prompts runs/demo/rl_prompts/prompts_test.jsonl
    python scripts/evaluate.py runs/demo/dpo_model --preferences runs/demo/prefs/preferences_test.jsonl
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml scripts/evaluate.py RUN --task arith

RUN is a checkpoint dir, a run dir or its checkpoints/ folder (the newest checkpoint). --split
dev (the default) is for tuning, --split test for the figures reported. Answers are read
strictly (<answer>…</answer>) and flexibly (else the last number); --preferences ranks a
preference file's pairs. Writes --out (default <run folder>/eval/<task>_<split>_step<step>.json):
figures with 95 % intervals and one record per problem or pair. More: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from sprout.atomic import sha256_file, write_json_atomic
from sprout.errors import SproutError, run_main
from sprout.evaluation.tasks import SPLITS, TASKS, dev_slice_record, file_prompts, task_prompts
from sprout.formats.preference_tokens import TRUNCATIONS
from sprout.ranges import is_finite_number
from sprout.stages.configs import RewardLossConfig

DEFAULT_KS = (1, 8)  # those at most --n, when --k is not given
GENERATION = {"n": 16, "k": None, "greedy": False, "max_examples": None, "max_new_tokens": 256, "temperature": 1.0,
              "seed": 0, "samples": 4, "split": None, "mirror": None,
              "cuda_graph": "auto"}  # options, defaults: not with --preferences
CUDA_GRAPH = {"auto": "auto", "true": True, "false": False}  # --cuda-graph -> generate_tokens(cuda_graph=)
ROWS = ("pass@{k}", "greedy/accuracy", "greedy/format_rate", "format/rate", "completions/mean_length",
        "completions/clipped_ratio", "flexible/pass@{k}", "flexible/greedy/accuracy")


def parse_ks(text: str | None, n: int) -> list[int]:
    if text is None:
        return [k for k in DEFAULT_KS if k <= n]
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SproutError(f"--k: expected comma-separated integers like 1,8, got {text!r}") from None
    if not ks or any(not 1 <= k <= n for k in ks):
        raise SproutError(f"--k {text}: every k must be between 1 and --n ({n})")
    return ks


def table(metrics: dict, by_level: dict, ks: list[int]) -> str:
    """The figures, one row each (and its `_ci` interval on the next), a column for all prompts
    and one per level."""
    columns = [("all", metrics)] + [(f"level {level}", figures) for level, figures in by_level.items()]
    names = [r.format(k=k) for r in ROWS for k in (ks if "{k}" in r else [None])]
    names = [name for name in ["prompts", *names] if name in metrics]
    lines = ["".ljust(26) + "".join(title.rjust(10) for title, _ in columns)]
    for name in names:
        cells = [f"{fig[name]:.0f}" if name == "prompts" else f"{fig[name]:.1f}" if name == "completions/mean_length"
                 else f"{fig[name]:.3f}"
                 for _, fig in columns]
        lines.append(name.ljust(26) + "".join(c.rjust(10) for c in cells))
        if f"{name}_ci" in metrics:
            cells = ["{:.2f}-{:.2f}".format(*fig[f"{name}_ci"]) if f"{name}_ci" in fig else "" for _, fig in columns]
            lines.append("  95 % interval".ljust(26) + "".join(c.rjust(10) for c in cells))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint dir, or a run dir (its latest checkpoint)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", choices=sorted(TASKS), help="built-in held-out problems (--split)")
    source.add_argument("--prompts", help="a prompt JSONL file (e.g. runs/demo/rl_prompts/prompts_test.jsonl)")
    source.add_argument("--preferences", help="a preference JSONL file: ranking accuracy (see below)")
    p.add_argument("--n", type=int, help="samples per prompt (0: greedy only; default 16)")
    p.add_argument("--k", help="pass@k for these k, comma-separated, each <= n (default: 1,8 where <= n)")
    p.add_argument("--greedy", action="store_true", default=None, help="also a greedy answer each: greedy/accuracy")
    p.add_argument("--max-examples", type=int, help="evaluate at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, help="tokens per answer at most (default 256)")
    p.add_argument("--temperature", type=float, help="of the sampled answers (default 1.0)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generation call (x n rows)")
    p.add_argument("--seed", type=int, help="seeds the sampling (the problems never change)")
    p.add_argument("--samples", type=int, help="answers kept in the JSON (the first prompts)")
    p.add_argument("--split", choices=SPLITS, help="--task's problems: dev (default; for tuning) or test (reported)")
    p.add_argument("--out", help="the JSON to write (default: <run folder>/eval/<task>_<split>_step<step>.json)")
    p.add_argument("--mirror", help="data mirror folder for --task gsm8k (default: sprout.mirror's rule)")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the one the checkpoint records)")
    p.add_argument("--cuda-graph", choices=sorted(CUDA_GRAPH),
                   help="decode step replayed as a CUDA graph: auto (default: on CUDA in one process), true, false "
                   "(docs/gpus.md)")
    pref = p.add_argument_group("--preferences (`sprout.stages.preference_ranking`; --batch-size: pairs per forward)")
    pref.add_argument("--beta", type=float, help=f"β of an LM's log-probability score (default {RewardLossConfig().beta}, the reward stage's)")
    pref.add_argument("--reference", help="a reference LM: DPO's implicit reward β × (log p − log p_ref)")
    pref.add_argument("--seq-len", type=int, help="longest side in tokens (default: the model's context)")
    pref.add_argument("--truncation", choices=TRUNCATIONS, help="a pair over --seq-len: drop (default) or keep_end")
    args = p.parse_args()
    given = [f"--{name.replace('_', '-')}" for name in GENERATION if getattr(args, name) is not None]
    if args.preferences and given:
        raise SproutError(f"{', '.join(given)}: only with --task or --prompts, not --preferences")
    vars(args).update({name: default for name, default in GENERATION.items() if getattr(args, name) is None})
    if args.n < 0 or (args.n == 0 and not args.greedy):
        raise SproutError(f"--n must be at least 1 (or 0 with --greedy), not {args.n}")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise SproutError("--max-new-tokens and --batch-size must be at least 1")
    if not (is_finite_number(args.temperature) and args.temperature > 0):
        raise SproutError(f"--temperature: got {args.temperature}; expected a finite number > 0 (use --greedy for "
                          f"greedy answers)")
    ks = parse_ks(args.k, args.n)
    if args.split is not None and not args.task:
        raise SproutError("--split goes with --task (a --prompts file is its own split)")
    split = (args.split or "dev") if args.task else None
    if not args.preferences and (args.beta, args.reference, args.seq_len, args.truncation) != (None,) * 4:
        raise SproutError("--beta, --reference, --seq-len and --truncation go with --preferences")
    import torch  # after the arguments are checked: --help never loads torch
    from accelerate import Accelerator

    from sprout.checkpoint import WEIGHTS, checkpoint_tokenizer, run_folder
    from sprout.model.load import load_model
    from sprout.evaluation.evaluate import evaluate_prompts

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    main_rank = accelerator.is_main_process
    say = print if main_rank else (lambda *a, **k: None)
    if args.preferences:
        from sprout.stages.preference_ranking import rank_preferences, ranking_table

        result = rank_preferences(accelerator, args.checkpoint, args.preferences, beta=args.beta,
                                  reference=args.reference, seq_len=args.seq_len, truncation=args.truncation or "drop",
                                  batch_size=args.batch_size, tokenizer=args.tokenizer)
        ckpt = result["checkpoint"]
        out = Path(args.out) if args.out else (run_folder(ckpt["path"]) / "eval" /
                                               f"{Path(args.preferences).stem}_step{ckpt['step']}.json")
        if main_rank:
            write_json_atomic(out, {**result, "command": shlex.join(sys.argv)})
        say(f"{Path(args.preferences).name}: {ckpt['stage'] or 'checkpoint'} step {ckpt['step']} ({ckpt['path']})")
        say(ranking_table(result))
        say(f"wrote {out}")
        return 0
    model, meta = load_model(args.checkpoint, accelerator.device)
    if meta["architecture"] == "reward":
        raise SproutError(f"{meta['path']}/meta.json: a reward model scores text; it has no LM head to answer with")
    tok = checkpoint_tokenizer(meta, args.tokenizer)
    if tok.vocab_size > model.config.vocab_size:
        raise SproutError(f"{tok.spec}: vocab {tok.vocab_size} does not fit the model's {model.config.vocab_size}")
    if args.prompts:
        prompts, name = file_prompts(args.prompts, args.max_examples), Path(args.prompts).stem
    else:
        prompts = task_prompts(args.task, split, max_examples=args.max_examples, mirror=args.mirror, log=say)
        name = f"{args.task}_{split}"
    step = meta.get("step")
    out = Path(args.out) if args.out else run_folder(meta["path"]) / "eval" / f"{name}_step{step}.json"

    ev = evaluate_prompts(model, tok, prompts, n=args.n, ks=ks, greedy=args.greedy,
                          max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
                          temperature=args.temperature, accelerator=accelerator, num_samples=args.samples,
                          cuda_graph=CUDA_GRAPH[args.cuda_graph])
    if main_rank:
        intervals, level_intervals = ev.intervals()
        metrics = {**ev.metrics, **intervals}
        by_level = {level: {**figures, **level_intervals[level]} for level, figures in ev.by_level.items()}
        result = {
            "task": args.task, "split": split, "prompts_file": args.prompts,
            "prompts_sha256": sha256_file(args.prompts) if args.prompts else None,
            "gsm8k_dev_slice": dev_slice_record(args.task, split, prompts),
            "checkpoint": {"path": meta["path"], "stage": meta.get("stage"), "step": step,
                           "weights_sha256": meta["files"][WEIGHTS]},
            "settings": {"n": args.n, "ks": ks, "greedy": args.greedy, "seed": args.seed,
                         "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                         "batch_size": args.batch_size, "max_examples": args.max_examples,
                         "processes": accelerator.num_processes, "tokenizer": tok.spec,
                         "cuda_graph": args.cuda_graph},
            "metrics": metrics, "by_level": by_level, "samples": ev.samples,
            "command": shlex.join(sys.argv), "problems": ev.problems(),
        }
        write_json_atomic(out, result)
        say(f"{name}: {len(prompts)} prompts, n={args.n}{', greedy' if args.greedy else ''}, "
            f"{meta.get('stage') or 'checkpoint'} step {step} ({meta['path']})")
        say(table(metrics, by_level, ks))
        say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
