"""Prepare RL prompts with gold answers: GSM8K, arithmetic by level and local JSONL -> prompt JSONL.

    python scripts/prepare_rl_prompts.py --config configs/demo/rl_prompts.yaml \\
        --mirror ../shared/data --out runs/demo/rl_prompts

`${SPROUT_MIRROR}` in source paths is the data mirror: --mirror DIR, else $SPROUT_MIRROR, else
../shared/data beside the repository when it exists (`sprout.mirror`); without one, the
sources' hub ids are used.

Writes OUT/prompts.jsonl (train), OUT/prompts_test.jsonl (test: a source's own split, or
by a hash of the prompt) and OUT/manifest.json, in the format of `sprout.formats.prompts`;
see `sprout.prep.rl_prompts` for the steps. Flags override the config; other
`--field value` pairs too.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from sprout.config import add_config_help, dump_yaml, load_config, merge, parse_overrides
from sprout.errors import run_main
from sprout.prep.rl_prompts import PromptDataConfig, prepare

FLAGS = {"out": str, "mirror": str, "max_examples": int, "seed": int, "test_fraction": float}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_help(parser, PromptDataConfig)
    parser.add_argument("--config", help="YAML config (configs/demo/rl_prompts.yaml)")
    for name, tp in FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=tp)
    parser.add_argument("--no-dedup", action="store_true", help="keep prompts seen before")
    args, rest = parser.parse_known_args()
    overrides = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
    if args.no_dedup:
        overrides["dedup"] = False
    cfg = load_config(PromptDataConfig, args.config, merge(parse_overrides(rest), overrides))
    print(dump_yaml(cfg), end="")
    manifest = prepare(cfg, command=shlex.join(sys.argv))
    print(json.dumps({k: manifest[k] for k in ("files", "sources", "dropped", "levels")}, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
