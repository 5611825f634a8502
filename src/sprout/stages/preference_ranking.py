"""Ranking accuracy of any checkpoint on a preference file, overall and per `rejected_kind`.

How a pair is scored (`ranking_rule`): a reward model by its own rule (`reward_score_of`: its
score head, or β × the response's summed log-probability); any other LM by β × the response's
summed log-probability given the prompt, no reference (what the reward stage's `score: logprob`
measures at its step 0), or with a reference DPO's implicit reward β × (log p − log p_ref).
The scores are the preference stages' own (`reward.pair_scores`, `reference_logps.compute_logps`,
`losses.preference.implicit_rewards`) on `PreferenceLoader`'s micro-batches: the same rendering,
truncation and batches. A pair is ranked right when chosen scores strictly above rejected (a tie
is wrong, as in the stages). Denominators: `accuracy` over the kept pairs, `by_kind/<kind>/accuracy`
over the kept pairs of that rejected_kind (`by_kind/<kind>/pairs`); pairs longer than seq_len are
counted (`pairs_dropped`), never ranked. Intervals: 95 % Wilson (`wilson_interval`). Every rank
computes the same result.
"""

from __future__ import annotations

import math
from pathlib import Path

from data_loader.preference_batches import PreferenceLoader
from sprout.atomic import sha256_file
from sprout.chat_formats import check_trained_format, format_for
from sprout.checkpoint import checkpoint_tokenizer, init_record
from sprout.errors import SproutError
from sprout.evaluation.statistics import wilson_interval
from sprout.formats.checkpoint_meta import META, reward_score_of
from sprout.formats.preference_pairs import read_preferences
from sprout.losses.preference import implicit_rewards
from sprout.model.load import load_model
from sprout.stages.configs import RewardLossConfig
from sprout.stages.reference_logps import compute_logps
from sprout.stages.reward import pair_scores

DEFAULT_BETA = RewardLossConfig().beta  # β of an LM's log-probability score when none is given


def ranking_rule(meta: dict, beta: float | None = None, reference: str | None = None) -> dict:
    """How the checkpoint of `meta` ranks a pair: a reward model's own rule ({"kind": "head"} or
    {"kind": "logprob", "beta": β}; `beta` and `reference` refused with it), else
    {"kind": "logprob", "beta": β} or, with a reference, {"kind": "implicit", "beta": β,
    "reference": path}; β is `beta` (a finite number above 0), else DEFAULT_BETA."""
    own = reward_score_of(meta)
    if own is not None:
        if beta is not None or reference is not None:
            raise SproutError(f"{Path(meta['path']) / META}: a reward model ranks pairs by its own score "
                              f"({own}); it takes no beta or reference")
        return own
    beta = DEFAULT_BETA if beta is None else beta
    if not 0 < beta < math.inf:
        raise SproutError(f"beta must be a finite number above 0, got {beta}")
    rule = {"kind": "logprob", "beta": float(beta)}
    return {**rule, "kind": "implicit", "reference": str(reference)} if reference else rule


def side_scores(accelerator, model, loader: PreferenceLoader, rule: dict, batch_size: int, ref=None):
    """(chosen [N], rejected [N]) scores of every kept pair of `loader` under `rule`; `ref` the
    reference model of an implicit rule."""
    if rule["kind"] == "implicit":
        logps = compute_logps(accelerator, model, loader, batch_size)
        ref_logps = compute_logps(accelerator, ref, loader, batch_size)
        return implicit_rewards(*logps, *ref_logps, rule["beta"])
    cfg = RewardLossConfig(score=rule["kind"], **({"beta": rule["beta"]} if rule["kind"] == "logprob" else {}))
    return compute_logps(accelerator, model, loader, batch_size, score=lambda m, b: pair_scores(m, b, cfg))


def ranking_figures(outcomes: list[dict], counts: dict) -> dict:
    """accuracy (+ `_ci`; `correct` of `pairs`), mean margin and pair counts over all `outcomes`
    (one per kept pair), and `by_kind/<kind>/{accuracy,accuracy_ci,correct,pairs}` per rejected_kind."""
    def rate(group: list[dict], prefix: str) -> dict:
        right = sum(o["correct"] for o in group)
        return {f"{prefix}accuracy": right / len(group), f"{prefix}accuracy_ci": list(wilson_interval(right, len(group))),
                f"{prefix}correct": right, f"{prefix}pairs": len(group)}

    out = {**rate(outcomes, ""), "margin": sum(o["margin"] for o in outcomes) / len(outcomes),
           "pairs_read": counts["pairs_read"], "pairs_dropped": counts["dropped_too_long"],
           "pairs_truncated": counts["truncated"]}
    for kind in sorted({o["kind"] for o in outcomes} - {None}):
        out.update(rate([o for o in outcomes if o["kind"] == kind], f"by_kind/{kind}/"))
    return out


def rank_preferences(accelerator, checkpoint: str, path: str, *, beta: float | None = None,
                     reference: str | None = None, seq_len: int | None = None, truncation: str = "drop",
                     batch_size: int = 8, tokenizer: str | None = None) -> dict:
    """Rank every pair of the preference file `path` by the checkpoint (`ranking_rule`): the eval
    JSON's body (file, checkpoint, reference, settings, `metrics` of `ranking_figures`, one record
    per kept pair {id, kind, correct, margin} in file order under `pairs`, and the dropped pairs).
    seq_len (default: the model's context), truncation and batch_size (pairs per forward) as the
    preference stages' data.seq_len, data.truncation and batch.micro_pairs."""
    model, meta = load_model(checkpoint, accelerator.device)
    rule = ranking_rule(meta, beta, reference)
    tok = checkpoint_tokenizer(meta, tokenizer)
    check_trained_format(meta.get("template_version"), format_for(tok), str(Path(meta["path"]) / META))
    if tok.vocab_size > model.config.vocab_size:
        raise SproutError(f"{tok.spec}: vocab {tok.vocab_size} does not fit the model's {model.config.vocab_size}")
    seq_len = model.config.max_seq_len if seq_len is None else seq_len
    if not 2 <= seq_len <= model.config.max_seq_len:
        raise SproutError(f"seq_len {seq_len} must be between 2 and the model's max_seq_len {model.config.max_seq_len}")
    if batch_size < 1:
        raise SproutError(f"batch_size must be at least 1, got {batch_size}")
    ref, ref_meta = load_model(reference, accelerator.device) if reference else (None, None)
    if ref_meta and (ref_meta["architecture"] != "lm" or ref_meta["model_config"] != meta["model_config"]
                     or ref_meta.get("tokenizer_fingerprint") != meta.get("tokenizer_fingerprint")):
        raise SproutError(f"{ref_meta['path']}: a reference must be an LM with the checkpoint's model config and tokenizer")
    loader = PreferenceLoader(path, tok, batch_size, seq_len, truncation=truncation, rank=accelerator.process_index,
                              world_size=accelerator.num_processes, shuffle=False)
    chosen, rejected = side_scores(accelerator, model, loader, rule, batch_size, ref)
    kinds = [r.get("rejected_kind") for r in read_preferences(path)]
    outcomes = [{"id": p.id, "kind": kinds[p.line - 1], "correct": c > r, "margin": c - r}
                for p, c, r in zip(loader.pairs, chosen.tolist(), rejected.tolist())]
    return {"task": "preferences", "preferences_file": str(path), "preferences_sha256": sha256_file(path),
            "checkpoint": init_record(meta), "reference": init_record(ref_meta) if ref_meta else None,
            "settings": {"rule": rule, "seq_len": seq_len, "truncation": truncation, "batch_size": batch_size,
                         "processes": accelerator.num_processes, "tokenizer": tok.spec},
            "metrics": ranking_figures(outcomes, loader.counts), "pairs": outcomes,
            "dropped": [{"line": line, "id": pid, "tokens": n} for line, pid, n in loader.dropped]}


def rule_text(rule: dict) -> str:
    if rule["kind"] == "head":
        return "the score head"
    text = f"β {rule['beta']:g} × the summed response log-probability"
    return text + f" minus the reference's ({rule['reference']})" if rule["kind"] == "implicit" else text


def ranking_table(result: dict) -> str:
    """The figures of `rank_preferences`' result: a line on what was ranked, then one row for all
    pairs and one per rejected_kind (pairs, ranked right, accuracy, 95 % interval)."""
    m, s = result["metrics"], result["settings"]
    lines = [f"{m['pairs']} of {m['pairs_read']} pairs ranked ({m['pairs_dropped']} longer than {s['seq_len']} "
             f"tokens dropped, {m['pairs_truncated']} with a shortened prompt) by {rule_text(s['rule'])}",
             "".ljust(24) + "pairs".rjust(7) + "right".rjust(7) + "accuracy".rjust(10) + "95 % interval".rjust(16)]
    rows = [("all", "")] + [(k.split("/")[1], k[:-len("accuracy")]) for k in m
                            if k.startswith("by_kind/") and k.endswith("/accuracy")]
    for title, prefix in rows:
        n, acc, (lo, hi) = m[f"{prefix}pairs"], m[f"{prefix}accuracy"], m[f"{prefix}accuracy_ci"]
        lines.append(title.ljust(24) + f"{n}".rjust(7) + f"{m[prefix + 'correct']}".rjust(7) + f"{acc:.3f}".rjust(10)
                     + f"[{lo:.3f}, {hi:.3f}]".rjust(16))
    return "\n".join(lines)
