"""Chat formats as data: how one conversation is laid out as text, one table entry per format.

A `ChatFormat` gives each role's header, the end-of-turn piece closing every turn (trained on
assistant turns; where generation stops), untrained text after it, an optional BOS piece and an
optional default system message; `specials` names the pieces that are single special tokens.
`version` is what data files, checkpoints and caches record (a default system message adds a
digest of its text).

    sprout   <|user|>\\n{question}<|endoftext|><|assistant|>\\n{answer}<|endoftext|>
    chatml   <|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n{answer}<|im_end|>\\n

`format_for(tok)`: the tokenizer's `chat_format` attribute, else a `chat_format.json` beside its
files, else sprout. An `hf:` folder with its own chat template but no chat_format.json is refused
where a format is chosen (a prep); a checkpoint's tokenizer takes the format of the
`template_version` it records. Formats are detected from templates in `sprout.chat_detect`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from sprout.atomic import atomic_write
from sprout.errors import SproutError
from sprout.tokenizer import CHAT_FORMAT_FILE, CHAT_TEMPLATE_FILE, EOT

ROLES = ("system", "user", "assistant")
SPROUT_KINDS = ("tiktoken", "sentencepiece")  # tokenizer kinds whose format is always sprout's


@dataclass(frozen=True)
class ChatFormat:
    """One chat layout (see the module docstring); `{role}` in a header stands for the role."""

    name: str
    revision: str  # the recorded version without a default system message
    header: str  # before each message's content, with `specials` as special tokens
    specials: tuple  # pieces of header, eot and bos that are single special tokens
    eot: str  # closes every turn: trained on assistant turns, stops generation
    after_eot: str = ""  # text after every end-of-turn piece, never trained
    bos: str | None = None  # a special piece at the very start
    default_system: str | None = None  # inserted when a conversation has no system message
    plain_header: str | None = None  # the header as text when the tokenizer has none of `specials`

    @property
    def version(self) -> str:
        if self.default_system is None:
            return self.revision
        return f"{self.revision}+system-{hashlib.sha256(self.default_system.encode()).hexdigest()[:12]}"

    def header_for(self, role: str, special: bool = True) -> str:
        """The header text of `role`: with its special tokens, or the plain-text one."""
        return (self.header if special else self.plain_header).replace("{role}", role)

    def special_pieces(self, role: str) -> list:
        """The special pieces of `role`'s header, the end-of-turn piece and BOS, role filled in."""
        return [p.replace("{role}", role) for p in self.specials]

    @property
    def reserved(self) -> tuple:
        """Strings no message content may hold: every role's special pieces, the end-of-turn
        piece and BOS."""
        pieces = [p for r in ROLES for p in self.special_pieces(r)] + [self.eot] + ([self.bos] if self.bos else [])
        return tuple(dict.fromkeys(pieces))

    def with_default_system(self, messages) -> list:
        """`messages` with the default system message in front when they open without one."""
        messages = list(messages)
        if self.default_system is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.default_system})
        return messages

    def with_system(self, text: str | None) -> "ChatFormat":
        return dataclasses.replace(self, default_system=text)

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, **{
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self) if f.name != "name"}}

    @classmethod
    def from_json(cls, data: dict, where: str = "chat format") -> "ChatFormat":
        """A format from `to_json`'s dict; fields it leaves out come from the named table entry."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise SproutError(f"{where}: expected an object with a 'name' "
                              f"(one of {', '.join(FORMATS)} or a full format)")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields - {"version"}
        if unknown:
            raise SproutError(f"{where}: unknown fields {sorted(unknown)} (known: {', '.join(sorted(fields))})")
        base = FORMATS.get(data["name"])
        given = {k: tuple(v) if k == "specials" else v for k, v in data.items() if k != "version"}
        try:
            fmt = dataclasses.replace(base, **given) if base is not None else cls(**given)
        except TypeError as exc:
            raise SproutError(f"{where}: format {data['name']!r} is not in the table and lacks fields "
                              f"({exc})") from None
        if "{role}" not in fmt.header:
            raise SproutError(f"{where}: header {fmt.header!r} does not contain {{role}}")
        if "version" in data and data["version"] != fmt.version:
            raise SproutError(f"{where}: version {data['version']!r} is not {fmt.version!r}, what its fields give")
        return fmt


SPROUT = ChatFormat("sprout", "sprout-chat-v1", header="<|{role}|>", specials=("<|{role}|>",), eot=EOT,
                    plain_header="<|{role}|>\n")
CHATML = ChatFormat("chatml", "chatml-v1", header="<|im_start|>{role}\n", specials=("<|im_start|>", "<|im_end|>"),
                    eot="<|im_end|>", after_eot="\n")
LLAMA3 = ChatFormat("llama3", "llama3-v1", header="<|start_header_id|>{role}<|end_header_id|>\n\n",
                    specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"),
                    eot="<|eot_id|>", bos="<|begin_of_text|>")
FORMATS = {f.name: f for f in (SPROUT, CHATML, LLAMA3)}

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def format_named(name: str) -> ChatFormat:
    if name not in FORMATS:
        raise SproutError(f"unknown chat format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def read_chat_format(path: str | os.PathLike) -> ChatFormat:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SproutError(f"{path}: cannot read the chat format ({exc})") from None
    return ChatFormat.from_json(data, str(path))


def write_chat_format(folder: str | os.PathLike, fmt: ChatFormat) -> Path:
    """Write `fmt` as `chat_format.json` in `folder` (beside a tokenizer's files); returns its path."""
    path = Path(folder) / CHAT_FORMAT_FILE
    with atomic_write(path, "w") as f:
        f.write(json.dumps(fmt.to_json(), indent=2, ensure_ascii=False) + "\n")
    return path


def read_chat_template(folder: Path) -> tuple[str, Path] | None:
    """(template, the file it came from) of a Hugging Face tokenizer folder: `CHAT_TEMPLATE_FILE`
    when there is one (transformers prefers it), else tokenizer_config.json's `chat_template` (a
    string, or a list of named templates: the one named "default"); None when it has neither."""
    jinja, config = folder / CHAT_TEMPLATE_FILE, folder / "tokenizer_config.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), jinja
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    except (OSError, ValueError, AttributeError) as exc:
        raise SproutError(f"{config}: cannot read the chat template ({exc})") from None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return (template, config) if isinstance(template, str) and template.strip() else None


def format_for_spec(spec: str, checkpoint: tuple[str, str | None] | None = None) -> ChatFormat:
    """The format of the tokenizer `spec` names, from the `chat_format.json` beside its files. An
    `hf:` folder with a Jinja chat template but no chat_format.json is refused, naming the template:
    sprout would render its own format where the model expects the template's. `checkpoint`:
    (meta.json, template_version) of the checkpoint whose tokenizer copy `spec` is
    (`Tokenizer.checkpoint`); such a folder then renders the table's format of that version (an
    earlier version of sprout rendered its own format for such a folder), and a checkpoint that
    records none is refused with advice of its own."""
    kind, _, arg = spec.partition(":")
    if kind in SPROUT_KINDS or not arg:
        return SPROUT
    path = Path(os.path.expandvars(arg))
    folder = path if path.is_dir() else path.parent
    if (folder / CHAT_FORMAT_FILE).is_file():
        return read_chat_format(folder / CHAT_FORMAT_FILE)
    found = read_chat_template(folder) if kind == "hf" else None
    if found is not None and checkpoint is not None:
        return _trained_format(found[1], *checkpoint)
    if found is not None:
        raise SproutError(f"{found[1]}: a chat template without the {CHAT_FORMAT_FILE} that tells sprout which of "
                          f"its chat formats ({', '.join(FORMATS)}) renders it; sprout would render its own format "
                          f"instead. Import the model with scripts/import_model.py (its run's tokenizer folder records "
                          f"the format detected from this template), or remove the template to use sprout's format")
    return SPROUT


def format_for(tok) -> ChatFormat:
    """The chat format of tokenizer `tok` (see the module docstring)."""
    own = getattr(tok, "chat_format", None)
    if isinstance(own, ChatFormat):
        return own
    if isinstance(own, str):
        return format_named(own)
    if isinstance(own, dict):
        return ChatFormat.from_json(own, f"tokenizer {tok.spec}")
    return format_for_spec(tok.spec, getattr(tok, "checkpoint", None))


def _trained_format(template: Path, meta: str, version: str | None) -> ChatFormat:
    fmt = next((f for f in FORMATS.values() if f.version == version), None)
    if fmt is not None:
        return fmt
    recorded = (f"records chat template {version!r}, no format of sprout's table ({', '.join(FORMATS)})" if version
                else "records no chat template version (it was never trained on chat)")
    raise SproutError(f"{template}: a chat template without a {CHAT_FORMAT_FILE} in the tokenizer copy of the "
                      f"checkpoint {meta}, which {recorded}, so sprout cannot tell its chat format; pass "
                      f"--tokenizer hf:FOLDER naming the same tokenizer with the {CHAT_FORMAT_FILE} of the format "
                      f"to use beside it (sprout.chat_formats.write_chat_format writes one)")


def check_trained_format(recorded: str | None, fmt: ChatFormat, where: str) -> None:
    """Refuse a checkpoint or data file (`where`) recorded with another chat format version."""
    if recorded is not None and recorded != fmt.version:
        raise SproutError(f"{where}: made with chat template {recorded!r}, but its tokenizer renders "
                          f"{fmt.version!r} ({fmt.name})")
