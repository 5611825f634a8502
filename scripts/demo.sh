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

step "8. prepare the preference pairs (HH-RLHF + UltraFeedback + arithmetic) and check their loss mask"
$PY scripts/prepare_preference_data.py --config configs/demo/preferences.yaml --out "$DEMO/prefs"
$PY scripts/check_loss_mask.py "$DEMO/prefs/preferences.jsonl" --tokenizer "sentencepiece:$DEMO/tokenizer/sp4096.model" \
    --seq-len 256 --show 1 --html "$DEMO/prefs/loss_mask.html"

step "9. reward model from the fine-tuned model"
$PY scripts/train_reward.py --config configs/demo/reward.yaml --init "$DEMO/sft_model" \
    --data "$DEMO/prefs/preferences.jsonl" --out "$DEMO/reward_model" --train.progress false

step "10. DPO from the fine-tuned model (its own frozen reference)"
$PY scripts/train_dpo.py --config configs/demo/dpo.yaml --init "$DEMO/sft_model" \
    --data "$DEMO/prefs/preferences.jsonl" --out "$DEMO/dpo_model" --train.progress false

step "11. held-out preference results (first and last eval of each run's metrics.jsonl)"
$PY - "$DEMO" <<'PYEOF'
import sys
from pathlib import Path
from sprout.train.metrics import read_metrics

demo = Path(sys.argv[1])
for run, keys in (("reward_model", ("val_accuracy", "val_margin")),
                  ("dpo_model", ("val_rewards/accuracies", "val_rewards/margins"))):
    evals = [r for r in read_metrics(demo / run / "metrics.jsonl") if keys[0] in r]
    first, last = evals[0], evals[-1]
    shown = list(keys) + sorted(k for k in last if k.startswith("val_accuracy/"))  # per source
    print(f"{run} (step {first['step']} -> {last['step']}):")
    for k in shown:
        print(f"  {k:28s} {first.get(k, float('nan')):8.3f} -> {last[k]:8.3f}")
PYEOF
printf '\nDemo finished: outputs in %s (report.md, metrics.jsonl and loss.png in each run folder).\n' "$DEMO"
