"""Prepare RL prompts with gold answers: GSM8K, arithmetic by level and local JSONL -> prompt JSONL.

    python scripts/prepare_rl_prompts.py --config configs/demo/rl_prompts.yaml \\
        --mirror ../shared/data --out runs/demo/rl_prompts

`${SPROUT_MIRROR}` in source paths is the data mirror: --mirror DIR, else $SPROUT_MIRROR, else
../shared/data beside the repository when it exists (`sprout.mirror`); without one, the
sources' hub ids are used.

Writes OUT/prompts.jsonl (train), OUT/prompts_dev.jsonl (dev, what PPO and GRPO evaluate on),
OUT/prompts_test.jsonl (test; each a source's own split, or by a hash of the prompt) and
OUT/manifest.json, in the format of `sprout.formats.prompts`;
see `sprout.prep.rl_prompts` for the steps. Flags override the config; other
`--field value` pairs too.
"""

from __future__ import annotations

import json
import shlex
import sys

from sprout.errors import run_main
from sprout.prep.cli import parse_prep_config, prep_parser
from sprout.prep.rl_prompts import FORMATS, PromptDataConfig, PromptSourceConfig, prepare

FLAGS = {"out": str, "mirror": str, "max_examples": int, "seed": int, "test_fraction": float, "dev_fraction": float}


def main() -> int:
    parser = prep_parser(__doc__, PromptDataConfig, "configs/demo/rl_prompts.yaml", FLAGS,
                         source_cls=PromptSourceConfig, formats=FORMATS)
    _, cfg = parse_prep_config(parser, PromptDataConfig, FLAGS, dedup_help="keep prompts seen before")
    manifest = prepare(cfg, command=shlex.join(sys.argv))
    print(json.dumps({k: manifest[k] for k in ("files", "sources", "dropped", "levels")}, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
