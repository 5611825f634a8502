"""The report card of a pipeline run: every stage's checkpoint compared on one table.

`write_report_card(preset, state)` writes, for the stages `sprout.pipeline.runner` recorded done,
<out>/report.md (the table, the held-out evaluation, plots, answers, wall time and tokens/s),
<out>/report/report_card.json (the table's figures as read, and `held_out`), <out>/report/*.png
and <out>/report/answers.json (each policy's greedy answers, kept with its weights' sha256 so a
later report reuses them). Every figure is read back, never recomputed: from a train stage's
last eval record (`val_bpb`; SFT `val_loss`, masked loss per trained token; reward `val_accuracy`
and DPO `val_rewards/accuracies`, pairs ranked right / pairs, with the Wilson 95 % interval of
round(accuracy × `val_pairs`) of `val_pairs`) or from scripts/evaluate.py's JSON of the test split
(pass@1, pass@8 and greedy accuracy; `completions/mean_length`, completion tokens / (prompts × n)). Tokens/s is
the mean of the training records' `tokens_per_s`; wall time is the runner's, summed over a
stage's segments. A missing figure is a dash, a column no stage has is left out, and the
held-out section (test with dev beside it, strict and flexible, each seed and their mean) is
`sprout.pipeline.report_held_out`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from sprout.atomic import atomic_path, atomic_write, make_dir, write_json_atomic
from sprout.engine.metrics import METRICS, duration, read_metrics
from sprout.engine.report import code, hardware, hardware_line, text
from sprout.pipeline.report_held_out import eval_files, evaluated_stages, held_out_section, rate_interval, seed_groups
from sprout.stages.configs import SAMPLE_PROMPTS

REPORT_DIR = "report"
ANSWER_TOKENS = 64
# column: (title, role that logs it or None for any, metrics key) read from the last eval record
EVAL_COLUMNS = {"val_bpb": ("val bpb", None, "val_bpb"),
                "sft_val_loss": ("SFT val masked loss", "sft", "val_loss"),
                "rm_val_accuracy": ("RM val accuracy", "reward", "val_accuracy"),
                "dpo_val_accuracy": ("DPO val reward accuracy", "dpo", "val_rewards/accuracies")}
# column: (title, eval task, metric in its JSON)
TASK_COLUMNS = {"arith_pass@1": ("arith pass@1", "arith", "pass@1"),
                "arith_pass@8": ("arith pass@8", "arith", "pass@8"),
                "arith_greedy": ("arith greedy accuracy", "arith", "greedy/accuracy"),
                "gsm8k_pass@1": ("GSM8K pass@1", "gsm8k", "pass@1"),
                "gsm8k_greedy": ("GSM8K greedy accuracy", "gsm8k", "greedy/accuracy"),
                "mean_length": ("mean completion length", "arith", "completions/mean_length")}
RATE_COLUMNS = ("rm_val_accuracy", "dpo_val_accuracy")  # rates over `val_pairs`: a Wilson interval in the JSON
# role: the held-out figures shown first eval -> last eval (and every `<first>/<group>` logged)
PREFERENCE_FIGURES = {"reward": ("val_accuracy", "val_margin"),
                      "dpo": ("val_rewards/accuracies", "val_rewards/margins")}
PLOTS = {"reward": ("reward_model.png", ["accuracy", "val_accuracy", "margin"]),
         "dpo": ("dpo.png", ["rewards/margins", "val_rewards/margins", "logps/chosen", "val_logps/chosen"]),
         "rl": ("rl.png", ["reward", "objective/kl", "kl", "entropy", "completions/mean_length"])}


def stage_rows(preset, state: dict) -> list[dict]:
    """One row per done train stage: its figures (None where it has none), step, throughput."""
    rows = []
    for s in preset.stages:
        rec = state["stages"].get(s.name) or {}
        if s.kind != "train" or rec.get("status") != "done":
            continue
        records = read_metrics(preset.out_of(s) / METRICS)
        evals = [r for r in records if "event" not in r and any(k.startswith("val_") for k in r)]
        last = evals[-1] if evals else {}
        train = [r for r in records if "tokens_per_s" in r]
        row = {"stage": s.name, "role": s.role, "step": rec["outputs"]["step"],
               "weights_sha256": rec["outputs"]["weights_sha256"], "wall_s": rec.get("wall_s"),
               "tokens_per_s": sum(r["tokens_per_s"] for r in train) / len(train) if train else None}
        for col, (_, role, key) in EVAL_COLUMNS.items():
            row[col] = last.get(key) if role in (None, s.role) else None
            if col in RATE_COLUMNS and row[col] is not None and last.get("val_pairs"):
                row[f"{col}_ci"] = rate_interval(row[col], last["val_pairs"])
        tasks = eval_files(preset, s.name, state)
        for col, (_, task, key) in TASK_COLUMNS.items():
            metrics = (tasks.get(task) or {}).get("test", {}).get("metrics", {})
            row[col] = metrics.get(key)
            if metrics.get(f"{key}_ci") is not None:
                row[f"{col}_ci"] = metrics[f"{key}_ci"]
        rows.append(row)
    return rows


def preference_lines(preset, rows: list[dict]) -> list[str]:
    """The reward-model and DPO stages' held-out figures, first eval -> last eval: accuracy (pairs
    ranked right / pairs, with the last eval's Wilson interval), margin (mean over pairs) and, for
    a reward model, accuracy per source and per kind of rejected answer (`rejected_<kind>`)."""
    lines = []
    for row in rows:
        keys = PREFERENCE_FIGURES.get(row["role"])
        if keys is None:
            continue
        records = read_metrics(preset.out_of(preset.stage(row["stage"])) / METRICS)
        evals = [r for r in records if keys[0] in r]
        if not evals:
            continue
        first, last = evals[0], evals[-1]
        lines.append(f"{row['stage']} (held-out pairs, step {first['step']} -> {last['step']}):")
        for k in list(keys) + sorted(k for k in last if k.startswith(keys[0] + "/")):
            den = last.get("val_pairs" + k[len(keys[0]):]) if k.startswith(keys[0]) else None
            of = f"   (of {den:,.0f} pairs)" if den is not None else ""
            if den:  # an accuracy: its Wilson interval
                of += "   95 % [{:.3f}, {:.3f}]".format(*rate_interval(last[k], den))
            lines.append(f"  {k:28s} {first.get(k, float('nan')):8.3f} -> {last[k]:8.3f}{of}")
    return lines


def _fmt(value, col: str) -> str:
    if value is None:
        return "–"
    if col == "mean_length":
        return f"{value:.1f}"
    return f"{value:.4f}" if col in ("val_bpb", "sft_val_loss") else f"{value:.3f}"


def _figure(width: float, panels: int = 1):
    """(figure, its row of `panels` axes), on matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, panels, figsize=(width, 3.2), dpi=110, squeeze=False)
    return fig, axes[0]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def _label_step_panel(ax, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_loss_curves(runs: dict[str, list[dict]], path: Path) -> Path | None:
    """One panel per train stage: train loss (line) and val loss (points) against step."""
    if not runs:
        return None
    fig, axes = _figure(3.6 * len(runs), len(runs))
    for ax, (name, records) in zip(axes, runs.items()):
        train = [(r["step"], r["loss"]) for r in records if "loss" in r and "event" not in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if train:
            ax.plot(*zip(*train), lw=1.2, label="train")
        if val:
            ax.plot(*zip(*val), "o-", ms=3, label="val")
        _label_step_panel(ax, name)
    return _save(fig, path)


def plot_metrics(runs: dict[str, list[dict]], keys: list[str], path: Path) -> Path | None:
    """One panel per metric key that any of `runs` logs, a line per run."""
    keys = [k for k in keys if any(k in r for recs in runs.values() for r in recs)]
    if not keys:
        return None
    fig, axes = _figure(3.6 * len(keys), len(keys))
    for ax, key in zip(axes, keys):
        for name, records in runs.items():
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), "o-" if key.startswith("val_") else "-", ms=3, lw=1.2, label=name)
        _label_step_panel(ax, key)
    return _save(fig, path)


def _error_bars(rows: list[dict], col: str) -> list[list[float]]:
    """[[below], [above]] each row's figure: its `_ci` interval around it (0 without one)."""
    spans = [(r[col] - r[f"{col}_ci"][0], r[f"{col}_ci"][1] - r[col]) if r.get(f"{col}_ci") and r[col] is not None
             else (0.0, 0.0) for r in rows]
    return [[max(0.0, s[0]) for s in spans], [max(0.0, s[1]) for s in spans]]


def plot_pass_at_1(rows: list[dict], path: Path) -> Path | None:
    """Arithmetic and GSM8K pass@1 of each evaluated stage, a bar each, with its 95 % interval."""
    rows = [r for r in rows if r["arith_pass@1"] is not None or r["gsm8k_pass@1"] is not None]
    if not rows:
        return None
    fig, (ax,) = _figure(1.6 * len(rows) + 2)
    xs = range(len(rows))
    for shift, col, label in ((-0.2, "arith_pass@1", "arith pass@1"), (0.2, "gsm8k_pass@1", "GSM8K pass@1")):
        ax.bar([x + shift for x in xs], [r[col] or 0 for r in rows], 0.4, yerr=_error_bars(rows, col), capsize=3,
               label=label)
    ax.set_xticks(list(xs), [r["stage"] for r in rows])
    ax.set_ylabel("pass@1")
    ax.legend(fontsize=7)
    return _save(fig, path)


def greedy_answers(preset, rows: list[dict], cache_path: Path, prompts=SAMPLE_PROMPTS) -> dict:
    """{stage: {weights_sha256, answers}} for every policy row (not reward models): the prompts
    answered greedily (`ChatSession`, temperature 0, at most ANSWER_TOKENS tokens); reused from
    the cache when the weights and prompts are unchanged."""
    from sprout.model.chat_session import ChatSession, load_chat_model

    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    result = {}
    for row in rows:
        if row["role"] == "reward":
            continue
        old = cache.get(row["stage"]) or {}
        if old.get("weights_sha256") == row["weights_sha256"] and old.get("prompts") == list(prompts):
            result[row["stage"]] = old
            continue
        model, tok, _ = load_chat_model(preset.out_of(preset.stage(row["stage"])))
        answers = []
        for prompt in prompts:
            session = ChatSession(model, tok, max_new_tokens=ANSWER_TOKENS, temperature=0.0)
            answers.append(session.send(prompt).text)
        result[row["stage"]] = {"weights_sha256": row["weights_sha256"], "prompts": list(prompts), "answers": answers}
    write_json_atomic(cache_path, result)
    return result


def write_report_card(preset, state: dict, *, answers: bool = True, log=None) -> Path:
    """Write report.md, report/report_card.json and the plots for the done stages; returns report.md.
    With `log` (print), the tables, the preference figures and the answers are shown there too."""
    folder = make_dir(preset.out / REPORT_DIR)
    rows = stage_rows(preset, state)
    runs = {r["stage"]: read_metrics(preset.out_of(preset.stage(r["stage"])) / METRICS) for r in rows}
    by_role = lambda roles: {n: recs for n, recs in runs.items() if preset.stage(n).role in roles}  # noqa: E731
    plots = {"loss curves": plot_loss_curves(runs, folder / "loss_curves.png"),
             "reward model": plot_metrics(by_role({"reward"}), PLOTS["reward"][1], folder / PLOTS["reward"][0]),
             "DPO": plot_metrics(by_role({"dpo"}), PLOTS["dpo"][1], folder / PLOTS["dpo"][0]),
             "RL": plot_metrics(by_role({"ppo", "grpo"}), PLOTS["rl"][1], folder / PLOTS["rl"][0]),
             "pass@1 by stage": plot_pass_at_1(rows, folder / "pass_at_1.png")}
    said = greedy_answers(preset, rows, folder / "answers.json") if answers else {}
    held_out, held_out_data = held_out_section(evaluated_stages(preset, state), seed_groups(preset))
    write_json_atomic(folder / "report_card.json", {"rows": rows, "held_out": held_out_data})

    columns = {**{c: t for c, (t, _, _) in EVAL_COLUMNS.items()}, **{c: t for c, (t, _, _) in TASK_COLUMNS.items()}}
    columns = {c: t for c, t in columns.items() if any(r[c] is not None for r in rows)}  # no column of dashes only
    lines = [f"# Report card: {preset.out}", "",
             f"Preset {code(preset.path)}; one row per stage checkpoint (step, weights sha256). Figures are read "
             f"from each stage's metrics.jsonl (last eval) and scripts/evaluate.py's JSON (test split, strict "
             f"reading); – where a stage has none.",
             "", "| stage | step | " + " | ".join(columns.values()) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in columns) + " |"]
    for r in rows:
        lines.append(f"| {r['stage']} | {r['step']} | " + " | ".join(_fmt(r[c], c) for c in columns) + " |")
    lines += ["", f"## Wall time and throughput ({hardware_line(hardware())})", "", "| stage | kind | wall time | peak RSS | train tokens/s |",
              "| --- | --- | ---: | ---: | ---: |"]
    tps = {r["stage"]: r["tokens_per_s"] for r in rows}
    for s in preset.stages:
        rec = state["stages"].get(s.name) or {}
        if rec.get("status") == "done":
            t = tps.get(s.name)
            rss = rec.get("peak_rss_mb")
            lines.append(f"| {s.name} | {s.kind} | {duration(rec.get('wall_s') or 0)} | "
                         f"{f'{rss / 1024:.2f} GiB' if rss else '–'} | {f'{t:,.0f}' if t is not None else '–'} |")
    shown = lines[3:]  # the two tables
    if held_out:
        lines += [""] + held_out
    prefs = preference_lines(preset, rows)
    if prefs:
        lines += ["", "## Preferences, held out", "", "```", *prefs, "```"]
    for title, path in plots.items():
        if path is not None:
            lines += ["", f"## {title}", "", f"![{title}]({REPORT_DIR}/{path.name})"]
    answered = []
    if said:
        answered = ["", f"## The same prompts, answered greedily (at most {ANSWER_TOKENS} tokens)"]
        for i, prompt in enumerate(SAMPLE_PROMPTS):
            answered += ["", f"> {text(prompt)}", ""]
            answered += [f"- **{stage}**: {text(a['answers'][i], one_line=True) or '(empty)'}"
                         for stage, a in said.items()]
        lines += answered
    if log is not None:
        log("\n".join(shown + ([""] + held_out if held_out else []) + [""] + prefs + answered))
    path = preset.out / "report.md"
    with atomic_write(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
