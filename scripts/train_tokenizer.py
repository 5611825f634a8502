"""Train a SentencePiece BPE tokenizer on any source the data pipeline reads.

    python scripts/train_tokenizer.py --source stories.txt --source web.jsonl.gz \\
        --text-field text --vocab-size 4096 --out runs/demo/tokenizer/sp4096
    python scripts/train_tokenizer.py --config configs/demo/tokenizer.yaml --out runs/demo/tokenizer/sp4096

Writes OUT.model (use it as `--tokenizer sentencepiece:OUT.model`) and OUT.vocab. Byte
fallback, identity normalisation, special pieces at ids 0-6; see `sprout.prep.tokenizer_train`.
Paths may use ${SPROUT_MIRROR}, the data mirror (`sprout.mirror`).
"""

from __future__ import annotations

import argparse
import time

from sprout.config import dump_yaml, load_config, merge, parse_overrides
from sprout.config_help import add_config_help
from sprout.errors import run_main
from sprout.prep.tokenizer_train import TokenizerTrainConfig, train_from_sources
from sprout.tokenizer import load_tokenizer

FLAGS = {"text_field": str, "vocab_size": int, "out": str, "mirror": str, "max_chars": int}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_help(parser, TokenizerTrainConfig)
    parser.add_argument("--config", help="YAML config (configs/demo/tokenizer.yaml)")
    parser.add_argument("--source", action="append", help="PATH_OR_HF_ID, repeatable; replaces the config's sources")
    for name, tp in FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=tp, help=argparse.SUPPRESS)  # a config field
    parser.add_argument("--no-clean", dest="clean", action="store_false", default=None, help="train on the raw text")
    parser.add_argument("--strict", action="store_true", default=None, help=argparse.SUPPRESS)  # the config field
    args, rest = parser.parse_known_args()
    overrides = {k: getattr(args, k) for k in (*FLAGS, "clean", "strict") if getattr(args, k) is not None}
    if args.source:
        overrides["sources"] = args.source
    cfg = load_config(TokenizerTrainConfig, args.config, merge(parse_overrides(rest), overrides))
    print(dump_yaml(cfg), end="", flush=True)
    start = time.perf_counter()
    path = train_from_sources(cfg)
    tok = load_tokenizer(f"sentencepiece:{path}")
    print(f"wrote {path}: vocab {tok.vocab_size:,}, eot {tok.eot_id}, bos {tok.bos_id}, pad {tok.pad_id}, "
          f"sha256 {tok.fingerprint()[:16]}… in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    run_main(main)
