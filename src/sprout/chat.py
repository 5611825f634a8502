"""The chat template: one conversation -> (ids, loss_mask), and back again.

Every stage that turns messages into tokens (SFT prep, preference and RL batches, the chat
CLI) goes through `render`, so training and inference see the same bytes. The layout is the
tokenizer's chat format (`sprout.chat_formats.format_for`); `template_for` turns it into ids,
each header and each content encoded on its own so their ids never merge.

`loss_mask[i] == 1` means token i is a training *target*: the tokens of every assistant turn's
content and the end-of-turn token that closes it (so the model learns to stop). BOS, role
headers, system and user text, text after an end-of-turn token and padding are 0. Trainers feed
ids[:-1] and score ids[1:] with mask[1:]; as a header is never trained, the first token of a
packed document is never a target, so no loss crosses a document boundary. `validate` refuses
content holding sprout's marker strings, `render` also the special pieces of the tokenizer's
format. `segment` parses a rendered sequence back into turns (the loss-mask checker relies on
it). Reasoning answers, `<think>...</think><answer>N</answer>`, are `sprout.answers`'.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import numpy as np

from sprout.chat_formats import ROLES, SPROUT, ChatFormat, format_for
from sprout.errors import SproutError
from sprout.tokenizer import EOT

TEMPLATE_VERSION = SPROUT.version  # sprout's format, the version its data files record
MARKERS = {r: SPROUT.header_for(r) for r in ROLES}
EOT_MARKER = EOT  # closes every turn
RESERVED = SPROUT.reserved


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
    """The token-level constants of one chat format for one tokenizer."""

    kind: str  # "special" (headers built from special tokens) or "text" (plain-text headers)
    headers: dict  # role -> tuple of header ids
    eot_id: int
    format: ChatFormat = SPROUT
    after_eot: tuple = ()  # ids of the untrained text after every end-of-turn token
    bos: tuple = ()  # (BOS id,) when the format opens with one

    @property
    def version(self) -> str:
        return self.format.version

    def to_json(self) -> dict:
        """What data files record; sprout's holds exactly the fields it always had."""
        out = {"version": self.version, "kind": self.kind, "eot_id": self.eot_id,
               "headers": {r: list(h) for r, h in self.headers.items()}}
        if self.format != SPROUT:
            out.update(format=self.format.to_json(), after_eot=list(self.after_eot), bos=list(self.bos))
        return out


_TEMPLATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def encode_with_specials(tok, text: str, specials: dict) -> list[int]:
    """`text` as ids: each piece of `specials` (piece -> id) as its id, the text between
    pieces through `tok.encode`, each run on its own."""
    if not specials:
        return tok.encode(text) if text else []
    pattern = "(" + "|".join(re.escape(p) for p in sorted(specials, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        if part in specials:
            ids.append(specials[part])
        elif part:
            ids += tok.encode(part)
    return ids


def template_of(tok, fmt: ChatFormat) -> Template:
    """The ids of `fmt` for `tok`: its special pieces as special ids when `tok` has them all,
    its plain-text headers when it has none of them and the format has those."""
    found = {p: tok.special_id(p) for r in ROLES for p in fmt.special_pieces(r)}
    present = [p for p, i in found.items() if i is not None]
    if len(present) == len(found):
        kind = "special"
        headers = {r: tuple(encode_with_specials(tok, fmt.header_for(r), found)) for r in ROLES}
    elif not present and fmt.plain_header is not None:
        kind = "text"
        headers = {r: tuple(tok.encode(fmt.header_for(r, special=False))) for r in ROLES}
    elif fmt.plain_header is not None:
        raise SproutError(f"tokenizer {tok.spec}: has role pieces {present} but not all of {list(found)}")
    else:
        missing = [p for p, i in found.items() if i is None]
        raise SproutError(f"tokenizer {tok.spec}: chat format {fmt.name} needs the special tokens {missing}")
    eot = int(tok.eot_id) if fmt.eot == EOT else found.get(fmt.eot, tok.special_id(fmt.eot))
    bos = found.get(fmt.bos, tok.special_id(fmt.bos)) if fmt.bos else None
    for piece, i in ((fmt.eot, eot), (fmt.bos, bos if fmt.bos else 0)):
        if i is None:
            raise SproutError(f"tokenizer {tok.spec}: chat format {fmt.name} needs the special token {piece}")
    after = tuple(tok.encode(fmt.after_eot)) if fmt.after_eot else ()
    return Template(kind, headers, int(eot), fmt, after, (int(bos),) if fmt.bos else ())


def template_for(tok) -> Template:
    """The template of `tok`'s chat format (`sprout.chat_formats.format_for`), cached per tokenizer."""
    cached = _TEMPLATES.get(tok)
    if cached is None:
        cached = _TEMPLATES[tok] = template_of(tok, format_for(tok))
    return cached


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
    """Render `messages` to `(ids, loss_mask)` in `tok`'s chat format; with
    `add_generation_prompt` the sequence ends with the assistant header so generation
    continues with the answer."""
    return render_as(template_for(tok), messages, tok, add_generation_prompt)


def render_as(tpl: Template, messages, tok, add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """`render` with the template `tpl` (`template_of` a format for `tok`)."""
    validate(messages, add_generation_prompt)
    fmt = tpl.format
    if fmt != SPROUT:  # validate refused sprout's markers; refuse this format's own too
        for i, m in enumerate(messages):
            marker = next((r for r in fmt.reserved if r in m["content"]), None)
            if marker is not None:
                raise ChatError(f"message {i} ({m['role']}): content contains the reserved marker {marker}",
                                "reserved_marker", i)
    full = fmt.with_default_system(messages)
    shift = len(full) - len(messages)
    ids: list[int] = list(tpl.bos)
    mask: list[int] = [0] * len(tpl.bos)
    for i, m in enumerate(full):
        content = tok.encode(m["content"])
        if not content:
            raise ChatError(f"message {i - shift} ({m['role']}): content encodes to no tokens", "empty_content")
        header = tpl.headers[m["role"]]
        trained = 1 if m["role"] == "assistant" else 0
        ids += [*header, *content, tpl.eot_id, *tpl.after_eot]
        mask += [0] * len(header) + [trained] * (len(content) + 1) + [0] * len(tpl.after_eot)
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
    cannot have produced: a missing BOS, a turn without a role header, an empty turn, a
    header inside a turn's content (a lost eot), other text than the format's after an
    end-of-turn token, a bad role order. With `allow_open_end` the last turn may lack its
    eot (a conversation truncated inside an assistant answer). The text after the last
    end-of-turn token may be cut short (the prep drops untrained tokens after a truncation)."""
    ids = np.asarray(ids)
    n = len(ids)
    bos = np.asarray(tpl.bos, dtype=ids.dtype)
    if len(bos) and not np.array_equal(ids[:len(bos)], bos):
        raise ChatError("sequence does not start with the BOS token", "no_bos", position=0)
    after = tpl.after_eot
    eots = np.flatnonzero(ids == tpl.eot_id)
    turns: list[Turn] = []
    start = len(bos)
    while True:
        k = np.searchsorted(eots, start)
        end = int(eots[k]) if k < len(eots) else n
        closed = end < n
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
        tail = ids[end + 1:end + 1 + len(after)].tolist()
        if tail != list(after[:len(tail)]):
            bad = end + 1 + next(i for i, (a, b) in enumerate(zip(tail, after)) if a != b)
            raise ChatError(f"the end-of-turn token of a {role} turn is not followed by "
                            f"{tpl.format.after_eot!r}", "bad_after_eot", position=bad)
        start = end + 1 + len(after)
        if start >= n:
            break
    try:
        validate([{"role": t.role, "content": "x"} for t in turns])
    except ChatError as exc:
        pos = turns[exc.index].start if exc.index is not None else 0
        raise ChatError(exc.detail, exc.reason, position=pos) from None
    return turns


def ends_turn(ids, tpl: Template) -> bool:
    """Whether `ids` end with an end-of-turn token, possibly followed by (the start of) the
    untrained text after it."""
    ids = [int(i) for i in ids[max(0, len(ids) - len(tpl.after_eot) - 1):]]
    return any(ids[-1 - k] == tpl.eot_id and tuple(ids[len(ids) - k:]) == tpl.after_eot[:k]
               for k in range(len(ids)))


def mask_for(turns: list[Turn], length: int) -> np.ndarray:
    """The loss mask `render` gives for these turns: 1 on assistant content and its eot."""
    mask = np.zeros(length, dtype=np.uint8)
    for t in turns:
        if t.role == "assistant":
            mask[t.content_start:t.end + 1 if t.closed else t.end] = 1
    return mask

