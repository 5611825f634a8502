"""Two evaluations of the same problems or pairs, compared: the paired change of each figure.

`change(before, after, figure)` reads two scripts/evaluate.py JSONs: a task's (`problems`, each
problem's score `problem_scores` gives) or a preference ranking's (`pairs`, 1 for a pair ranked
right, else 0; figures `accuracy` and `by_kind/<kind>/accuracy` over that kind's pairs). The
change is the mean over the shared problems of after's score minus before's, with the paired
bootstrap interval (`paired_difference_interval`); files pair only on the same problem ids and
the same generation length (and temperature for pass@k), or the same preference file.
`compare_rows` gives every figure both files hold; `seeds_change` and `compare_seed_rows` the
change to the mean over one setting's seeds, from one baseline or each seed's own, with the
two-level interval over seeds and problems (`seeds_paired_difference_interval`);
scripts/compare_evals.py prints either.
"""

from __future__ import annotations

import json
from pathlib import Path

from sprout.errors import SproutError
from sprout.evaluation.evaluate import problem_scores
from sprout.evaluation.statistics import excludes_zero, paired_difference_interval, seeds_paired_difference_interval

PREFERENCES = "preferences"


def read_evaluation(path: str | Path) -> dict:
    """An evaluate.py JSON: an object with `task` and `metrics`, and `problems` (a task's) or
    `pairs` (a preference ranking's) to pair on; anything else is refused naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SproutError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or "task" not in data or not isinstance(data.get("metrics"), dict):
        raise SproutError(f"{path}: not a scripts/evaluate.py JSON (no `task` and `metrics`)")
    field = "pairs" if data["task"] == PREFERENCES else "problems"
    if not isinstance(data.get(field), list):
        raise SproutError(f"{path}: {field}: missing, so nothing can be paired (an evaluation written before "
                          f"per-{field[:-1]} records; evaluate it again)")
    return data


def _pair_scores(records: list[dict], figure: str) -> dict[str, float] | None:
    """{pair id: 1.0 ranked right, else 0.0} of the pairs `figure` is over, or None."""
    if figure == "accuracy":
        kept = records
    elif figure.startswith("by_kind/") and figure.endswith("/accuracy"):
        kept = [p for p in records if p.get("kind") == figure[len("by_kind/"):-len("/accuracy")]]
    else:
        return None
    return {p["id"]: float(p["correct"]) for p in kept} or None


def paired_scores(a: dict, b: dict, figure: str) -> tuple[dict, dict] | str:
    """({problem or pair id: score} of eval file `a`, of `b`) for `figure`, or why they do not
    pair: problems pair only with the same ids and max_new_tokens (and, for pass@k,
    temperature); preference pairs only from the same file (its sha256)."""
    if a.get("task") == PREFERENCES or b.get("task") == PREFERENCES:
        if a.get("task") != b.get("task"):
            return "a preference ranking against a task's evaluation"
        if a.get("preferences_sha256") != b.get("preferences_sha256"):
            return "different preference files"
        sa, sb = _pair_scores(a.get("pairs") or [], figure), _pair_scores(b.get("pairs") or [], figure)
        if sa is None or sb is None:
            return f"no per-pair {figure}"
        if set(sa) != set(sb):
            return f"different pairs ({len(sa)} vs {len(sb)}, {len(set(sa) & set(sb))} shared)"
        return sa, sb
    pa, pb = a.get("problems"), b.get("problems")
    if not pa or not pb:
        return "no per-problem outcomes"
    settings = ("max_new_tokens", "temperature") if "pass@" in figure else ("max_new_tokens",)
    for key in settings:
        x, y = (a.get("settings") or {}).get(key), (b.get("settings") or {}).get(key)
        if x != y:
            return f"different {key} ({x} vs {y})"
    ids_a, ids_b = [p["id"] for p in pa], [p["id"] for p in pb]
    if len(set(ids_a)) < len(ids_a) or len(set(ids_b)) < len(ids_b):
        return "repeated problem ids"
    if set(ids_a) != set(ids_b):
        return f"different problems ({len(ids_a)} vs {len(ids_b)}, {len(set(ids_a) & set(ids_b))} shared)"
    sa, sb = problem_scores(pa, figure), problem_scores(pb, figure)
    if sa is None or sb is None:
        return f"no per-problem {figure}"
    return dict(zip(ids_a, sa)), dict(zip(ids_b, sb))


def change(before: dict, after: dict, figure: str) -> dict:
    """The change of `figure` from eval file `before` to `after` on the same problems or pairs:
    {diff, ci, real, problems} (fractions; real: the interval excludes 0), or {not_paired: why}."""
    scores = paired_scores(before, after, figure)
    if isinstance(scores, str):
        return {"not_paired": scores}
    diff, lo, hi = paired_difference_interval(*scores)
    return {"diff": diff, "ci": [lo, hi], "real": excludes_zero(lo, hi), "problems": len(scores[0])}


def compare_rows(before: dict, after: dict) -> list[dict]:
    """One row per figure both files hold that is a mean over problems or pairs, in `after`'s
    order: {figure, before, after, change} (`change`'s result)."""
    mb, ma = before.get("metrics", {}), after.get("metrics", {})
    return [{"figure": f, "before": mb[f], "after": ma[f], "change": change(before, after, f)}
            for f in ma if f in mb and is_mean(before, f) and is_mean(after, f)]


def seeds_change(before: dict | list[dict], after: list[dict], figure: str) -> dict:
    """The change of `figure` to the mean over the seeds' files `after` from eval file `before`
    (the one stage every seed started from) or from a list of files, one per seed (each seed's
    own baseline, in `after`'s order), on the same problems: {diff, ci, real, problems, seeds},
    or {not_paired: why}. Each baseline pairs with its seed's file, and the seeds' files with
    each other (a shared `before` pairs them already; per-seed baselines do not)."""
    per_seed = not isinstance(before, dict)
    baselines = before if per_seed else [before] * len(after)
    if len(baselines) != len(after):
        return {"not_paired": f"{len(baselines)} baselines for {len(after)} seeds"}
    scores = [paired_scores(b, a, figure) for b, a in zip(baselines, after)]
    if why := next((s for s in scores if isinstance(s, str)), None):
        return {"not_paired": why}
    if per_seed and (why := next((w for a in after[1:] if isinstance(w := paired_scores(after[0], a, figure), str)),
                                 None)):
        return {"not_paired": f"the seeds do not pair: {why}"}
    diff, lo, hi = seeds_paired_difference_interval([s[0] for s in scores], [s[1] for s in scores])
    return {"diff": diff, "ci": [lo, hi], "real": excludes_zero(lo, hi), "problems": len(scores[0][0]),
            "seeds": len(after)}


def compare_seed_rows(before: dict | list[dict], after: list[dict]) -> list[dict]:
    """`compare_rows` against the mean over the seeds' files `after` (one setting run once per
    seed), from one file or one baseline file per seed (`seeds_change`): {figure, before (the
    baselines' mean), after (the mean), seeds (each seed's figure), change} for every figure
    that every file holds as a mean over problems or pairs, in `after[0]`'s order; per-seed
    baselines add `before_seeds` (each baseline's figure)."""
    one = isinstance(before, dict)
    baselines = [before] if one else before
    rows = []
    for f in after[0].get("metrics", {}):
        if not all(f in d.get("metrics", {}) and is_mean(d, f) for d in [*baselines, *after]):
            continue
        vals, base = [a["metrics"][f] for a in after], [b["metrics"][f] for b in baselines]
        row = {"figure": f, "before": sum(base) / len(base), "after": sum(vals) / len(vals), "seeds": vals,
               "change": seeds_change(before, after, f)}
        if not one:
            row["before_seeds"] = base
        rows.append(row)
    return rows


def is_mean(data: dict, figure: str) -> bool:
    """Whether `figure` of an evaluation is a mean of per-problem (per-pair) scores it records
    (not a count, a length or an interval)."""
    if data.get("task") == PREFERENCES:
        return _pair_scores(data.get("pairs") or [], figure) is not None
    return bool(data.get("problems")) and problem_scores(data["problems"], figure) is not None
