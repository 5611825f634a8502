"""Configs: a YAML file, then command-line overrides, into typed, validated dataclasses.

    python scripts/pretrain.py --config configs/demo/pretrain.yaml --train.max_steps 50

`load_config` reads the YAML, applies `--section.field VALUE` overrides (`-` and `_` alike;
values are YAML scalars with only true and false as booleans) and builds the script's
dataclass tree. Every value is checked against its field's type (`Literal[...]` for a fixed
set of values) and valid range (`sprout.ranges.in_range`) before the dataclass is built; a
dataclass's own checks raise `FieldError`. Anything refused is one line naming its source
(the file or the command line), the field, the value and what was expected.

`config_to_dict` gives every field back, for printing and for saving beside a run's outputs.
A field declared `resume_free(default)` (run length, logging, paths) may change on resume;
`resume_config(cfg)` is the config without those fields, what a checkpoint records and a
resume must match. `missing_fields` names the fields a saved config lacks.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from sprout.errors import SproutError
from sprout.option_names import TRL_NAMES, option_hint, trl_hint
from sprout.ranges import Interval, field_range, out_of_range

T = TypeVar("T")


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise SproutError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise SproutError(f"{path}:{where} invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise SproutError(f"{path}: a config must be a YAML mapping at top level")
    return data


def option_key(arg: str) -> str:
    """`--train.max-steps` -> `train.max_steps`: the dotted field an option names (`-` = `_`)."""
    return arg[2:].replace("-", "_")


class _CommandLineLoader(yaml.SafeLoader):
    """YAML for one command-line value: as yaml.safe_load, except that only true and false are
    booleans (YAML 1.2's rule for them; numbers, null and dates as yaml.safe_load reads them),
    so `--train.mixed_precision no` is the string "no" (the shell has already removed any quotes
    a user typed around it)."""


_CommandLineLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_CommandLineLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                         list("tTfF"))


def parse_value(raw: str):
    """One command-line value: a YAML scalar or flow collection (`50`, `3e-4`, `true`, `null`,
    `[1, 2]`), only true and false as booleans; text that is not YAML is the string itself."""
    if raw == "":
        return ""
    try:
        return yaml.load(raw, Loader=_CommandLineLoader)
    except yaml.YAMLError:
        return raw  # the field's type check decides


def parse_overrides(argv: list[str]) -> dict:
    """Turn `['--train.max_steps', '50', '--model.d_model=128', '--val-frac', '0.1']` into a nested dict."""
    out: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg.split("=", 1)[0]) <= 2:
            raise SproutError(f"command line: unrecognised argument {arg!r} (overrides look like "
                              f"--section.field VALUE or --field VALUE)")
        if "=" in arg:
            name, raw = arg.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise SproutError(f"command line: {arg} has no value")
            name, raw = arg, argv[i + 1]
            i += 2
        value = parse_value(raw)
        node = out
        parts = option_key(name).split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SproutError(f"command line: {name} sets a field inside a value that is not a section")
        node[parts[-1]] = value
    return out


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge; `override` wins."""
    result = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(result.get(k), dict):
            result[k] = merge(result[k], v)
        else:
            result[k] = v
    return result


def unwrap_optional(tp: Any) -> Any:
    """`X` for a field typed `X | None` (or `Optional[X]`); any other type as it is."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


class FieldError(SproutError):
    """A dataclass's own check of one of its fields (`__post_init__`): `from_dict` names the
    field's full dotted path and where its value came from."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    """`FieldError` unless `ok`: "<field>: got <value>; expected <expected>"."""
    if not ok:
        raise FieldError(field, f"got {value!r}; expected {expected}")


def type_name(tp: Any) -> str:
    """A field's type as --help and errors write it: int, float | null, {cosine, wsd, constant}."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "{" + ", ".join(str(a) for a in args) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _expected(tp: Any, interval: Interval | None = None) -> str:
    """What a value of type `tp` (its numbers in `interval`) must be, in words: "an integer in
    [1, inf), auto or null"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [", ".join(map(str, typing.get_args(a))) if typing.get_origin(a) is Literal else _expected(a, interval)
                 for a in args]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    if interval is not None and tp in (int, float):
        return f"{'an integer' if tp is int else 'a number'} in {interval}"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list" + (f" of {type_name(args[0])}" if args else "")
    if dataclasses.is_dataclass(tp):
        return "a mapping (a section)"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
            dict: "a mapping", type(None): "null"}.get(tp, type_name(tp))


def _takes_text(tp: Any) -> bool:
    """Whether a field of type `tp` takes a string (str, or a Literal with a string choice)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_takes_text(a) for a in args)
    return tp is str or (origin is Literal and any(isinstance(a, str) for a in args))


def _word_hint(value: Any, tp: Any, from_cli: bool) -> str:
    """For a boolean given to a field that takes text (YAML read the word as true or false):
    how to pass the word; "" otherwise."""
    if not (isinstance(value, bool) and _takes_text(tp)):
        return ""
    if from_cli:
        return f" (for the word, quote it inside the shell's quotes: '\"{str(value).lower()}\"')"
    return " (YAML reads a bare yes, no, on, off, true or false as a boolean: quote the word)"


def _check_value(value: Any, tp: Any) -> Any:
    """`value` as type `tp` (an int as a float, a numeric string as a float, a list as a tuple),
    or ValueError when it is not one (`_expected` says what would be)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_value(value, arg)
            except ValueError:
                continue
        raise ValueError
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ValueError
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ValueError from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError
        if args:
            value = [_check_value(v, args[0]) for v in value]
        return tuple(value) if (tp is tuple or origin is tuple) else list(value)
    if tp is dict or origin is dict or dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError
        return value
    return value


def _known_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted field path of dataclass `cls` (sections and their fields)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        tp = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            keys += _known_keys(tp, f"{prefix}{f.name}.")
    return keys


def _flat(data: dict, prefix: str = "") -> list[str]:
    return [k for key, v in data.items()
            for k in (_flat(v, f"{prefix}{key}.") if isinstance(v, dict) and v else [f"{prefix}{key}"])]


def check_overrides(cls: type, overrides: dict) -> None:
    """Refuse a command-line key that names no field of `cls`, with what it most likely meant
    (`sprout.option_names.option_hint`: TRL's name for a field, or the closest field)."""
    known = _known_keys(cls)
    sections = {k for k in known if any(o.startswith(k + ".") for o in known)}
    fields = [k for k in known if k not in sections]
    for key in _flat(overrides):
        parts = key.split(".")
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
        if key in known or ancestors & set(fields):  # a field, or a key inside a mapping-valued field
            continue
        raise SproutError(f"command line: unknown option --{key}{option_hint(key, fields)}")


def from_dict(cls: type[T], data: dict, where: str = "config", *, cli: set[str] | frozenset = frozenset(),
              prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclasses, checking each
    value against its field's type. `where` names the source in errors (a file); keys in
    `cli` (dotted) came from the command line and are named as such."""

    def origin(key: str) -> str:
        return f"command line: --{key}" if key in cli else f"{where}: {key}"

    if not isinstance(data, dict):
        raise SproutError(f"{origin(prefix.rstrip('.')) if prefix else where}: expected a mapping, "
                          f"got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = set(fields)
    unknown = sorted(set(data) - names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(names), n=1, cutoff=0.6)
        hint = f"did you mean {prefix}{close[0]}? " if close else ""
        if not prefix and unknown[0] in TRL_NAMES:  # a TRL option name written as a top-level key
            hint = trl_hint(unknown[0], _known_keys(cls), flag="") + "; "
        raise SproutError(f"{where}: unknown key(s) {', '.join(prefix + u for u in unknown)} "
                          f"({hint}known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        inner = unwrap_optional(tp)
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            kwargs[name] = from_dict(inner, value, where, cli=cli, prefix=f"{prefix}{name}.")
            continue
        interval = field_range(fields[name])
        try:
            kwargs[name] = _check_value(value, tp)
            if out_of_range(kwargs[name], interval):
                raise ValueError
        except ValueError:
            raise SproutError(f"{origin(prefix + name)}: got {value!r}; expected {_expected(tp, interval)}"
                              f"{_word_hint(value, tp, prefix + name in cli)}") from None
    try:
        return cls(**kwargs)
    except FieldError as exc:  # a dataclass's own check of one field
        raise SproutError(f"{origin(prefix + exc.field)}: {exc.message}") from None
    except (SproutError, ValueError, TypeError) as exc:  # a dataclass's own validation
        raise SproutError(f"{where}: {prefix.rstrip('.') + ': ' if prefix else ''}{exc}") from None


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: list[str] | dict | None = None, *,
                base: dict | None = None, where: str | None = None) -> T:
    """YAML file (optional; else `base`, e.g. a run's saved config, named `where` in errors) +
    command-line overrides (argv or a nested dict) -> dataclass `cls`."""
    data = read_yaml(path) if path else dict(base or {})
    cli: set[str] = set()
    if overrides:
        overrides = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
        check_overrides(cls, overrides)
        cli = set(_flat(overrides))
        data = merge(data, overrides)
    return from_dict(cls, data, str(path) if path else (where or "config"), cli=cli)


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default (its default factory called), or dataclasses.MISSING."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


RESUME_FREE = {"resume": "free"}  # field metadata: this field may change when a run is resumed
# field metadata: at its default this field is left out of the resume config (so adding it kept
# every earlier run's config hash); set to another value, a resume must match it
HASHED_WHEN_SET = {"resume": "when_set"}


def missing_fields(cls: type, data: dict, prefix: str = "") -> list[str]:
    """The dotted fields of dataclass `cls` that the saved config `data` does not hold (a section
    it holds is searched in turn): `config_to_dict` writes every field, so a config that lacks
    one was not written by this version of sprout."""
    hints = typing.get_type_hints(cls)
    missing = []
    for f in dataclasses.fields(cls):
        tp = unwrap_optional(hints[f.name])
        if f.name not in data:
            missing.append(prefix + f.name)
        elif dataclasses.is_dataclass(tp) and isinstance(data[f.name], dict):
            missing += missing_fields(tp, data[f.name], f"{prefix}{f.name}.")
    return missing


def config_to_dict(cfg: Any) -> Any:
    """`dataclasses.asdict(cfg)`, every field written (lists and tuples kept as they are)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(config_to_dict(v) for v in cfg)
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return copy.deepcopy(cfg)


def resume_free(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """`dataclasses.field` for a field a resume may change (run length, logging, paths)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata=RESUME_FREE)


def resume_free_paths(cls: type) -> set[str]:
    """Dotted paths of the fields declared `resume_free` in dataclass `cls` and the dataclasses in it."""
    hints = typing.get_type_hints(cls)
    paths = set()
    for f in dataclasses.fields(cls):
        tp = unwrap_optional(hints[f.name])
        if f.metadata.get("resume") == "free":
            paths.add(f.name)
        elif dataclasses.is_dataclass(tp):
            paths |= {f"{f.name}.{p}" for p in resume_free_paths(tp)}
    return paths


def default_paths(cfg: Any, prefix: str = "") -> set[str]:
    """Dotted paths of the fields declared `HASHED_WHEN_SET` in the dataclass instance `cfg` (and
    the dataclasses in it) that hold their default."""
    paths = set()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("resume") == "when_set" and value == field_default(f):
            paths.add(prefix + f.name)
        elif dataclasses.is_dataclass(value):
            paths |= default_paths(value, f"{prefix}{f.name}.")
    return paths


def resume_config(cfg: Any) -> dict:
    """`cfg` as a dict without its `resume_free` fields, nor a section that is `off` (a LoRA
    section of rank 0: a run without it had the same config), nor a `HASHED_WHEN_SET` field at
    its default: what a resume must match."""
    free = resume_free_paths(type(cfg)) | default_paths(cfg)
    free |= {f.name for f in dataclasses.fields(cfg) if getattr(getattr(cfg, f.name), "off", False) is True}

    def keep(node: dict, prefix: str) -> dict:
        return {k: keep(v, f"{prefix}{k}.") if isinstance(v, dict) else v
                for k, v in node.items() if f"{prefix}{k}" not in free}

    return keep(config_to_dict(cfg), "")


def dump_yaml(cfg: Any) -> str:
    data = config_to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    return yaml.safe_dump(data, sort_keys=False)
