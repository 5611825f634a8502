"""Prepare packed SFT data: Alpaca, Dolly and GSM8K -> chat template -> HDF5 rows + loss_mask.

    python scripts/prepare_sft_data.py --config configs/demo/sft_data.yaml \\
        --mirror ../shared/data --tokenizer tiktoken:r50k_base --out runs/demo/sft/sft.h5
    python scripts/prepare_sft_data.py --source-format chat --source mine.jsonl \\
        --source-format gsm8k --source gsm8k_train.jsonl:0.5 --source-format arithmetic --source 500 \\
        --tokenizer tiktoken:r50k_base --seq-len 512 --out runs/mine/sft.h5

`--source PATH[:WEIGHT]` (repeatable; replaces the config's sources) reads a file in the
`--source-format` (`--format`) given last before it (before any: the last on the command line):
alpaca, dolly, gsm8k, chat, or arithmetic, whose PATH is the number of problems to generate.
`${SPROUT_MIRROR}` in paths is the data mirror: --mirror DIR, else $SPROUT_MIRROR, else
../shared/data when it exists (`sprout.mirror`); without one, the sources' hub ids are used.
Writes OUT (train) and OUT with `_val` before the suffix (val), in the format of
`sprout.formats.packed_sft` (steps: `sprout.prep.sft_data`). Flags override the config.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from sprout.errors import SproutError, run_main
from sprout.prep.chat_sources import FORMATS, source_from_arg
from sprout.prep.cli import parse_prep_config, prep_parser
from sprout.prep.sft_data import SFTDataConfig, prepare
from sprout.tokenizer import load_tokenizer

FLAGS = {"tokenizer": str, "out": str, "seq_len": int, "mirror": str, "max_examples": int,
         "seed": int, "val_fraction": float, "overlong": str}


class _SourceAction(argparse.Action):
    """Collect (PATH[:WEIGHT], the --format given before it or None) in command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        getattr(namespace, self.dest).append((value, getattr(namespace, "source_format", None)))


def _source_overrides(args: argparse.Namespace) -> dict:
    """{"sources": [...]} from the --source/--format flags, or {} without them."""
    if args.sources:
        if args.source_format is None:
            raise SproutError("--source needs --source-format (one of " + ", ".join(FORMATS) + ")")
        taken: set[str] = set()
        return {"sources": [source_from_arg(arg, fmt or args.source_format, taken) for arg, fmt in args.sources]}
    if args.source_format:
        raise SproutError("--source-format names the format of --source files; give --source PATH[:WEIGHT] after it")
    return {}


def main() -> int:
    parser = prep_parser(__doc__, SFTDataConfig, "configs/demo/sft_data.yaml", FLAGS)
    parser.add_argument("--source", action=_SourceAction, dest="sources", default=[],
                        help="PATH[:WEIGHT] in the current --source-format, repeatable; replaces the config's sources")
    parser.add_argument("--source-format", "--format", dest="source_format", metavar="FORMAT",
                        help=f"the format the --source files after it are read in (the input, not the output, "
                             f"which is always HDF5 rows): {', '.join(FORMATS)}")
    _, cfg = parse_prep_config(parser, SFTDataConfig, FLAGS, dedup_help="keep exact duplicate conversations",
                               extra_overrides=_source_overrides)
    tok = load_tokenizer(cfg.tokenizer, mirror=cfg.mirror)
    result = prepare(cfg, tok, command=shlex.join(sys.argv))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    run_main(main)
