"""The loss-mask checker of packed SFT rows (`sprout.formats.packed_sft`), behind
`scripts/check_loss_mask.py FILE.h5`: every row is re-derived from its tokens and compared with
what is stored. Rules, each violation named by row and position:
- layout (`check_layout`, also run at every SFT start): segment ids 1, 2, ... k then 0 padding;
  position ids restart at 0 per document; padding holds `pad_id` and mask 0; mask values 0/1;
  ids inside the vocabulary; mask column 0 (never a target) is 0;
- each document parses back into turns (`sprout.chat.segment`) in the tokenizer's chat format;
- the stored mask is the template's for those turns (`sprout.chat.mask_for`): 1 exactly on each
  assistant turn's content and the eot closing it; a mask shifted by one position is named so;
- a document may lack its final eot only when it fills its row (an answer cut by `overlong:
  truncate`), and there are as many of those as the prep's `truncated_open` count.
Rows to show are chosen by number (`parse_rows`), at random with a seed (`random_rows`) or as the
rows that show the most (`telling_rows`); `format_row` and `rows_html` show them, and
`prep_warnings` turns the prep's counts of truncated and dropped examples into warnings.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import numpy as np

from sprout.chat import ChatError, Template, ends_turn, mask_for, segment
from sprout.errors import SproutError
from sprout.formats.packed_sft import conversation_spans
from sprout.formats.maskcheck_views import CSS_CLASS, CUT, EOT_LABEL, PROMPT, TRAINED, html_head, spans, styled


@dataclass
class Violation:
    row: int | None
    position: int | None
    message: str

    def __str__(self) -> str:
        where = "file" if self.row is None else f"row {self.row} position {self.position}"
        return f"{where}: {self.message}"


@dataclass
class Violations:
    """The first `limit` violations a check finds (`add`), and how many more it found."""

    limit: int = 50
    violations: list = field(default_factory=list)
    more_violations: int = 0  # beyond the ones kept

    def add(self, violation) -> None:
        if len(self.violations) < self.limit:
            self.violations.append(violation)
        else:
            self.more_violations += 1

    def count(self) -> int:
        return len(self.violations) + self.more_violations


@dataclass
class Report(Violations):
    rows: int = 0
    positions: int = 0
    docs: int = 0
    tokens: int = 0  # non-padding
    trained: int = 0
    assistant_turns: int = 0
    rows_without_trained: int = 0
    truncated_open: int = 0

    def totals(self) -> dict:
        return {"rows": self.rows, "documents": self.docs, "positions": self.positions,
                "tokens": self.tokens, "trained_tokens": self.trained,
                "trained_fraction": self.trained / self.positions if self.positions else 0.0,
                "trained_fraction_of_tokens": self.trained / self.tokens if self.tokens else 0.0,
                "packing_efficiency": self.tokens / self.positions if self.positions else 0.0,
                "assistant_turns": self.assistant_turns, "rows_without_trained_token": self.rows_without_trained,
                "truncated_documents": self.truncated_open,
                "violations": self.count()}

    def flag(self, row, position, message: str) -> None:
        """`add` a Violation at (row, position), either of them None or a numpy integer."""
        self.add(Violation(None if row is None else int(row), None if position is None else int(position), message))


def _first(bad: np.ndarray):
    """(row, col) of the first True in a 2-D boolean array, or None."""
    hits = np.argwhere(bad)
    return (int(hits[0][0]), int(hits[0][1]), len(hits)) if len(hits) else None


def check_layout(a: dict, pad_id: int, vocab_size: int, report: Report) -> None:
    """The layout rules of the module doc (every rule but the documents' parse), vectorised over
    the rows of `a` (the four arrays, or a block of their rows): each failed rule is flagged
    once, at its first row and position, with its count."""
    tokens, mask, seg, pos = a["tokens"], a["loss_mask"], a["segment_ids"], a["position_ids"]
    n, length = tokens.shape
    seg = seg.astype(np.int64)
    checks = []
    checks.append((mask > 1, "loss_mask value other than 0/1"))
    checks.append((tokens >= vocab_size, f"token id outside the vocabulary (size {vocab_size})"))
    nxt, prv = seg[:, 1:], seg[:, :-1]
    ok = (nxt == prv) | ((nxt == prv + 1) & (prv > 0)) | (nxt == 0)
    checks.append((np.c_[seg[:, :1] != 1, ~ok], "segment ids must run 1, 2, ... k then 0 padding"))
    idx = np.broadcast_to(np.arange(length), seg.shape)
    change = np.c_[np.ones((n, 1), bool), seg[:, 1:] != seg[:, :-1]]
    expected_pos = idx - np.maximum.accumulate(np.where(change, idx, 0), axis=1)
    expected_pos[seg == 0] = 0
    checks.append((pos.astype(np.int64) != expected_pos, "position ids must restart at 0 for each document (0 on padding)"))
    checks.append(((seg == 0) & (mask != 0), "trained token in padding"))
    checks.append(((seg == 0) & (tokens != pad_id), f"padding token is not pad id {pad_id}"))
    checks.append((np.c_[mask[:, :1] != 0, np.zeros((n, length - 1), bool)],
                   "loss_mask[0] is 1 but position 0 is never a target (mask not aligned to targets)"))
    for bad, message in checks:
        hit = _first(bad)
        if hit:
            row, col, count = hit
            report.flag(row, col, f"{message}" + (f" ({count} positions in all)" if count > 1 else ""))


def describe_position(turns, p: int) -> str:
    """Where position `p` falls among `turns` (`sprout.chat.segment`), in words for a violation."""
    for k, t in enumerate(turns):
        if p < t.start:
            if k == 0:
                return "the BOS token"
            return f"the text after the end-of-turn token of {turns[k - 1].role} turn {k - 1}"
        if t.start <= p < t.content_start:
            return f"the {t.role} header of turn {k}"
        if t.content_start <= p < t.end:
            return f"{t.role} content of turn {k}"
        if p == t.end and t.closed:
            return f"the end-of-turn token closing {t.role} turn {k}"
    if turns and turns[-1].closed and p > turns[-1].end:
        return f"the text after the end-of-turn token of {turns[-1].role} turn {len(turns) - 1}"
    return "a token outside every turn"


def _check_document(ids, mask, row, start, fills_row, tpl, report: Report) -> None:
    try:
        turns = segment(ids, tpl, allow_open_end=fills_row)
    except ChatError as exc:
        report.flag(row, start + (exc.position or 0), exc.detail)
        return
    report.assistant_turns += sum(t.role == "assistant" for t in turns)
    report.truncated_open += int(not turns[-1].closed)
    expected = mask_for(turns, len(ids))
    diff = np.flatnonzero(expected != mask)
    if not diff.size:
        return
    p = int(diff[0])
    if len(ids) > 1 and np.array_equal(mask[1:], expected[:-1]) and mask[0] == 0:
        report.flag(row, start + p, "loss_mask is shifted one position right (it marks inputs, not targets)")
    elif len(ids) > 1 and np.array_equal(mask[:-1], expected[1:]):
        report.flag(row, start + p, "loss_mask is shifted one position left of the targets")
    elif mask[p]:
        report.flag(row, start + p, f"loss_mask 1 on {describe_position(turns, p)}")
    else:
        what = describe_position(turns, p)
        hint = " (end-of-turn token not supervised)" if "end-of-turn" in what else " (assistant turn not fully covered)"
        report.flag(row, start + p, f"loss_mask 0 on {what}{hint}")


def check_arrays(arrays: dict, tpl: Template, pad_id: int, vocab_size: int,
                 truncated_open: int | None = None, limit: int = 50) -> Report:
    """Check every row of the four SFT arrays; returns totals and violations."""
    tokens, mask, seg = arrays["tokens"], arrays["loss_mask"], arrays["segment_ids"]
    n, length = tokens.shape
    report = Report(limit, rows=n, positions=n * length)
    check_layout(arrays, pad_id, vocab_size, report)
    report.tokens = int((seg != 0).sum())
    report.trained = int(mask.sum())
    report.rows_without_trained = int((mask.sum(axis=1) == 0).sum())
    for r in np.flatnonzero(mask.sum(axis=1) == 0):
        report.flag(r, 0, "row has no trained token")
    for r in range(n):
        for a, b in conversation_spans(seg[r]):
            report.docs += 1
            _check_document(tokens[r, a:b], mask[r, a:b], r, a, b == length, tpl, report)
    if truncated_open is not None and report.truncated_open != truncated_open:
        report.flag(None, None, f"{report.truncated_open} documents end without their end-of-turn token, "
                            f"but the prep recorded {truncated_open} truncated answers")
    report.violations.sort(key=lambda v: (-1, -1) if v.row is None else (v.row, v.position))
    return report


# ---- choosing rows and summarising the prep ---------------------------------------------------

def parse_rows(text: str, n_rows: int, where: str) -> list[int]:
    """"5,17,2328" -> [5, 17, 2328]; a row that is not a number or not in the file is refused."""
    rows = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise SproutError(f"--rows: {part!r} is not a row number (expected e.g. 5,17,2328)")
        if int(part) >= n_rows:
            raise SproutError(f"--rows: row {part} is past the end of {where} ({n_rows:,} rows)")
        rows.append(int(part))
    return rows


def random_rows(n_rows: int, count: int, seed: int) -> list[int]:
    """`count` distinct rows drawn with `seed` (the same rows for the same seed), in file order."""
    rng = np.random.default_rng(seed)
    return sorted(rng.choice(n_rows, size=min(count, n_rows), replace=False).tolist())


def telling_rows(arrays: dict, tpl: Template, count: int) -> list[int]:
    """Up to `count` rows that show the most: a row holding a packing boundary (two documents),
    a trained end-of-turn token and padding together when there is one, and the first row with
    each of the three that no row picked so far shows; then more rows with all three, then
    rows in file order."""
    tokens, mask, seg = arrays["tokens"], arrays["loss_mask"], arrays["segment_ids"]
    boundary = seg.max(axis=1) >= 2
    trained_eot = ((tokens == tpl.eot_id) & (mask == 1)).any(axis=1)
    padding = (seg == 0).any(axis=1)
    all_three = boundary & trained_eot & padding
    picked: list[int] = []
    for has in (all_three, boundary, trained_eot, padding):
        hits = np.flatnonzero(has)
        if len(hits) and not (picked and has[picked].any()):  # not yet shown by a picked row
            picked.append(int(hits[0]))
    more = dict.fromkeys([int(r) for r in np.flatnonzero(all_three)] + list(range(len(tokens))))
    picked += [r for r in more if r not in picked][:max(0, count - len(picked))]
    return picked[:count]


def prep_warnings(counts: dict) -> list[str]:
    """One warning line each for the examples the prep cut short and the ones it dropped
    (from the file's `counts` attribute: `split` totals), or []."""
    split = counts.get("split", {})
    total = split.get("examples_in", 0)
    lines = []
    if split.get("truncated"):
        inside = split.get("truncated_open", 0)
        lines.append(f"warning: {split['truncated']:,} of {total:,} examples were truncated to fit seq_len "
                     f"({inside:,} cut inside an answer, without their end-of-turn token)")
    dropped = {k: v for k, v in split.items()
               if v and (k.startswith("dropped_") or k in ("prompt_too_long", "overlong_dropped", "no_trained_token"))}
    if dropped:
        lines.append(f"warning: {sum(dropped.values()):,} of {total:,} examples were dropped ("
                     + ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items())) + ")")
    return lines


# ---- showing rows ------------------------------------------------------------------------

CUT_LABEL = " ✂ truncated here (no end-of-turn) "


def _row_spans(arrays: dict, r: int, tpl: Template, tok) -> list[tuple[int, int, str, int, int]]:
    """`spans` of packed row `r`, plus a CUT marker after a document that fills the row without
    its end-of-turn token (an answer the prep truncated)."""
    tokens, seg = arrays["tokens"][r], arrays["segment_ids"][r]
    runs = spans(tokens, arrays["loss_mask"][r], seg, tpl, tok)
    if len(tokens) and seg[-1] != 0 and not ends_turn(tokens, tpl):
        runs.append((int(seg[-1]), CUT, CUT_LABEL, len(tokens), len(tokens)))
    return runs


def format_row(arrays: dict, r: int, tpl: Template, tok, color: bool = True) -> str:
    """One row as text, trained tokens highlighted (ANSI) or bracketed as [[...]] without color."""
    lines = [f"── row {r} " + "─" * 40]
    last_doc = None
    for doc, kind, text, _, _ in _row_spans(arrays, r, tpl, tok):
        if doc != last_doc and doc != 0:
            lines.append(f"\n[doc {doc}] ")
        last_doc = doc
        lines.append(styled(kind, text, color))
    return "".join(lines[:1]) + "".join(lines[1:]) + "\n"


def _figure(v) -> str:
    """A totals figure for the page: fractions as percentages with one decimal, counts with commas."""
    if isinstance(v, float):
        return f"{v:.1%}" if 0 <= v <= 1 else f"{v:,.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def rows_html(arrays: dict, rows, tpl: Template, tok, title: str, totals: dict, warnings=()) -> str:
    """A self-contained HTML page showing `rows`: every token in its own box (id on hover),
    trained tokens highlighted, headers, the end-of-turn token and padding named, truncated
    answers marked; the totals rounded and the prep's warnings above."""
    parts = html_head(title, "body{font-family:sans-serif;margin:2em} .row{white-space:pre-wrap;font-family:monospace;"
                             "border:1px solid #ccc;padding:.5em;margin:1em 0;line-height:1.8}"
                             " .t{border:1px solid #ddd;border-radius:2px;margin:0 1px;padding:0 1px} .trained{background:#b6f2b6}"
                             " .hdr{color:#1f4fbf;font-weight:bold} .pad{color:#aaa} .doc{color:#888;font-size:80%}"
                             " .eot{font-weight:bold;color:#7a4b00} .cut{background:#f6c0c0;color:#900;font-weight:bold}"
                             " .warn{color:#900}",
                      f"Each box is one token (hover for its id). Green: trained tokens (loss_mask = 1). Blue: role "
                      f"headers. {html.escape(EOT_LABEL)}: the end-of-turn token (id {tpl.eot_id}). Red: an answer the "
                      f"prep truncated at the end of the row.", totals, warnings, _figure)
    for r in rows:
        ids = arrays["tokens"][r]
        parts.append(f"<h3>row {r}</h3><div class='row'>")
        last_doc = None
        for doc, kind, text, a, b in _row_spans(arrays, r, tpl, tok):
            if doc != last_doc and doc != 0:
                parts.append(f"<span class='doc'>{'<br>' if last_doc else ''}[doc {doc}] </span>")
            last_doc = doc
            if kind in (PROMPT, TRAINED) and text != EOT_LABEL:
                parts += [f"<span class='t {CSS_CLASS[kind]}' title='id {int(ids[p])}'>"
                          f"{html.escape(tok.decode([int(ids[p])]))}</span>" for p in range(a, b)]
            elif text == EOT_LABEL:
                parts.append(f"<span class='t eot {CSS_CLASS[kind]}' title='id {int(ids[a])}: end-of-turn'>"
                             f"{html.escape(text)}</span>")
            else:
                parts.append(f"<span class='{CSS_CLASS[kind]}'>{html.escape(text)}</span>")
        parts.append("</div>")
    return "".join(parts) + "\n"
