"""Prepare preference pairs: HH-RLHF, UltraFeedback, local JSONL and arithmetic -> preference JSONL.

    python scripts/prepare_preference_data.py --config configs/demo/preferences.yaml \\
        --mirror ../shared/data --out runs/demo/prefs

`${SPROUT_MIRROR}` in source paths is the data mirror: --mirror DIR, else $SPROUT_MIRROR, else
../shared/data beside the repository when it exists (`sprout.mirror`); without one, the
sources' hub ids are used.

Writes OUT/preferences.jsonl (train), OUT/preferences_dev.jsonl (dev, what the reward and DPO
stages evaluate on), OUT/preferences_test.jsonl (test; split by prompt) and OUT/manifest.json,
in the format of `sprout.formats.preference_pairs`; see `sprout.prep.preference_data` for the
steps. Flags override the config; other `--field value` pairs too.
"""

from __future__ import annotations

import json
import shlex
import sys

from sprout.errors import run_main
from sprout.prep.cli import parse_prep_config, prep_parser
from sprout.prep.preference_data import FORMATS, PreferenceDataConfig, PreferenceSourceConfig, prepare

FLAGS = {"out": str, "mirror": str, "max_examples": int, "seed": int, "test_fraction": float, "dev_fraction": float}


def main() -> int:
    parser = prep_parser(__doc__, PreferenceDataConfig, "configs/demo/preferences.yaml", FLAGS,
                         source_cls=PreferenceSourceConfig, formats=FORMATS)
    _, cfg = parse_prep_config(parser, PreferenceDataConfig, FLAGS, dedup_help="keep exact duplicate pairs")
    manifest = prepare(cfg, command=shlex.join(sys.argv))
    print(json.dumps({k: manifest[k] for k in ("files", "sources", "dropped")}, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
