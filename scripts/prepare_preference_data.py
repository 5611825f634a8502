"""Prepare preference pairs: HH-RLHF, UltraFeedback, local JSONL and arithmetic -> preference JSONL.

    python scripts/prepare_preference_data.py --config configs/demo/preferences.yaml \\
        --mirror ../shared/data --out runs/demo/prefs

`${SPROUT_MIRROR}` in source paths is the data mirror: --mirror DIR, else $SPROUT_MIRROR, else
../shared/data beside the repository when it exists (`sprout.mirror`); without one, the
sources' hub ids are used.

Writes OUT/preferences.jsonl (train), OUT/preferences_test.jsonl (test, split by prompt)
and OUT/manifest.json, in the format of `sprout.formats.preferences`; see
`sprout.prep.preferences` for the steps. Flags override the config; other `--field value`
pairs too.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from sprout.config import add_config_help, dump_yaml, load_config, merge, parse_overrides
from sprout.errors import run_main
from sprout.prep.preferences import PreferenceDataConfig, prepare

FLAGS = {"out": str, "mirror": str, "max_examples": int, "seed": int, "test_fraction": float}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_help(parser, PreferenceDataConfig)
    parser.add_argument("--config", help="YAML config (configs/demo/preferences.yaml)")
    for name, tp in FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=tp)
    parser.add_argument("--no-dedup", action="store_true", help="keep exact duplicate pairs")
    args, rest = parser.parse_known_args()
    overrides = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
    if args.no_dedup:
        overrides["dedup"] = False
    cfg = load_config(PreferenceDataConfig, args.config, merge(parse_overrides(rest), overrides))
    print(dump_yaml(cfg), end="")
    manifest = prepare(cfg, command=shlex.join(sys.argv))
    print(json.dumps({k: manifest[k] for k in ("files", "sources", "dropped")}, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
