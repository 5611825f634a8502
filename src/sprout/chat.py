"""The chat template: one conversation -> (ids, loss_mask), and back again.

Every stage that turns messages into tokens (SFT prep, preference and RL batches, the
chat CLI) goes through `render`, so training and inference see the same bytes.

Layout:

    <|system|>\\n{system}<eot><|user|>\\n{question}<eot><|assistant|>\\n{answer}<eot>...

- tiktoken r50k_base has no spare special tokens, so the role headers are the plain text
  `<|system|>\\n`, `<|user|>\\n`, `<|assistant|>\\n`, encoded as ordinary text (each header
  encoded on its own, so its ids never merge with the content's). `<|endoftext|>` (the
  tokenizer's eot id) closes every turn.
- SentencePiece models trained here carry `<|system|>`, `<|user|>`, `<|assistant|>` as
  control symbols: the header is that single id; `<|endoftext|>` closes every turn.

`loss_mask[i] == 1` means token i is a training *target*: the tokens of every assistant
turn's content and the eot that closes it (so the model learns to stop). Role headers,
system and user text, and (later) padding are 0. Trainers feed ids[:-1] and score
ids[1:] with mask[1:]. Because the header is never trained, the first token of a packed
document is never a target, so no loss crosses a document boundary.

Content may not contain the marker strings themselves (a plain-text `<|user|>` inside a
message would be indistinguishable from a real turn). `segment` parses a rendered
sequence back into turns; the loss-mask checker relies on it. Reasoning answers use
`<think>...</think><answer>N</answer>`, written and parsed by `sprout.answers`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from sprout.errors import SproutError
from sprout.tokenizer import EOT

TEMPLATE_VERSION = "sprout-chat-v1"
ROLES = ("system", "user", "assistant")
MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
EOT_MARKER = EOT  # closes every turn
RESERVED = (*MARKERS.values(), EOT_MARKER)


class ChatError(SproutError):
    """A conversation that the template refuses (unknown role, empty content, order...)."""

    def __init__(self, message: str, reason: str, index: int | None = None, position: int | None = None):
        super().__init__(message)
        self.reason = reason  # short key used by prep scripts to count drops
        self.index = index  # the offending message, when there is one
        self.position = position  # the offending token (from `segment`)
        self.detail = message

    def __str__(self) -> str:
        return self.detail if self.position is None else f"position {self.position}: {self.detail}"


@dataclass(frozen=True)
class Template:
    """The token-level constants of the template for one tokenizer."""

    kind: str  # "special" (SentencePiece control ids) or "text" (plain-text markers)
    headers: dict  # role -> tuple of header ids
    eot_id: int

    def to_json(self) -> dict:
        return {"version": TEMPLATE_VERSION, "kind": self.kind, "eot_id": self.eot_id,
                "headers": {r: list(h) for r, h in self.headers.items()}}


_TEMPLATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def template_for(tok) -> Template:
    """Header ids and eot for `tok`: control ids when it has all three role pieces."""
    cached = _TEMPLATES.get(tok)
    if cached is not None:
        return cached
    special = {r: tok.special_id(m) for r, m in MARKERS.items()}
    present = [r for r, i in special.items() if i is not None]
    if len(present) == len(ROLES):
        tpl = Template("special", {r: (int(i),) for r, i in special.items()}, int(tok.eot_id))
    elif not present:
        tpl = Template("text", {r: tuple(tok.encode(f"{m}\n")) for r, m in MARKERS.items()}, int(tok.eot_id))
    else:
        raise SproutError(f"tokenizer {tok.spec}: has role pieces {present} but not all of {list(MARKERS.values())}")
    _TEMPLATES[tok] = tpl
    return tpl


def validate(messages, add_generation_prompt: bool = False) -> None:
    """Raise `ChatError` unless `messages` is [system?] user, assistant, user, ... ."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("a conversation must be a non-empty list of messages", "empty_conversation")
    roles = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatError(f"message {i}: must be a dict with 'role' and 'content'", "bad_message")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise ChatError(f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})", "unknown_role")
        if not isinstance(content, str) or not content.strip():
            raise ChatError(f"message {i} ({role}): empty content", "empty_content")
        for marker in RESERVED:
            if marker in content:
                raise ChatError(f"message {i} ({role}): content contains the reserved marker {marker}", "reserved_marker")
        roles.append(role)
    first = 1 if roles[0] == "system" else 0
    if first == len(roles):
        raise ChatError("a conversation needs at least one user message", "no_user")
    for i in range(first, len(roles)):
        want = "user" if (i - first) % 2 == 0 else "assistant"
        if roles[i] != want:
            where = "system is allowed only as the first message" if roles[i] == "system" else "roles must alternate user/assistant"
            raise ChatError(f"message {i}: expected {want}, got {roles[i]} ({where})", "bad_order", i)
    last_wanted = "user" if add_generation_prompt else "assistant"
    if roles[-1] != last_wanted:
        raise ChatError(f"the last message must be {last_wanted} "
                        f"({'add_generation_prompt' if add_generation_prompt else 'training'}), got {roles[-1]}",
                        "bad_last_role", len(roles) - 1)


def render(messages, tok, add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """Render `messages` to `(ids, loss_mask)`; with `add_generation_prompt` the sequence
    ends with the assistant header so generation continues with the answer."""
    validate(messages, add_generation_prompt)
    tpl = template_for(tok)
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        content = tok.encode(m["content"])
        if not content:
            raise ChatError(f"message {i} ({m['role']}): content encodes to no tokens", "empty_content")
        header = tpl.headers[m["role"]]
        trained = 1 if m["role"] == "assistant" else 0
        ids += [*header, *content, tpl.eot_id]
        mask += [0] * len(header) + [trained] * (len(content) + 1)
    if add_generation_prompt:
        ids += tpl.headers["assistant"]
        mask += [0] * len(tpl.headers["assistant"])
    return ids, mask


@dataclass(frozen=True)
class Turn:
    """One parsed turn: header at [start, content_start), content up to `end` (exclusive);
    `end` is the index of the closing eot, or the sequence length when `closed` is False."""

    role: str
    start: int
    content_start: int
    end: int
    closed: bool


def _find(hay: np.ndarray, needle: tuple) -> int:
    """Index of the first occurrence of `needle` in `hay`, or -1."""
    n = len(needle)
    if n == 0 or len(hay) < n:
        return -1
    windows = np.lib.stride_tricks.sliding_window_view(hay, n)
    hits = np.flatnonzero((windows == np.asarray(needle)).all(axis=1))
    return int(hits[0]) if hits.size else -1


def segment(ids, tpl: Template, allow_open_end: bool = False) -> list[Turn]:
    """Parse one rendered conversation back into turns.

    Raises `ChatError` (with `.position`, the offending index) on anything `render`
    cannot have produced: a turn without a role header, an empty turn, a header inside a
    turn's content (a lost eot), a bad role order. With `allow_open_end` the last turn may
    lack its eot (a conversation truncated inside an assistant answer)."""
    ids = np.asarray(ids)
    bounds = np.flatnonzero(ids == tpl.eot_id).tolist()
    if not bounds or bounds[-1] != len(ids) - 1:
        bounds.append(len(ids))  # the last turn is open (no eot)
    turns: list[Turn] = []
    start = 0
    for end in bounds:
        closed = end < len(ids)
        piece = ids[start:end]
        role = next((r for r, h in tpl.headers.items() if tuple(piece[:len(h)].tolist()) == h), None)
        if role is None:
            raise ChatError("turn does not start with a role header", "no_header", position=start)
        cstart = start + len(tpl.headers[role])
        if cstart >= end:
            raise ChatError(f"{role} turn has no content", "empty_content", position=start)
        for other, h in tpl.headers.items():
            hit = _find(ids[cstart:end], h)
            if hit >= 0:
                raise ChatError(f"{other} header inside a {role} turn (missing end-of-turn token)",
                                "header_in_content", position=cstart + hit)
        if not closed and not (allow_open_end and role == "assistant"):
            raise ChatError(f"{role} turn is not closed by the end-of-turn token", "missing_eot",
                            position=end - 1)
        turns.append(Turn(role, start, cstart, end, closed))
        start = end + 1
    try:
        validate([{"role": t.role, "content": "x"} for t in turns])
    except ChatError as exc:
        pos = turns[exc.index].start if exc.index is not None else 0
        raise ChatError(exc.detail, exc.reason, position=pos) from None
    return turns


def mask_for(turns: list[Turn], length: int) -> np.ndarray:
    """The loss mask `render` gives for these turns: 1 on assistant content and its eot."""
    mask = np.zeros(length, dtype=np.uint8)
    for t in turns:
        if t.role == "assistant":
            mask[t.content_start:t.end + 1 if t.closed else t.end] = 1
    return mask

