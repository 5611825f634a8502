#!/usr/bin/env bash
# The whole pipeline on the CPU demo preset, from the local data mirror.
# Called by `make demo`; every step is one of the scripts the README documents.
set -euo pipefail
PY=${PY:-.venv/bin/python}
DEMO=${DEMO:-runs/demo}
MIRROR=${SPROUT_MIRROR:?set SPROUT_MIRROR to the data mirror folder}
export SPROUT_MIRROR="$MIRROR"
step() { printf '\n==> %s\n' "$*"; }

step "1. train the demo SentencePiece tokenizer"
$PY scripts/train_tokenizer.py --config configs/demo/tokenizer.yaml --out "$DEMO/tokenizer/sp4096"

step "2. prepare the pretraining shards (TinyStories + FineWeb + web text)"
$PY scripts/prepare_pretrain_data.py --config configs/demo/pretrain_data.yaml \
    --tokenizer "sentencepiece:$DEMO/tokenizer/sp4096.model" --out "$DEMO/data"

step "3. verify the shards"
$PY scripts/verify_shards.py "$DEMO/data"
