"""--help for a config: every field of a config dataclass (`sprout.config`) as a script's
--help lists it.

`config_help(cls)` gives each field's dotted name (the option that sets it), its type (its
choices, its valid range), its default and one line of meaning, taken from the field's
`metadata["help"]` or else the comment after the field in its source (`field_comments`);
`add_config_help(parser, cls)` puts that at the end of an argparse parser's --help;
`config_markdown(cls)` renders the same rows as a Markdown table (docs/reference/config.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import types
import typing
from typing import Any

import yaml

from sprout.config import field_default, type_name, unwrap_optional
from sprout.ranges import Interval, field_range


def field_comments(cls: type) -> dict[str, str]:
    """{field: the comment after it in the source of the class that declares it (with the comment
    lines that continue it right below), else the comment lines right above it}: a subclass's own
    comment first, then its dataclass bases'; {} when no source is available."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_declared_comments(base))
    return out


def _declared_comments(cls: type) -> dict[str, str]:
    """`field_comments` of the fields written in `cls`'s own source."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[int, str] = {}  # line index -> comment text
    columns: dict[int, int] = {}   # line index -> the comment's column
    code_lines: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0] - 1] = tok.string.lstrip("#").strip()
                columns[tok.start[0] - 1] = tok.start[1]
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                  tokenize.ENDMARKER):
                code_lines.add(tok.start[0] - 1)
    except (tokenize.TokenError, IndentationError):
        return {}
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        name = line.strip().split(":", 1)[0].strip()
        if name not in names or name in out or ":" not in line:
            continue
        if i in comments and i in code_lines:  # trailing comment, maybe continued below (same column)
            text, j = [comments[i]], i + 1
            while j in comments and j not in code_lines and columns[j] == columns[i]:
                text.append(comments[j])
                j += 1
            out[name] = " ".join(text)
        else:  # comment lines right above
            text, j = [], i - 1
            while j in comments and j not in code_lines and columns[j] <= len(line) - len(line.lstrip()):
                text.insert(0, comments[j])
                j -= 1
            if text:
                out[name] = " ".join(text)
    return out


def config_fields(cls: type, prefix: str = "", default: Any = None) -> list[tuple[str, str, Any, str]]:
    """(dotted name, type, default, meaning) of every field of `cls`; a section's fields follow
    a row for the section itself (type "section", its docstring's first line as meaning).
    `default`: an instance whose values are the defaults (a section's own default factory)."""
    hints, comments = typing.get_type_hints(cls), field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        value = getattr(default, f.name) if default is not None else field_default(f)
        meaning = f.metadata.get("help") or comments.get(f.name, "")
        inner = unwrap_optional(tp)
        if dataclasses.is_dataclass(inner):
            doc = (inspect.getdoc(inner) or "").split("\n\n")[0].replace("\n", " ")
            if doc.startswith(inner.__name__ + "("):  # dataclass's generated signature: no docstring
                doc = ""
            rows.append((prefix + f.name, "section", None, meaning or doc))
            rows += config_fields(inner, f"{prefix}{f.name}.", value if dataclasses.is_dataclass(value) else None)
        else:
            rows.append((prefix + f.name, _type_text(tp, field_range(f)), value, meaning))
    return rows


def _type_text(tp: Any, interval: Interval | None) -> str:
    """`type_name(tp)` with the field's interval after its number type: "float | null" ->
    "float in (0, 1] | null"."""
    if interval is None:
        return type_name(tp)
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return " | ".join(f"{type_name(a)} in {interval}" if a in (int, float) else type_name(a) for a in members)


def config_help(cls: type) -> str:
    """Every field of config `cls` for a script's --help (an argparse epilog): the option that
    sets it, its type or choices, its default and its meaning."""
    rows = config_fields(cls)
    width = min(34, max(len(n) for n, *_ in rows) + 3)
    lines = [f"config fields ({cls.__name__}): set each in the YAML (section: {{field: value}}) or as",
             "--section.field VALUE / --field VALUE on the command line (- and _ alike; VALUE read as YAML)"]
    for name, tp, default, meaning in rows:
        if tp == "section":
            lines.append(f"\n  {name}:" + (f" {meaning}" if meaning else ""))
            continue
        shown = shown_default(default)
        opt = f"--{name}"
        head = f"    {opt:<{width}} {tp} = {shown}"
        lines.append(head + (f"\n    {'':<{width}}   {meaning}" if meaning else ""))
    return "\n".join(lines)


def shown_default(default: Any) -> str:
    """A field's default as --help shows it: YAML (null, false, [1, 2]), or "(required)"."""
    if default is dataclasses.MISSING:
        return "(required)"
    return yaml.safe_dump(default, default_flow_style=True, width=10_000).strip().removesuffix("\n...") \
        .removesuffix(" ...").strip()


def config_markdown(cls: type, formats: tuple[str, ...] = ()) -> str:
    """`config_fields(cls)` as a Markdown table: field, type (choices, valid range), default and
    meaning; `formats`: the values a `format` field takes."""
    lines = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, tp, default, meaning in config_fields(cls):
        if name == "format" and formats:
            tp = "{" + ", ".join(formats) + "}"
        cells = [f"`{name}`", tp, "" if tp == "section" else f"`{shown_default(default)}`", meaning]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def add_config_help(parser, cls: type) -> None:
    """Put `config_help(cls)` at the end of `parser`'s --help, keeping its line breaks."""
    import argparse

    parser.epilog = ((parser.epilog + "\n\n") if parser.epilog else "") + config_help(cls)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
