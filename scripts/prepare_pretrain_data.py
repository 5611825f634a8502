"""Prepare pretraining data: text sources -> clean -> dedup -> tokens -> verified .bin shards / HDF5.

    python scripts/prepare_pretrain_data.py --config configs/demo/pretrain_data.yaml
    python scripts/prepare_pretrain_data.py --source data.jsonl.zst --source stories.txt:0.5 \\
        --tokenizer tiktoken:r50k_base --out runs/data --workers 2 --format both

Flags override the config; other `--section.field value` pairs too (`--clean.min_chars 0`).
Paths may use ${SPROUT_MIRROR}, the data mirror: --mirror DIR, else $SPROUT_MIRROR, else
../shared/data beside the repository (`sprout.mirror`). See `sprout.prep.pretrain`.
"""

from __future__ import annotations

import argparse
import sys

from sprout.config import dump_yaml, load_config, merge, parse_overrides
from sprout.config_help import add_config_help
from sprout.errors import run_main
from sprout.prep.pretrain import PrepConfig, prepare

FLAGS = {"text_field": str, "tokenizer": str, "out": str, "val_frac": float, "val_docs": int,
         "shard_tokens": int, "run_tokens": int, "train_tokens": int, "workers": int, "format": str,
         "mirror": str, "seed": int, "name": str, "token_dtype": str}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_help(parser, PrepConfig)
    parser.add_argument("--config", help="YAML config (configs/demo/pretrain_data.yaml)")
    parser.add_argument("--source", action="append", help="PATH_OR_HF_ID[:WEIGHT], repeatable; replaces the config's sources")
    for name, tp in FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=tp, help=argparse.SUPPRESS)  # a config field
    parser.add_argument("--strict", action="store_true", default=None, help=argparse.SUPPRESS)  # the config field
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    args, rest = parser.parse_known_args()
    overrides = {k: getattr(args, k) for k in (*FLAGS, "strict") if getattr(args, k) is not None}
    if args.source:
        overrides["sources"] = args.source
    cfg = load_config(PrepConfig, args.config, merge(parse_overrides(rest), overrides))
    print(dump_yaml(cfg), end="", flush=True)
    prepare(cfg, command=list(sys.argv), progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    run_main(main)
