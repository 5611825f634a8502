"""The views shared by the loss-mask checkers (`maskcheck_sft`, `maskcheck_pairs`,
`maskcheck_prompts`): a token sequence cut into runs of one kind (padding, header, prompt,
trained, a truncation mark), shown in the terminal (ANSI colour, or trained runs as [[text]]
without it) or on a self-contained HTML page (`html_head`). A role header is marked by its
token ids, the end-of-turn token and a one-token header by name."""

from __future__ import annotations

import html

import numpy as np

from sprout.chat import Template

PAD, HEADER, PROMPT, TRAINED, CUT = range(5)
_ANSI = {PAD: "\x1b[2m", HEADER: "\x1b[1;34m", PROMPT: "", TRAINED: "\x1b[30;42m", CUT: "\x1b[1;31m"}
CSS_CLASS = {PAD: "pad", HEADER: "hdr", PROMPT: "prompt", TRAINED: "trained", CUT: "cut"}
EOT_LABEL = "<end-of-turn>"


def spans(tokens, mask, seg, tpl: Template, tok, eot_label: str = EOT_LABEL) -> list[tuple[int, int, str, int, int]]:
    """(doc, kind, text, start, end) runs for one row: headers by their role names, the
    end-of-turn token as `eot_label`, padding as its length."""
    names = {tpl.eot_id: eot_label}
    kind = np.where(seg == 0, PAD, np.where(mask == 1, TRAINED, PROMPT))
    if tpl.bos:  # the BOS token shows by its piece, as a header
        names[tpl.bos[0]] = tpl.format.bos
        kind[(tokens == tpl.bos[0]) & (kind == PROMPT)] = HEADER
    for role, h in tpl.headers.items():  # mark header tokens
        if len(h) == 1:
            names[h[0]] = f"<|{role}|>"
        if len(tokens) < len(h):
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens, len(h))
        for i in np.flatnonzero((windows == np.asarray(h)).all(axis=1)):
            kind[i:i + len(h)] = np.where(kind[i:i + len(h)] == TRAINED, TRAINED, HEADER)
    runs = []
    cut = np.flatnonzero((np.diff(kind) != 0) | (np.diff(seg.astype(np.int64)) != 0)
                         | np.isin(tokens[1:], list(names)) | np.isin(tokens[:-1], list(names))) + 1
    for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, len(tokens)].tolist()):
        piece = tokens[a:b]
        if kind[a] == PAD:
            text = f"<pad×{b - a}>"
        elif len(piece) == 1 and int(piece[0]) in names:
            text = names[int(piece[0])]
        else:
            text = tok.decode(piece.tolist())
        runs.append((int(seg[a]), int(kind[a]), text, a, b))
    return runs


def token_runs(tokens, mask, tpl: Template, tok) -> list[tuple[int, str]]:
    """(kind, text) runs of one unpacked token sequence (pairs and prompts show theirs with it);
    the end-of-turn token shown by its text marker."""
    seg = np.ones(len(tokens), dtype=np.int64)
    return [(kind, text) for _, kind, text, _, _ in spans(tokens, mask, seg, tpl, tok, tpl.format.eot)]


def styled(kind: int, text: str, color: bool = True) -> str:
    """One run as terminal text: in its kind's ANSI colour, or without color trained runs as [[text]]."""
    if color:
        return f"{_ANSI[kind]}{text}\x1b[0m" if _ANSI[kind] else text
    return f"[[{text}]]" if kind == TRAINED else text


def html_head(title: str, css: str, intro: str, totals: dict, warnings=(), figure=str) -> list[str]:
    """The opening of a self-contained check page: `title`, the style sheet `css`, a heading,
    the `intro` paragraph (HTML), the `warnings` and a table of `totals` (as `figure` gives them)."""
    return [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title><style>", css, "</style>",
            f"<h1>{html.escape(title)}</h1><p>{intro}</p>", *[f"<p class='warn'>{html.escape(w)}</p>" for w in warnings],
            "<table>", *[f"<tr><td>{html.escape(k)}</td><td>{html.escape(figure(v))}</td></tr>" for k, v in totals.items()],
            "</table>"]
