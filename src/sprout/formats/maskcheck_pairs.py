"""The loss-mask checker of preference pairs, behind `scripts/check_loss_mask.py FILE.jsonl`.

Each pair is rendered by `sprout.formats.preference_tokens.fit_pair` (the pair loader's code,
with the same `seq_len` and `truncation`) and checked from its tokens alone:
- each side parses into turns (`sprout.chat.segment`) and ends with an assistant turn;
- its mask is 1 exactly on that turn's content and the eot closing it (a 1 or a 0 out of place
  is named by what it sits on), and those tokens decode to the record's answer and the eot;
- both sides' prompt tokens are identical and decode to the record's prompt, minus the exchanges
  `keep_end` removed, after the format's default system message when the record has none;
- each side fits `seq_len`.
Pairs the loader would drop or shorten are listed, not violations. A violation names the file
line, pair id, side and position. `format_pair` and `pairs_html` show both sides of a pair.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field

import numpy as np

from sprout.chat import ChatError, Template, segment
from sprout.errors import SproutError
from sprout.formats.maskcheck_sft import Violations, describe_position
from sprout.formats.maskcheck_views import CSS_CLASS, html_head, styled, token_runs
from sprout.formats.preference_tokens import SIDES, PairTokens, fit_pair, records_to_render


@dataclass
class PairViolation:
    line: int
    id: str
    side: str | None  # "chosen", "rejected", or None for the pair as a whole
    position: int | None
    message: str

    def __str__(self) -> str:
        where = f"line {self.line} ({self.id})"
        if self.side:
            where += f" {self.side}"
        if self.position is not None:
            where += f" position {self.position}"
        return f"{where}: {self.message}"


@dataclass
class PairReport(Violations):  # violations: PairViolation
    pairs_read: int = 0
    pairs_checked: int = 0
    trained: int = 0  # response tokens over both sides
    tokens: int = 0
    dropped: list = field(default_factory=list)  # (line, id, longest side) the loader would drop
    truncated: list = field(default_factory=list)  # (line, id, prompt messages removed)
    shown: list = field(default_factory=list)  # the first checked pairs, for display

    def totals(self) -> dict:
        return {"pairs_read": self.pairs_read, "pairs_checked": self.pairs_checked,
                "dropped_too_long": len(self.dropped), "truncated": len(self.truncated),
                "tokens": self.tokens, "trained_tokens": self.trained,
                "trained_fraction_of_tokens": self.trained / self.tokens if self.tokens else 0.0,
                "violations": self.count()}


def _expected_prompt(record: dict, turns_dropped: int) -> list:
    """The prompt messages left after `keep_end` removed `turns_dropped` messages."""
    prompt = record["prompt"]
    first = 1 if prompt[0]["role"] == "system" else 0
    return prompt[:first] + prompt[first + turns_dropped:]


def _side_violations(ids, mask, answer: str, tok, tpl: Template, seq_len: int):
    """(position, message) for one side, and its turns when they parse."""
    out = []
    if len(ids) != len(mask):
        return [(None, f"{len(ids)} ids but {len(mask)} mask values")], None
    if len(ids) > seq_len:
        out.append((seq_len, f"{len(ids)} tokens, longer than seq_len {seq_len} (cut by the context)"))
    if np.any((mask != 0) & (mask != 1)):
        out.append((int(np.flatnonzero((mask != 0) & (mask != 1))[0]), "mask value other than 0/1"))
    try:
        turns = segment(ids, tpl)
    except ChatError as exc:
        return out + [(exc.position, exc.detail)], None
    last = turns[-1]
    if last.role != "assistant":
        return out + [(last.start, f"the last turn is {last.role}, not the response")], None
    expected = np.zeros(len(ids), dtype=np.uint8)
    expected[last.content_start:last.end + 1] = 1
    diff = np.flatnonzero(expected != mask)
    if diff.size:
        p = int(diff[0])
        what = describe_position(turns, p)
        if mask[p]:
            hint = " (an earlier assistant turn of the prompt)" if p < last.start and "assistant" in what else ""
            out.append((p, f"mask 1 on {what}{hint}"))
        else:
            out.append((p, f"mask 0 on {what} (the response is not fully covered)"))
        return out, turns
    trained = np.asarray(ids)[mask == 1]
    text = tok.decode(trained[:-1].tolist())
    if text != answer or int(trained[-1]) != tpl.eot_id:
        out.append((last.content_start, f"the trained tokens decode to {text[:60]!r}, not the answer "
                                        f"{answer[:60]!r} and its end-of-turn token"))
    return out, turns


def pair_violations(pair: PairTokens, record: dict, tok, tpl: Template, seq_len: int) -> list[PairViolation]:
    """Every violation of the module docstring's rules for one rendered pair."""
    found = []
    add = lambda side, pos, msg: found.append(PairViolation(pair.line, pair.id, side, pos, msg))  # noqa: E731
    turns = {}
    for side in SIDES:
        ids, mask = getattr(pair, side), getattr(pair, f"{side}_mask")
        problems, turns[side] = _side_violations(np.asarray(ids), np.asarray(mask), record[side][0]["content"],
                                                 tok, tpl, seq_len)
        for pos, msg in problems:
            add(side, pos, msg)
    if turns["chosen"] is None or turns["rejected"] is None:
        return found
    prompts = {s: np.asarray(getattr(pair, s))[:turns[s][-1].content_start] for s in SIDES}
    n = min(len(prompts["chosen"]), len(prompts["rejected"]))
    diff = np.flatnonzero(prompts["chosen"][:n] != prompts["rejected"][:n])
    if diff.size or len(prompts["chosen"]) != len(prompts["rejected"]):
        add(None, int(diff[0]) if diff.size else n,
            f"the prompt tokens of chosen ({len(prompts['chosen'])} tokens) and rejected "
            f"({len(prompts['rejected'])} tokens) differ")
        return found
    want = tpl.format.with_default_system(_expected_prompt(record, pair.turns_dropped))
    got = turns["chosen"][:-1]
    ids = np.asarray(pair.chosen)
    if [t.role for t in got] != [m["role"] for m in want]:
        add(None, 0, f"the prompt renders as turns {[t.role for t in got]}, the record has {[m['role'] for m in want]}")
        return found
    for k, (t, m) in enumerate(zip(got, want)):
        text = tok.decode(ids[t.content_start:t.end].tolist())
        if text != m["content"]:
            add(None, t.content_start, f"prompt turn {k} ({t.role}) decodes to {text[:60]!r}, "
                                       f"not the record's {m['content'][:60]!r}")
            break
    return found


def check_preferences(path: str | os.PathLike, tok, tpl: Template, seq_len: int, truncation: str = "drop",
                      show: int = 2, limit: int = 50) -> PairReport:
    """Render and check every pair of a preference file as the loader would see it."""
    report = PairReport(limit)
    for line, record, encoded in records_to_render(path, tok):
        report.pairs_read += 1
        try:
            pair, longest = fit_pair(record, encoded, seq_len, truncation, f"{path}:{line}", line)
        except SproutError as exc:  # the template refused it, or the prompts render differently
            report.add(PairViolation(line, record["id"], None, None, str(exc).removeprefix(f"{path}:{line}: ")))
            continue
        if pair is None:
            report.dropped.append((line, record["id"], longest))
            continue
        if pair.turns_dropped:
            report.truncated.append((line, record["id"], pair.turns_dropped))
        report.pairs_checked += 1
        report.tokens += len(pair.chosen) + len(pair.rejected)
        report.trained += int(pair.chosen_mask.sum() + pair.rejected_mask.sum())
        for v in pair_violations(pair, record, tok, tpl, seq_len):
            report.add(v)
        if len(report.shown) < show:
            report.shown.append(pair)
    return report


# ---- showing pairs -----------------------------------------------------------------------

def _side_runs(pair: PairTokens, side: str, tpl: Template, tok) -> list[tuple[int, str]]:
    return token_runs(np.asarray(getattr(pair, side)), np.asarray(getattr(pair, f"{side}_mask")), tpl, tok)


def _title(pair: PairTokens) -> str:
    cut = f", {pair.turns_dropped} prompt messages removed by keep_end" if pair.turns_dropped else ""
    return f"pair {pair.id} (line {pair.line}{cut})"


def format_pair(pair: PairTokens, tpl: Template, tok, color: bool = True) -> str:
    """Both sides as text, trained tokens highlighted (ANSI) or bracketed as [[...]] without color."""
    lines = [f"── {_title(pair)} " + "─" * 30]
    for side in SIDES:
        lines.append(f"[{side}] " + "".join(styled(kind, text, color) for kind, text in _side_runs(pair, side, tpl, tok)))
    return "\n".join(lines) + "\n"


def pairs_html(pairs, tpl: Template, tok, title: str, totals: dict) -> str:
    """A self-contained HTML page showing both sides of `pairs` with trained tokens highlighted."""
    parts = html_head(title, "body{font-family:sans-serif;margin:2em} .side{white-space:pre-wrap;"
                             "font-family:monospace;border:1px solid #ccc;padding:.5em;margin:.5em 0} .trained{background:#b6f2b6}"
                             " .hdr{color:#1f4fbf;font-weight:bold} .pad{color:#aaa} .label{color:#888}",
                      "Green: trained tokens (the response and its end-of-turn token). Blue: role headers.", totals)
    for pair in pairs:
        parts.append(f"<h3>{html.escape(_title(pair))}</h3>")
        for side in SIDES:
            parts.append(f"<div class='side'><span class='label'>[{side}] </span>")
            parts += [f"<span class='{CSS_CLASS[kind]}'>{html.escape(text)}</span>"
                      for kind, text in _side_runs(pair, side, tpl, tok)]
            parts.append("</div>")
    return "".join(parts) + "\n"
