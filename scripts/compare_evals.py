"""Compare evaluations of the same problems (or preference pairs): each figure's paired change.

    python scripts/compare_evals.py runs/demo/eval/sft/arith_test.json runs/demo/eval/grpo/arith_test.json
    python scripts/compare_evals.py runs/a/eval/prefs_dev.json runs/b/eval/prefs_dev.json --json change.json
    python scripts/compare_evals.py runs/s/eval/ppo/arith_test.json \
        runs/s/eval/grpo_seed{1337,1338,1339}/arith_test.json
    python scripts/compare_evals.py --baseline runs/l/step40_seed1337.json --baseline runs/l/step40_seed1338.json \
        runs/l/step70_seed1337.json runs/l/step70_seed1338.json

BEFORE and AFTER are scripts/evaluate.py JSONs: a task's (pass@k, greedy accuracy, format rates,
strict and flexible) or a preference ranking's (accuracy, by rejected_kind). For every figure both
hold, it prints AFTER - BEFORE in percentage points with the paired bootstrap 95 % interval over
the shared problems or pairs (10,000 resamples, seed 0); ✓ marks an interval that excludes 0.
Several AFTER files are one setting's seeds: it prints each seed's figure, their mean, and the
mean's change with the two-level interval over seeds and problems, as the report card does
(docs/evaluation.md#intervals-over-seeds); a file given twice is refused. With --baseline, once per
AFTER file and in their order, each seed is compared with its own baseline (its earlier
checkpoint, say) and every positional file is an AFTER; a file may not be both. Files that do not pair
(other problems, another generation length or preference file) say why. More: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sprout.atomic import write_json_atomic
from sprout.errors import SproutError, run_main


def change_text(ch: dict) -> str:
    if "not_paired" in ch:
        return ch["not_paired"]
    return (f"{100 * ch['diff']:+.1f} [{100 * ch['ci'][0]:+.1f}, {100 * ch['ci'][1]:+.1f}]"
            f"{' ✓' if ch['real'] else ''}  ({ch['problems']} paired)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="evaluate.py JSONs of the same problems or pairs: the baseline (unless --baseline is "
                        "given), then the file to compare; several AFTER files: one setting's seeds, compared by "
                        "their mean")
    p.add_argument("--baseline", action="append", metavar="PATH",
                   help="one seed's own baseline, given once per AFTER file in their order; then every "
                        "positional file is an AFTER")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON (`before`: the BEFORE file, or the "
                                                  "list of --baseline files, whose figures rows add as "
                                                  "`before_seeds`; `after`: the list of AFTER files)")
    args = p.parse_intermixed_args()
    # not at import: --help stays light
    from sprout.evaluation.compare import compare_rows, compare_seed_rows, read_evaluation

    before_paths, after_paths = (args.baseline, args.files) if args.baseline else (args.files[:1], args.files[1:])
    if not after_paths:
        raise SproutError("compare_evals.py: give a BEFORE file and at least one AFTER file (or --baseline once "
                          "per AFTER file)")
    if args.baseline and len(args.baseline) != len(args.files):
        raise SproutError(f"--baseline: given {len(args.baseline)} time(s) for {len(args.files)} AFTER file(s); "
                          f"give one per AFTER file, in their order (with --baseline every positional file is an "
                          f"AFTER)")
    resolved = [str(Path(a).resolve()) for a in after_paths]
    if len(set(resolved)) < len(resolved):
        raise SproutError(f"{next(a for a, r in zip(after_paths, resolved) if resolved.count(r) > 1)}: given "
                          f"twice as AFTER; each file is one seed")
    if both := next((b for b in before_paths if str(Path(b).resolve()) in resolved), None):
        raise SproutError(f"{both}: given as a baseline and as an AFTER file")
    before, after = [read_evaluation(b) for b in before_paths], [read_evaluation(a) for a in after_paths]
    seeds = len(after) > 1
    rows = (compare_seed_rows(before if args.baseline else before[0], after) if seeds
            else compare_rows(before[0], after[0]))
    if not rows:
        print(f"{' '.join(before_paths)} and {' '.join(after_paths)} hold no figure in common that is a mean over "
              f"problems or pairs")
        return 1
    if seeds:
        print(f"after: the mean of {len(after)} seeds ({', '.join(after_paths)})")
    if seeds and args.baseline:
        print(f"before: each seed's own baseline ({', '.join(before_paths)}), their mean shown")
    width = 6 * len(after) + 1 if seeds else 0  # the seeds' own figures, when there are several
    print(f"{'figure':36s} {'before':>8s}{'seeds' if seeds else '':>{width}s} {'after':>8s}  change, points "
          f"[95 % interval{' over seeds and problems' if seeds else ''}]")
    for r in rows:
        each = " ".join(f"{100 * v:5.1f}" for v in r.get("seeds", []))
        print(f"{r['figure']:36s} {100 * r['before']:8.1f}{each:>{width}s} {100 * r['after']:8.1f}  "
              f"{change_text(r['change'])}")
    if args.json:
        write_json_atomic(args.json, {"before": before_paths if seeds and args.baseline else before_paths[0],
                                      "after": after_paths, "rows": rows})
    return 0


if __name__ == "__main__":
    run_main(main)
