"""sprout against TRL and transformers on the same weights: GRPO, DPO and SFT steps, and generation.

One process, the same device, precision and torch threads for every row: --device cpu (fp32 by
default) or cuda (bf16 by default), --dtype fp32 or bf16 (bf16: fp32 weights under bf16
autocast on both sides, TRL's bf16=True; benchmarks/trl_compare_device.py, which also gives
each check's tolerance in each dtype). sprout loads the run folder (--run,
default runs/smollm2: `python scripts/import_model.py HuggingFaceTB/SmolLM2-135M-Instruct --out
runs/smollm2`); TRL and transformers load its transformers export (or --hf-folder), so both
start from the same weights, tokenizer and chat template, on the same arithmetic problems.
Rows (the trainer rows: benchmarks/trl_compare_rows.py): GRPO, DPO and SFT steps, each with a
first-batch check that feeds the same tensors to both losses, and generation (KV cache on both
sides; the check: the largest |logit difference|). Step times are medians over --steps steps
after --warmup untimed ones, the two sides alternating (on CUDA each timestamp after a
synchronize); measure on an otherwise idle machine.
The LoRA rows grpo_lora, dpo_lora and sft_lora (benchmarks/trl_compare_lora.py; run when --only
names them) are the same steps with LoRA adapters on both sides, TRL's through peft. The table
gives both medians, the speed ratio, its target (GRPO 1.5x, DPO and SFT 1.1x, generation 2x,
the LoRA rows 1.3x) and the check's largest |difference| against its tolerance; --json PATH
writes the table as JSON too; --profile adds one profiled sprout step per row. Exits 1 when a
check is beyond its tolerance (after the table and the JSON). Needs the 'bench' extra (trl,
transformers, peft): pip install -e '.[bench]'.

    python benchmarks/trl_compare.py [--run runs/smollm2] [--hf-folder DIR] [--only grpo,dpo,sft,generate]
                                     [--device cpu|cuda] [--dtype fp32|bf16] [--json PATH]
                                     [--steps 5] [--warmup 1] [--threads N] [--profile] [sizes: see --help]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_throughput import check_logits  # noqa: E402
from trl_compare_device import DEVICES, DTYPES, Precision  # noqa: E402
from trl_compare_grpo import grpo  # noqa: E402
from trl_compare_lora import dpo_lora, grpo_lora, sft_lora  # noqa: E402
from trl_compare_rows import Bench, Row, dpo, median, problems, sft, user  # noqa: E402

from sprout.atomic import atomic_write, check_writable  # noqa: E402
from sprout.chat import render  # noqa: E402
from sprout.checkpoint import checkpoint_tokenizer, read_meta  # noqa: E402
from sprout.errors import run_main  # noqa: E402
from sprout.model.generate import generate_tokens, pad_prompts, static_decode_wanted  # noqa: E402


def generation(b: Bench) -> Row:
    """New tokens/s of sprout's and transformers' KV-cache sampling, alternated, median of --steps
    each, both under the precision's autocast on its device."""
    a, precision = b.args, b.precision
    N = a.new_tokens
    ids, mask = pad_prompts([render(user(p.question), b.tok, add_generation_prompt=True)[0]
                             for p in problems(a.gen_rows)], precision.device)
    model, hf = b.sprout_model().eval(), b.hf_model().eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad(), precision.autocast():
        err = check_logits(model, hf, ids, mask)
    g = precision.generator(0)

    def ours():
        with precision.autocast():
            out = generate_tokens(model, ids, mask, max_new_tokens=N, temperature=a.temperature, generator=g)
        assert int(out.lengths.min()) == N

    def theirs():
        with precision.autocast():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                              temperature=a.temperature, max_new_tokens=N, min_new_tokens=N)
        assert out.shape[1] == ids.shape[1] + N

    times = {ours: [], theirs: []}
    for i in range(a.warmup + a.steps):
        for fn in times:
            t0 = precision.clock()
            fn()
            if i >= a.warmup:
                times[fn].append(precision.clock() - t0)
    rate = {fn: ids.shape[0] * N / median(t) for fn, t in times.items()}
    lengths = mask.sum(1)
    return Row("generate", "new tok/s", rate[ours], rate[theirs], rate[ours] / rate[theirs], 2.0,
               {"logits": err},
               [f"{ids.shape[0]} rows (prompt lengths {int(lengths.min())}..{int(lengths.max())}) x {N} new tokens, "
                f"sampled at temperature {a.temperature}, KV cache in both; sprout's decode step "
                + ("a CUDA graph" if static_decode_wanted("auto", ids.device) else "eager")
                + " (generate_tokens' default here)"],
               ours)


ROWS = {"grpo": grpo, "dpo": dpo, "sft": sft, "generate": generation,
        "grpo_lora": grpo_lora, "dpo_lora": dpo_lora, "sft_lora": sft_lora}
DEFAULT_ROWS = "grpo,dpo,sft,generate"


def print_table(rows: list[Row], precision: Precision) -> None:
    w = max(10, *(len(r.name) for r in rows))
    print(f"\n{precision.describe()}, both sides")
    print(f"{'':{w}s} {'sprout':>14s} {'TRL/transformers':>18s} {'speed ratio':>12s} {'target':>8s}   "
          f"first-batch check (max |diff|)")
    for r in rows:
        fmt = (lambda v: f"{v:.3f} s") if r.unit == "s" else (lambda v: f"{v:,.{0 if v >= 100 else 2}f} {r.unit}")
        failures = precision.failures(r)
        print(f"{r.name:{w}s} {fmt(r.sprout):>14s} {fmt(r.other):>18s} {r.speedup:>11.2f}x {r.target:>7.1f}x   "
              + ", ".join(f"{k} {v:.1e}" for k, v in r.check.items())
              + (f"  FAILED: {'; '.join(failures)}" if failures else "  ok"))
    for r in rows:
        print(f"\n{r.name}:" + "".join(f"\n  {n}" for n in r.notes))
        if r.speedup < r.target:
            print(f"  below the {r.target}x target: --profile shows where sprout's step spends its time")


# ---- --profile ----------------------------------------------------------------------------------
@contextmanager
def labelled(phases: dict):
    """Each `getattr(obj, name)` of `phases` {label: (obj, name)} runs inside a profiler range
    "phase: label" until the block ends."""
    from torch.profiler import record_function

    def wrap(fn, label):
        def run(*args, **kwargs):
            with record_function(f"phase: {label}"):
                return fn(*args, **kwargs)
        return run

    patched = []
    for label, (obj, name) in phases.items():
        patched.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, wrap(getattr(obj, name), label))
    try:
        yield
    finally:
        for obj, name, own in reversed(patched):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)


def print_profile(row: Row, top: int = 15) -> None:
    """One more sprout step of `row` under torch.profiler: its labelled phases (CPU time, share
    of the step's wall time), then the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with labelled(row.phases), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        row.step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    print(f"\nprofile: one sprout {row.name} ({wall:.2f} s wall, under the profiler)")
    for e in sorted((e for e in events if e.key.startswith("phase: ")), key=lambda e: -e.cpu_time_total):
        print(f"  {e.key[len('phase: '):]:26s} {e.cpu_time_total / 1e6:7.2f} s  {e.cpu_time_total / 1e6 / wall:6.1%}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="runs/smollm2", help="sprout run folder or checkpoint (scripts/import_model.py)")
    p.add_argument("--hf-folder", help="its transformers export (default: exported into a temporary folder)")
    p.add_argument("--only", default=DEFAULT_ROWS, help=f"comma-separated rows, of: {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps (generation: timed runs) per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--threads", type=int, default=0, help="torch threads for every row (0: torch's default)")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where both sides run")
    p.add_argument("--dtype", choices=DTYPES, help="both sides' precision: fp32, or bf16 autocast over fp32 "
                   "weights (TRL's bf16=True); default bf16 on cuda, fp32 on cpu")
    p.add_argument("--json", metavar="PATH", help="also write the table to PATH as JSON (atomically)")
    p.add_argument("--profile", action="store_true", help="profile one more sprout step of each row "
                   "(CPU time: with --device cpu)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (GRPO, generate)")
    g = p.add_argument_group("GRPO")
    g.add_argument("--prompts", type=int, default=4, help="prompts per step")
    g.add_argument("--generations", type=int, default=4, help="completions per prompt (G)")
    g.add_argument("--micro-completions", type=int, default=8, help="completions per micro-batch")
    g.add_argument("--completion-length", type=int, default=64, help="max_completion_length")
    g.add_argument("--loss-type", default="dapo", choices=("grpo", "dr_grpo", "dapo", "cispo", "sapo"),
                   help="(not bnpo: TRL normalises it per micro-batch, sprout per global batch)")
    g.add_argument("--epsilon", type=float, default=0.2)
    g.add_argument("--epsilon-high", type=float, default=None,
                   help="upper clip (default: --epsilon; cispo: its weight cap, 5.0 when not given)")
    g = p.add_argument_group("DPO and SFT")
    g.add_argument("--pairs", type=int, default=4, help="DPO pairs per micro-batch")
    g.add_argument("--beta", type=float, default=0.1, help="DPO beta")
    g.add_argument("--rows", type=int, default=8, help="SFT conversations per micro-batch")
    g.add_argument("--accum", type=int, default=1, help="micro-batches per step (DPO, SFT)")
    g = p.add_argument_group("LoRA rows (grpo_lora, dpo_lora, sft_lora: adapters on every linear layer, both sides)")
    g.add_argument("--lora-r", type=int, default=16, help="adapter rank")
    g.add_argument("--lora-alpha", type=float, default=32.0, help="scale numerator (scale alpha / r)")
    g = p.add_argument_group("generate")
    g.add_argument("--gen-rows", type=int, default=16)
    g.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.epsilon_high is None:
        args.epsilon_high = 5.0 if args.loss_type == "cispo" else args.epsilon
    unknown = set(args.only.split(",")) - set(ROWS)
    if unknown:
        p.error(f"--only: unknown rows {', '.join(sorted(unknown))} (of: {', '.join(ROWS)})")
    if args.profile and args.device != "cpu":
        p.error("--profile: CPU time of a CPU step; drop it with --device cuda")
    return args


def table_json(rows: list[Row], precision: Precision, versions: dict) -> dict:
    """The table as `--json` writes it: the device, dtype and versions, and each row's figures,
    checks, their tolerances and whether each row's checks passed."""
    return {"device": precision.device_name(), "dtype": precision.dtype, "precision": precision.describe(),
            "versions": versions,
            "rows": [{"name": r.name, "unit": r.unit, "sprout": r.sprout, "other": r.other, "speedup": r.speedup,
                      "target": r.target, "check": r.check,
                      "tolerance": {k: precision.tolerance(r.name, k) for k in r.check},
                      "check_failures": precision.failures(r), "notes": r.notes} for r in rows]}


def main(argv=None) -> list[Row]:
    """Run the rows --only names and print the table (and write --json); the rows."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> list[Row]:
    precision = Precision.of(args.device, args.dtype)
    precision.reset_accelerate()
    if args.json:
        check_writable(args.json)
    try:
        import trl  # noqa: F401
        import transformers
    except ImportError:
        raise SystemExit("trl_compare needs trl and transformers: pip install -e '.[bench]'") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    meta = read_meta(args.run)
    rows = []
    with tempfile.TemporaryDirectory(prefix="trl_compare.") as tmp:
        hf = Path(args.hf_folder) if args.hf_folder else Path(tmp) / "hf"
        if not args.hf_folder:
            from sprout.model.export import export_hf

            export_hf(args.run, hf)
        bench = Bench(args, args.run, hf, Path(tmp), checkpoint_tokenizer(meta),
                      transformers.AutoTokenizer.from_pretrained(hf), meta["model_config"]["max_seq_len"], precision)
        cfg = meta["model_config"]
        versions = {name: version(name) for name in ("torch", "transformers", "trl", "accelerate")}
        print(f"{meta['path']}: d_model {cfg['d_model']}, {cfg['n_layers']} layers, vocab {cfg['vocab_size']}; "
              f"{precision.describe()}, torch threads {torch.get_num_threads()}; "
              + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; load average {os.getloadavg()[0]:.1f}")
        for name in args.only.split(","):
            rows.append(ROWS[name](bench))
            print(f"{rows[-1].name}: sprout {rows[-1].sprout:.3f}, other {rows[-1].other:.3f} {rows[-1].unit}",
                  flush=True)
        print_table(rows, precision)
        if args.json:
            with atomic_write(args.json, "w") as f:
                f.write(json.dumps(table_json(rows, precision, versions), indent=2) + "\n")
            print(f"wrote {args.json}")
        if args.profile:
            for row in rows:
                print_profile(row)
    return rows


def cli(argv=None) -> None:
    """`main`, then exit 1 naming every row whose first-batch check is beyond its tolerance."""
    args = parse_args(argv)
    rows = run(args)
    precision = Precision.of(args.device, args.dtype)
    failed = [f"{r.name}: {'; '.join(precision.failures(r))}" for r in rows if precision.failures(r)]
    if failed:
        raise SystemExit("trl_compare: first-batch check beyond its tolerance: " + " | ".join(failed))


if __name__ == "__main__":
    run_main(cli)
