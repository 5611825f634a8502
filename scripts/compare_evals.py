"""Compare evaluations of the same problems (or preference pairs): each figure's paired change.

    python scripts/compare_evals.py runs/demo/eval/sft/arith_test.json runs/demo/eval/grpo/arith_test.json
    python scripts/compare_evals.py runs/a/eval/prefs_dev.json runs/b/eval/prefs_dev.json --json change.json
    python scripts/compare_evals.py runs/s/eval/ppo/arith_test.json \
        runs/s/eval/grpo_seed{1337,1338,1339}/arith_test.json

BEFORE and AFTER are scripts/evaluate.py JSONs: a task's (pass@k, greedy accuracy, format rates,
strict and flexible) or a preference ranking's (accuracy, by rejected_kind). For every figure both
hold, it prints AFTER - BEFORE in percentage points with the paired bootstrap 95 % interval over
the shared problems or pairs (10,000 resamples, seed 0); ✓ marks an interval that excludes 0.
Several AFTER files are one setting's seeds: it prints each seed's figure, their mean, and the
mean's change with the two-level interval over seeds and problems, as the report card does
(docs/evaluation.md#intervals-over-seeds); a file given twice is refused. Files that do not pair
(other problems, another generation length or preference file) say why. More: docs/evaluation.md.
"""

from __future__ import annotations

import argparse

from sprout.atomic import write_json_atomic
from sprout.errors import SproutError, run_main


def change_text(ch: dict) -> str:
    if "not_paired" in ch:
        return ch["not_paired"]
    return (f"{100 * ch['diff']:+.1f} [{100 * ch['ci'][0]:+.1f}, {100 * ch['ci'][1]:+.1f}]"
            f"{' ✓' if ch['real'] else ''}  ({ch['problems']} paired)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="an evaluate.py JSON: the baseline")
    p.add_argument("after", nargs="+", help="an evaluate.py JSON of the same problems or pairs; several: one "
                                            "setting's seeds, compared by their mean")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON (`after`: the list of AFTER files)")
    args = p.parse_args()
    # not at import: --help stays light
    from sprout.evaluation.compare import compare_rows, compare_seed_rows, read_evaluation

    if len(set(args.after)) < len(args.after):
        raise SproutError(f"{next(a for a in args.after if args.after.count(a) > 1)}: given twice as AFTER; each "
                          f"file is one seed")
    before, after = read_evaluation(args.before), [read_evaluation(a) for a in args.after]
    seeds = len(after) > 1
    rows = compare_seed_rows(before, after) if seeds else compare_rows(before, after[0])
    if not rows:
        print(f"{args.before} and {' '.join(args.after)} hold no figure in common that is a mean over problems "
              f"or pairs")
        return 1
    if seeds:
        print(f"after: the mean of {len(after)} seeds ({', '.join(args.after)})")
    width = 6 * len(after) + 1 if seeds else 0  # the seeds' own figures, when there are several
    print(f"{'figure':36s} {'before':>8s}{'seeds' if seeds else '':>{width}s} {'after':>8s}  change, points "
          f"[95 % interval{' over seeds and problems' if seeds else ''}]")
    for r in rows:
        each = " ".join(f"{100 * v:5.1f}" for v in r.get("seeds", []))
        print(f"{r['figure']:36s} {100 * r['before']:8.1f}{each:>{width}s} {100 * r['after']:8.1f}  "
              f"{change_text(r['change'])}")
    if args.json:
        write_json_atomic(args.json, {"before": args.before, "after": args.after, "rows": rows})
    return 0


if __name__ == "__main__":
    run_main(main)
