"""The command line every prep script shares: the config fields in --help, --config, one flag
per config field the script names, --no-dedup and `--field value` overrides.

    parser = prep_parser(__doc__, PromptDataConfig, "configs/demo/rl_prompts.yaml", FLAGS)
    args, cfg = parse_prep_config(parser, PromptDataConfig, FLAGS, dedup_help="keep prompts seen before")

Flags override the config, other `--field value` pairs too; the resolved config is printed.
"""

from __future__ import annotations

import argparse
from typing import Callable

from sprout.config import add_config_help, dump_yaml, load_config, merge, parse_overrides


def prep_parser(doc: str, config_cls: type, config_example: str, flags: dict[str, type]) -> argparse.ArgumentParser:
    """A parser with the config fields in --help, --config and `--field-name` for each of `flags`
    (config field -> type); the script adds its own flags after these."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_config_help(parser, config_cls)
    parser.add_argument("--config", help=f"YAML config ({config_example})")
    for name, tp in flags.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=tp)
    return parser


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
