"""Run a whole pipeline preset, stage by stage, skipping what is done; then write its report card.

    python scripts/run_pipeline.py --preset demo                   # configs/pipelines/demo.yaml, into runs/demo
    python scripts/run_pipeline.py --preset demo --to sft          # the stages up to SFT
    python scripts/run_pipeline.py --preset demo --from dpo        # DPO and everything after it, again
    python scripts/run_pipeline.py --preset gpt2-small --out runs/gpt2 --mirror ../shared/data
    python scripts/run_pipeline.py --preset my_chain.yaml --report-only
    python scripts/run_pipeline.py --preset smollm2 --model HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/run_pipeline.py --preset smollm2 --seeds 1337,1338,1339   # GRPO and all after it, per seed
    python scripts/run_pipeline.py --preset smollm2 --sweep grpo:optim.lr=5e-6,1e-5,2e-5 --sweep grpo:train.seed=1
    python scripts/run_pipeline.py --preset smollm2 --set grpo:optim.lr=LR --seeds 1337,1338,1339   # LR: the sweep's

A stage whose outputs exist and verify is skipped, an interrupted one resumes from its latest
checkpoint, one whose inputs changed (config file, command line, an earlier stage's outputs)
runs again with everything after it (the preset format: sprout/pipeline/preset.py; the rules:
sprout/pipeline/runner.py); killed at any moment, the same command carries on. With seeds, each seeded stage and
every stage reading it run once per seed, each into its own folder (`<out>_seed<N>`), from the
same earlier stages. A sweep runs one train stage once per setting and judges each on the dev
split only (sprout/pipeline/sweep.py), into <out>/sweep_<stage>.md; --set then runs the one
chosen. The report card (`<out>/report.md`) compares every stage's checkpoint on one
table (sprout/pipeline/report_card.py).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from sprout.errors import SproutError, run_main
from sprout.pipeline.runner import StageFailed, read_state, run_pipeline
from sprout.pipeline.preset import load_preset, preset_path
from sprout.pipeline.sweep import parse_option, parse_select


def seed_list(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="demo | gpt2-small | smollm2 | smollm2-lora | smollm2-gpu "
                   "(configs/pipelines/<name>.yaml) or PATH.yaml")
    p.add_argument("--from", dest="start", metavar="STAGE", help="run this stage and every later one again "
                   "(the earlier ones must be done)")
    p.add_argument("--to", dest="end", metavar="STAGE", help="stop after this stage")
    p.add_argument("--out", help="output root (default: the preset's out)")
    p.add_argument("--mirror", help="data mirror folder, passed to every stage as SPROUT_MIRROR")
    p.add_argument("--model", help="the published model {model} stands for in the preset (a Hugging Face folder, "
                   "a hub id or a .gguf file; default: the preset's model)")
    p.add_argument("--seeds", type=seed_list, metavar="N,N,...", help="run the seeded stages once per seed, "
                   "each with --train.seed N (default: the preset's seeds)")
    p.add_argument("--seed-stages", type=lambda text: [s for s in text.split(",") if s], metavar="STAGE,...",
                   help="train stages run once per seed with all they feed (default: the preset's seed_stages)")
    p.add_argument("--sweep", action="append", default=[], metavar="STAGE:KEY=V1,V2,...",
                   help="run train stage STAGE once per value (several --sweep multiply), each judged on its eval "
                   "stages' dev commands only; the table: <out>/sweep_<STAGE>.md")
    p.add_argument("--sweep-tasks", type=lambda text: [s for s in text.split(",") if s], metavar="TASK,...",
                   help="judge the sweep on these tasks' dev evaluations only (default: every task evaluated)")
    p.add_argument("--sweep-select", type=parse_select, metavar="TASK:FIGURE",
                   help="the dev figure the setting is chosen by (default: pass@1 of the first task evaluated, "
                   "greedy accuracy without pass@1)")
    p.add_argument("--set", action="append", default=[], metavar="STAGE:KEY=VALUE",
                   help="add --KEY VALUE to stage STAGE's commands (a setting chosen by a sweep)")
    p.add_argument("--report-only", action="store_true", help="run no stage; write the report card of those done "
                   "(with --sweep: the sweep table)")
    p.add_argument("--no-report", action="store_true", help="skip the report card (a sweep never writes it: it "
                   "has its own table)")
    args = p.parse_args()
    preset = load_preset(preset_path(args.preset), args.out, args.model, args.seeds, args.seed_stages,
                         sets=[parse_option(t, many=False) for t in args.set],
                         sweeps=[parse_option(t, many=True) for t in args.sweep], sweep_tasks=args.sweep_tasks)
    failed = None
    if args.report_only and not any(rec.get("status") == "done" for rec in read_state(preset.out)["stages"].values()):
        raise SproutError(f"{preset.out}: nothing to report: no stage of this pipeline is done there (run it "
                          f"without --report-only first, or pass the --out it ran in)")
    if not args.report_only:
        try:
            run_pipeline(preset, args.start, args.end, mirror=args.mirror)
        except StageFailed as exc:
            failed = exc
    if args.sweep and (preset.out / "pipeline_state.json").is_file():
        from sprout.pipeline.sweep_table import write_sweep_table  # not at import: --help never loads torch

        table = write_sweep_table(preset, read_state(preset.out), args.sweep_select,
                                  command=shlex.join(["python", "scripts/run_pipeline.py", *sys.argv[1:]]))
        print(f"\n==> sweep table: {table}")
    if not args.no_report and not args.sweep and (preset.out / "pipeline_state.json").is_file():
        print("\n==> report card")
        from sprout.pipeline.report_card import write_report_card

        report = write_report_card(preset, read_state(preset.out), log=print)
        print(f"report card: {report}")
    if failed is not None:
        print(f"error: {failed}", file=sys.stderr)
        return failed.code
    return 0


if __name__ == "__main__":
    run_main(main)
