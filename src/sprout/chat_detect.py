"""Which chat format a Jinja chat template writes: `detect_chat_format(template, tok)`.

A published chat model ships its layout as a Jinja template; sprout renders conversations
itself (`sprout.chat.render`), so an imported model needs the format (`sprout.chat_formats`)
that gives exactly the template's ids. Every case of `detection_cases()` (each prefix of
`CONVERSATIONS` that ends a turn) is rendered as transformers' `apply_chat_template` renders it
and tokenized as transformers tokenizes it (special pieces to their ids, the text between
through `tok.encode`). The candidates sprout, chatml and llama3, in that order, each with the
default system message the template writes, are rendered by `sprout.chat.render_as`: the first
with the same ids on every case is the answer; when none matches, `SproutError` names the one
that matched longest and its first differing token. `folder_chat_format` detects the format
of a tokenizer folder's template (`sprout.chat_formats.read_chat_template`), as an import
records it in chat_format.json. Case
contents have no whitespace at either end, so templates that trim contents (Llama 3's) can
match; `render` itself never trims.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from sprout.chat import ChatError, encode_with_specials, render_as, template_of, validate
from sprout.chat_formats import FORMATS, ROLES, ChatFormat, read_chat_template
from sprout.errors import SproutError
from sprout.tokenizer import hf_special_tokens, load_tokenizer

CONVERSATIONS = (
    (("user", "What is 2 + 3?"), ("assistant", "<answer>5</answer>"), ("user", "And 7 * 6?"),
     ("assistant", "<think>7 * 6 = 42</think><answer>42</answer>"), ("user", "Thanks!"),
     ("assistant", "You're welcome.")),
    (("system", "You answer briefly."), ("user", "Name three colours."), ("assistant", "Red, green and blue."),
     ("user", "日本語 ✓ 😀"), ("assistant", "Café naïve\n\nline two"), ("user", "tab\there"),
     ("assistant", "ok")),
    (("system", "Think step by step.\nThen answer."), ("user", "12345 + 678 = ?"), ("assistant", "13023"),
     ("user", "it's they'll we've I'd"), ("assistant", "x")),
    (("user", "Hello"), ("assistant", "Hi! How can I help?"), ("user", "a  b   c"), ("assistant", "d")),
)
PROBE = [{"role": "user", "content": "Hello"}]  # no system message: shows the template's default one


def folder_chat_format(folder: Path, tok) -> ChatFormat | None:
    """The format of the chat template in the Hugging Face tokenizer folder `folder`
    (`read_chat_template`), detected with the bos and eos texts of the folder's config (what an
    import writes as chat_format.json); None when it has no template. `tok`: its tokenizer, or a
    spec that loads it (only when there is a template). One that matches no format is refused
    naming the template's file."""
    found = read_chat_template(folder)
    if found is None:
        return None
    template, where = found
    tok = load_tokenizer(tok) if isinstance(tok, str) else tok
    specials = hf_special_tokens(Path(folder))
    try:
        return detect_chat_format(template, tok, specials.get("bos_token") or "", specials.get("eos_token") or "")
    except SproutError as exc:
        raise SproutError(f"{where}: {exc}") from None


def detection_cases() -> list[tuple[list, bool]]:
    """(messages, add_generation_prompt) for every prefix of `CONVERSATIONS` that `render`
    takes: ending on an answer without, on a question with the generation prompt."""
    cases = []
    for conversation in CONVERSATIONS:
        messages = [{"role": r, "content": c} for r, c in conversation]
        for n in range(1, len(messages) + 1):
            gen = messages[n - 1]["role"] == "user"
            try:
                validate(messages[:n], gen)
            except ChatError:
                continue
            cases.append((messages[:n], gen))
    return cases


def jinja_renderer(template: str, bos_token: str, eos_token: str):
    """`render(messages, add_generation_prompt) -> str` for a chat template, set up as
    transformers' `apply_chat_template` sets it up (a sandboxed environment, trim_blocks, lstrip_blocks)."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise SproutError("reading a chat template needs jinja2 (pip install jinja2)") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise SproutError(f"chat template does not compile: {exc}") from None

    def render(messages, add_generation_prompt: bool) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token, eos_token=eos_token)
        except jinja2.exceptions.TemplateError as exc:
            raise SproutError(f"chat template fails on {len(messages)} messages: {exc}") from None
    return render


def _special_ids(tok, extra: list) -> dict:
    """piece -> id for every special piece of every candidate format, and `extra`, that `tok` has."""
    pieces = [p for fmt in FORMATS.values() for r in ROLES for p in fmt.special_pieces(r)]
    pieces += [fmt.eot for fmt in FORMATS.values()] + [fmt.bos for fmt in FORMATS.values() if fmt.bos] + extra
    found = {p: tok.special_id(p) for p in dict.fromkeys(p for p in pieces if p)}
    return {p: int(i) for p, i in found.items() if i is not None}


def default_system(text: str, tpl) -> str | None:
    """The system message the template wrote into `text` (its rendering of `PROBE`, which has
    none), read as `tpl`'s format lays a system turn out; None when there is none."""
    fmt = tpl.format
    start = (fmt.bos if fmt.bos and text.startswith(fmt.bos) else "") + fmt.header_for("system", tpl.kind == "special")
    end = text.find(fmt.eot, len(start))
    return text[len(start):end] if text.startswith(start) and end > len(start) else None


def _first_difference(want: list, got: list) -> int | None:
    n = min(len(want), len(got))
    return next((i for i in range(n) if want[i] != got[i]), None if len(want) == len(got) else n)


def detect_chat_format(template: str, tok, bos_token: str | None = None, eos_token: str | None = None) -> ChatFormat:
    """The format (of `sprout.chat_formats.FORMATS`, with the template's default system message)
    whose rendering equals the template's ids on every detection case; `bos_token` and
    `eos_token` are the texts the template sees (default: `tok.bos_token`/`tok.eos_token` when
    it has them, else "")."""
    bos_token = bos_token if bos_token is not None else getattr(tok, "bos_token", None) or ""
    eos_token = eos_token if eos_token is not None else getattr(tok, "eos_token", None) or ""
    render_text = jinja_renderer(template, bos_token, eos_token)
    specials = _special_ids(tok, [bos_token, eos_token])
    cases = detection_cases()
    wanted = [encode_with_specials(tok, render_text(m, g), specials) for m, g in cases]
    probe = render_text(PROBE, False)
    closest, unusable = None, []
    for fmt in FORMATS.values():
        try:
            tpl = template_of(tok, fmt)
            system = default_system(probe, tpl)
            if system is not None:
                tpl = template_of(tok, fmt.with_system(system))
        except SproutError as exc:
            unusable.append(f"{fmt.name}: {exc}")
            continue
        for k, ((messages, gen), want) in enumerate(zip(cases, wanted)):
            got = render_as(tpl, messages, tok, gen)[0]
            p = _first_difference(want, got)
            if p is not None:
                if closest is None or (k, p) > closest[:2]:
                    closest = (k, p, tpl.format, want, got)
                break
        else:
            return tpl.format
    if closest is None:
        raise SproutError(f"chat template: tokenizer {tok.spec} has the special tokens of no chat format "
                          f"({'; '.join(unusable)})")
    k, p, fmt, want, got = closest
    messages, gen = cases[k]

    def token(ids):
        return f"{ids[p]} ({tok.decode([ids[p]])!r})" if p < len(ids) else "the end of the sequence"
    raise SproutError(f"chat template matches none of the chat formats {', '.join(FORMATS)}; closest {fmt.name}: "
                      f"conversation {k} ({len(messages)} message{'s' if len(messages) > 1 else ''}"
                      f"{', generation prompt' if gen else ''}) "
                      f"position {p}: expected {token(want)} from the template, got {token(got)} from {fmt.name}")
