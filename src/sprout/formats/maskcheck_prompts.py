"""The prompt checker of RL prompt files, behind `scripts/check_loss_mask.py prompts.jsonl`.

Each prompt (`sprout.formats.prompts`) is rendered as the policy sees it,
`sprout.chat.render(prompt, tok, add_generation_prompt=True)`, and checked from its tokens alone:
it ends with the assistant header, and the prompt plus one answer token parses
(`sprout.chat.segment`) into the record's turns in order, after the format's default system
message when the record has none, each decoding to the record's message (compared stripped).
RL trains on the completion only, so no prompt token is a target: the views show every prompt
token untrained. With `seq_len`, prompts of `seq_len` tokens or more (no room to generate) are
listed, not violations. A violation names the file line, prompt id and position.
`format_prompt` and `prompts_html` show rendered prompts with the role headers marked.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass, field

import numpy as np

from sprout.chat import ChatError, Template, render, segment
from sprout.formats.maskcheck_sft import Violations
from sprout.formats.maskcheck_views import CSS_CLASS, html_head, styled, token_runs
from sprout.formats.prompts import read_prompts


@dataclass
class RenderedPrompt:
    line: int
    record: dict
    ids: np.ndarray


@dataclass
class PromptReport(Violations):  # violations: "line N (id) [position P]: what is wrong"
    prompts: int = 0
    tokens: int = 0
    longest: int = 0
    too_long: list = field(default_factory=list)  # (line, id, tokens) with no room to generate
    shown: list = field(default_factory=list)  # the first rendered prompts, for display

    def totals(self) -> dict:
        return {"prompts": self.prompts, "tokens": self.tokens, "longest_prompt": self.longest,
                "mean_prompt_tokens": self.tokens / self.prompts if self.prompts else 0.0,
                "too_long": len(self.too_long), "violations": self.count()}


def holds_prompts(path: str | os.PathLike) -> bool:
    """Whether a JSONL file's first record has a `gold` field (a prompt file, not pairs)."""
    try:
        with open(path, "rb") as f:
            first = next((raw for raw in f if raw.strip()), b"")
        record = json.loads(first)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "gold" in record


def prompt_violations(item: RenderedPrompt, tok, tpl: Template) -> list[str]:
    """What is wrong with one rendered prompt (the rules of the module docstring)."""
    where = f"line {item.line} ({item.record['id']})"
    ids = np.asarray(item.ids)
    header = tpl.headers["assistant"]
    found = []
    if tuple(ids[len(ids) - len(header):].tolist()) != header:
        found.append(f"{where}: does not end with the assistant header")
    begun = np.append(ids, tok.encode("x")[:1])  # one answer token: segment wants a non-empty open turn
    try:
        turns = segment(begun, tpl, allow_open_end=True)[:-1]
    except ChatError as exc:
        return found + [f"{where} position {exc.position}: {exc.detail}"]
    messages = tpl.format.with_default_system(item.record["prompt"])
    if [t.role for t in turns] != [m["role"] for m in messages]:
        return found + [f"{where}: turns {[t.role for t in turns]} are not the record's {[m['role'] for m in messages]}"]
    for k, (t, m) in enumerate(zip(turns, messages)):
        text = tok.decode(ids[t.content_start:t.end].tolist())
        if text.strip() != m["content"].strip():
            found.append(f"{where} position {t.content_start}: turn {k} ({t.role}) decodes to {text[:60]!r}, "
                         f"not the record's {m['content'][:60]!r}")
    return found


def check_prompts(path: str | os.PathLike, tok, tpl: Template, seq_len: int | None = None,
                  show: int = 2, limit: int = 50) -> PromptReport:
    """Render and check every prompt of a prompt file as the policy would see it."""
    report = PromptReport(limit)
    for line, record in enumerate(read_prompts(path), 1):
        report.prompts += 1
        try:
            ids, _ = render(record["prompt"], tok, add_generation_prompt=True)
        except ChatError as exc:
            report.add(f"line {line} ({record['id']}): {exc}")
            continue
        item = RenderedPrompt(line, record, np.asarray(ids))
        report.tokens += len(ids)
        report.longest = max(report.longest, len(ids))
        if seq_len is not None and len(ids) >= seq_len:
            report.too_long.append((line, record["id"], len(ids)))
        for v in prompt_violations(item, tok, tpl):
            report.add(v)
        if len(report.shown) < show:
            report.shown.append(item)
    return report


# ---- showing prompts ---------------------------------------------------------------------

def _prompt_runs(item: RenderedPrompt, tpl: Template, tok) -> list[tuple[int, str]]:
    return token_runs(item.ids, np.zeros(len(item.ids), dtype=np.uint8), tpl, tok)


def _title(item: RenderedPrompt) -> str:
    r = item.record
    return f"prompt {r['id']} (line {item.line}, gold {r['gold']}, level {r['level']}, {len(item.ids)} tokens)"


def format_prompt(item: RenderedPrompt, tpl: Template, tok, color: bool = True) -> str:
    """One rendered prompt as text, role headers highlighted (ANSI) when `color`."""
    parts = [styled(kind, text, color) for kind, text in _prompt_runs(item, tpl, tok)]
    return f"── {_title(item)} " + "─" * 30 + "\n" + "".join(parts) + "\n"


def prompts_html(items, tpl: Template, tok, title: str, totals: dict) -> str:
    """A self-contained HTML page showing rendered prompts with the role headers marked."""
    parts = html_head(title, "body{font-family:sans-serif;margin:2em} .prompt{white-space:pre-wrap;"
                             "font-family:monospace;border:1px solid #ccc;padding:.5em;margin:.5em 0} .trained{background:#b6f2b6}"
                             " .hdr{color:#1f4fbf;font-weight:bold}",
                      "Blue: role headers; the last one opens the answer the policy generates. "
                      "No token of a prompt is trained.", totals)
    for item in items:
        parts.append(f"<h3>{html.escape(_title(item))}</h3><div class='prompt'>")
        parts += [f"<span class='{CSS_CLASS[kind]}'>{html.escape(text)}</span>" for kind, text in _prompt_runs(item, tpl, tok)]
        parts.append("</div>")
    return "".join(parts) + "\n"
