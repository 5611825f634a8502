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

step "4. pretrain the demo base model (val loss and bits per byte before and after)"
$PY scripts/pretrain.py --config configs/demo/pretrain.yaml --data "$DEMO/data" --out "$DEMO/base" \
    --train.progress false

step "5. prepare the SFT data (Alpaca + Dolly + GSM8K) and check its loss mask"
$PY scripts/prepare_sft_data.py --config configs/demo/sft_data.yaml \
    --tokenizer "sentencepiece:$DEMO/tokenizer/sp4096.model" --out "$DEMO/sft/sft.h5"
$PY scripts/check_loss_mask.py "$DEMO/sft/sft.h5" --show 1 --html "$DEMO/sft/loss_mask.html"

step "6. supervised fine-tuning from the base model"
$PY scripts/train_sft.py --config configs/demo/sft.yaml --init "$DEMO/base" --data "$DEMO/sft/sft.h5" \
    --out "$DEMO/sft_model" --train.progress false

step "7. a few answers from the fine-tuned model (sampled: temperature 0.8, top-p 0.9, seed 0)"
for q in "What is the capital of France?" "Give three tips for staying healthy." \
         "Tom has 3 apples and buys 5 more. How many apples does he have?"; do
  printf '\n> %s\n' "$q"
  $PY scripts/chat.py "$DEMO/sft_model" --prompt "$q" --temperature 0.8 --top-p 0.9 --seed 0 --max-new-tokens 96
done
printf '\nDemo finished: outputs in %s (report.md, metrics.jsonl and loss.png in each run folder).\n' "$DEMO"
