"""Configs: a YAML file, then dotted command-line overrides, into typed dataclasses.

    python scripts/pretrain.py --config configs/demo/pretrain.yaml --train.max_steps 50

Each script declares a dataclass tree; `load_config` reads the YAML, applies
`--section.field value` overrides (values parsed as YAML scalars, so `50`, `3e-4`,
`true`, `null` and `[1, 2]` work), and builds the dataclasses, refusing unknown keys
with an error that names the key and the file. `config_to_dict` gives the resolved
config back for printing and saving beside a run's outputs.

Which fields a resumed run may change is declared on the field itself:
`resume_free(default)` (run length, logging, paths) instead of `default`; `resume_config(cfg)`
is the config without those fields, the part a checkpoint records and a resume must match.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from sprout.errors import SproutError

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


def parse_overrides(argv: list[str]) -> dict:
    """Turn `['--train.max_steps', '50', '--model.d_model=128']` into a nested dict."""
    out: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise SproutError(f"unrecognised argument {arg!r} (overrides look like --section.field VALUE)")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise SproutError(f"override {arg} has no value")
            key, raw = arg[2:], argv[i + 1]
            i += 2
        value = yaml.safe_load(raw) if raw != "" else ""
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
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


def _unwrap_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def from_dict(cls: type[T], data: dict, where: str = "config") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclasses."""
    if not isinstance(data, dict):
        raise SproutError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SproutError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        tp = _unwrap_optional(hints[name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            kwargs[name] = from_dict(tp, value, f"{where}.{name}")
        elif tp is float and isinstance(value, int) and not isinstance(value, bool):
            kwargs[name] = float(value)
        elif tp is float and isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
            try:
                kwargs[name] = float(value)
            except ValueError:
                raise SproutError(f"{where}.{name}: expected a number, got {value!r}") from None
        elif tp is tuple and isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except (SproutError, ValueError, TypeError) as exc:  # a dataclass's own validation
        raise SproutError(f"{where}: {exc}") from None


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: list[str] | dict | None = None) -> T:
    """YAML file (optional) + overrides -> dataclass `cls`."""
    data = read_yaml(path) if path else {}
    if overrides:
        data = merge(data, overrides if isinstance(overrides, dict) else parse_overrides(overrides))
    return from_dict(cls, data, str(path) if path else "config")


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


RESUME_FREE = {"resume": "free"}  # field metadata: this field may change when a run is resumed


def resume_free(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """`dataclasses.field` for a field a resume may change (run length, logging, paths)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata=RESUME_FREE)


def resume_free_paths(cls: type) -> set[str]:
    """Dotted paths of the fields declared `resume_free` in dataclass `cls` and the dataclasses in it."""
    hints = typing.get_type_hints(cls)
    paths = set()
    for f in dataclasses.fields(cls):
        tp = _unwrap_optional(hints[f.name])
        if f.metadata.get("resume") == "free":
            paths.add(f.name)
        elif dataclasses.is_dataclass(tp):
            paths |= {f"{f.name}.{p}" for p in resume_free_paths(tp)}
    return paths


def resume_config(cfg: Any) -> dict:
    """`cfg` as a dict without its `resume_free` fields: what a resume must match."""
    free = resume_free_paths(type(cfg))

    def keep(node: dict, prefix: str) -> dict:
        return {k: keep(v, f"{prefix}{k}.") if isinstance(v, dict) else v
                for k, v in node.items() if f"{prefix}{k}" not in free}

    return keep(config_to_dict(cfg), "")


def dump_yaml(cfg: Any) -> str:
    data = config_to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    return yaml.safe_dump(data, sort_keys=False)
