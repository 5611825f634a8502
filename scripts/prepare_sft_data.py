"""Prepare packed SFT data: Alpaca, Dolly and GSM8K -> chat template -> HDF5 rows + loss_mask.

    python scripts/prepare_sft_data.py --config configs/demo/sft_data.yaml \\
        --mirror ../shared/data --tokenizer tiktoken:r50k_base --out runs/demo/sft/sft.h5

`${SPROUT_MIRROR}` in source paths is the data mirror: --mirror DIR, else $SPROUT_MIRROR, else
../shared/data beside the repository when it exists (`sprout.mirror`); without one, the
sources' hub ids are used.

Writes OUT (train) and OUT with `_val` before the suffix (val split), in the format of
`sprout.formats.sft`; see `sprout.prep.sft` for the steps and `sprout.prep.packing` for the
over-long policy. Flags override the config; other `--field value` pairs too.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from sprout.config import dump_yaml, load_config, merge, parse_overrides
from sprout.errors import run_main
from sprout.prep.sft import SFTDataConfig, prepare
from sprout.tokenizer import load_tokenizer

FLAGS = {"tokenizer": str, "out": str, "seq_len": int, "mirror": str, "max_examples": int,
         "seed": int, "val_fraction": float, "overlong": str}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (configs/demo/sft_data.yaml)")
    for name, tp in FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=tp)
    parser.add_argument("--no-dedup", action="store_true", help="keep exact duplicate conversations")
    args, rest = parser.parse_known_args()
    overrides = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
    if args.no_dedup:
        overrides["dedup"] = False
    cfg = load_config(SFTDataConfig, args.config, merge(parse_overrides(rest), overrides))
    print(dump_yaml(cfg), end="")
    tok = load_tokenizer(cfg.tokenizer, mirror=cfg.mirror)
    result = prepare(cfg, tok, command=shlex.join(sys.argv))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
