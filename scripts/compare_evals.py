"""Compare two evaluations of the same problems (or preference pairs): each figure's paired change.

    python scripts/compare_evals.py runs/demo/eval/sft/arith_test.json runs/demo/eval/grpo/arith_test.json
    python scripts/compare_evals.py runs/a/eval/prefs_dev.json runs/b/eval/prefs_dev.json --json change.json

BEFORE and AFTER are scripts/evaluate.py JSONs: a task's (pass@k, greedy accuracy, format rates,
strict and flexible) or a preference ranking's (accuracy, by rejected_kind). For every figure both
hold, it prints AFTER - BEFORE in percentage points with the paired bootstrap 95 % interval over
the shared problems or pairs (10,000 resamples, seed 0); ✓ marks an interval that excludes 0.
Files that do not pair (other problems, another generation length or preference file) say why.
More: docs/evaluation.md.
"""

from __future__ import annotations

import argparse

from sprout.atomic import write_json_atomic
from sprout.errors import run_main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="an evaluate.py JSON: the baseline")
    p.add_argument("after", help="an evaluate.py JSON of the same problems or pairs")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args()
    from sprout.evaluation.compare import compare_rows, read_evaluation  # not at import: --help stays light

    before, after = read_evaluation(args.before), read_evaluation(args.after)
    rows = compare_rows(before, after)
    if not rows:
        print(f"{args.before} and {args.after} hold no figure in common that is a mean over problems or pairs")
        return 1
    print(f"{'figure':36s} {'before':>8s} {'after':>8s}  change, points [95 % interval]")
    for r in rows:
        ch = r["change"]
        text = ch["not_paired"] if "not_paired" in ch else \
            f"{100 * ch['diff']:+.1f} [{100 * ch['ci'][0]:+.1f}, {100 * ch['ci'][1]:+.1f}]" \
            f"{' ✓' if ch['real'] else ''}  ({ch['problems']} paired)"
        print(f"{r['figure']:36s} {100 * r['before']:8.1f} {100 * r['after']:8.1f}  {text}")
    if args.json:
        write_json_atomic(args.json, {"before": args.before, "after": args.after, "rows": rows})
    return 0


if __name__ == "__main__":
    run_main(main)
