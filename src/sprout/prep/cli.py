"""The command line every prep script shares: the config fields in --help (and the fields of a
`sources:` entry), --config, one flag per config field the script names (listed once, as the
config field it sets), --no-dedup and `--field value` overrides.

    parser = prep_parser(__doc__, PromptDataConfig, "configs/demo/rl_prompts.yaml", FLAGS)
    args, cfg = parse_prep_config(parser, PromptDataConfig, FLAGS, dedup_help="keep prompts seen before")

Flags override the config, other `--field value` pairs too; the resolved config is printed.
"""

from __future__ import annotations

import argparse
from typing import Callable

from sprout.config import dump_yaml, load_config, merge, parse_overrides
from sprout.config_help import add_config_help, config_fields, shown_default


def prep_parser(doc: str, config_cls: type, config_example: str, flags: dict[str, type], *,
                source_cls: type | None = None, formats: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """A parser with the config fields in --help, --config and `--field-name` for each of `flags`
    (config field -> type; listed once, among the config fields); with `source_cls`, the fields
    of one `sources:` entry follow (`source_help`). The script adds its own flags after these."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_config_help(parser, config_cls)
    if source_cls is not None:
        parser.epilog += "\n\n" + source_help(source_cls, formats)
    parser.add_argument("--config", help=f"YAML config ({config_example})")
    for name, tp in flags.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=tp, help=argparse.SUPPRESS)
    return parser


def source_help(source_cls: type, formats: tuple[str, ...] = ()) -> str:
    """The fields of one `sources:` entry for --help: name, type, default (or required) and
    meaning; `formats`: the values `format` takes."""
    rows = config_fields(source_cls)
    width = max(len(name) for name, *_ in rows) + 2
    lines = [f"source fields ({source_cls.__name__}): each entry of sources: in the YAML is a mapping of these"]
    for name, tp, default, meaning in rows:
        if name == "format" and formats:
            tp, meaning = "{" + ", ".join(formats) + "}", "how the records are read"
        shown = shown_default(default)
        lines.append(f"    {name:<{width}} {tp}{'' if shown == '(required)' else ' ='} {shown}" + (f"\n    {'':<{width}}   {meaning}" if meaning else ""))
    return "\n".join(lines)


def parse_prep_config(parser: argparse.ArgumentParser, config_cls: type, flags: dict[str, type], *,
                      dedup_help: str, extra_overrides: Callable[[argparse.Namespace], dict] | None = None):
    """(args, config) after adding --no-dedup (sets dedup: false): the --config file (or the
    defaults), then the `--field value` pairs, then `flags` and `extra_overrides(args)` on top.
    Prints the resolved config."""
    parser.add_argument("--no-dedup", action="store_true", help=dedup_help)
    args, rest = parser.parse_known_args()
    overrides = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    if args.no_dedup:
        overrides["dedup"] = False
    if extra_overrides is not None:
        overrides.update(extra_overrides(args))
    cfg = load_config(config_cls, args.config, merge(parse_overrides(rest), overrides))
    print(dump_yaml(cfg), end="")
    return args, cfg
