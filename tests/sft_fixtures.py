"""Helpers shared by the SFT tests: source files in each publisher's real format, a tiny
SentencePiece model with the role control pieces, and a small SFT config."""

from __future__ import annotations

import json
from pathlib import Path

from sprout.prep.tokenizer_train import train_sentencepiece
from sprout.tokenizer import load_tokenizer

ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "1. Eat a balanced diet.\n2. Exercise regularly.\n3. Get enough sleep."},
    {"instruction": "Arrange the following musical notes", "input": "G, B, E", "output": "E, G, B"},
    {"instruction": "Say nothing.", "input": "", "output": ""},  # empty output: a counted drop
    {"instruction": "Give three tips for staying healthy.", "input": "",  # exact duplicate of row 0
     "output": "1. Eat a balanced diet.\n2. Exercise regularly.\n3. Get enough sleep."},
]

DOLLY_ORIGINAL = [
    {"instruction": "When did Virgin Australia start operating?",
     "context": "Virgin Australia commenced services on 31 August 2000 as Virgin Blue.",
     "response": "Virgin Australia commenced services on 31 August 2000.", "category": "closed_qa"},
    {"instruction": "What is a polygon?", "context": "",
     "response": "A polygon is a closed plane figure bounded by straight segments.", "category": "open_qa"},
]

_WRAP = ("Below is an instruction that describes a task. Write a response that appropriately "
         "completes the request.\n\n### Instruction:\n{}\n\n### Response:\n")
# the mosaicml/dolly_hhrlhf form of the same two rows: context appended after one newline
DOLLY_PROMPT = [
    {"prompt": _WRAP.format(r["instruction"] + ("\n" + r["context"] if r["context"] else "")), "response": r["response"]}
    for r in DOLLY_ORIGINAL
]

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A shop sells 36 boxes of 30 pens. How many pens is that?",
     "answer": "That is 36*30 = <<36*30=1080>>1,080 pens.\n#### 1,080"},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_sources(root: Path) -> dict:
    """Write one file per source format under `root`; returns name -> path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "alpaca.json").write_text(json.dumps(ALPACA, indent=4), encoding="utf-8")
    return {
        "alpaca": root / "alpaca.json",
        "dolly_original": write_jsonl(root / "dolly.jsonl", DOLLY_ORIGINAL),
        "dolly_prompt": write_jsonl(root / "dolly_hhrlhf.jsonl", DOLLY_PROMPT),
        "gsm8k": write_jsonl(root / "gsm8k.jsonl", GSM8K),
    }


def source_list(paths: dict) -> list[dict]:
    return [
        {"name": "alpaca", "format": "alpaca", "path": str(paths["alpaca"])},
        {"name": "dolly", "format": "dolly", "path": str(paths["dolly_original"])},
        {"name": "dolly_hhrlhf", "format": "dolly", "path": str(paths["dolly_prompt"])},
        {"name": "gsm8k", "format": "gsm8k", "path": str(paths["gsm8k"])},
    ]


def tiny_sentencepiece(folder: Path):
    """A 512-piece BPE model trained by sprout (role pieces as control symbols)."""
    texts = [json.dumps(r) for r in ALPACA + DOLLY_ORIGINAL + GSM8K] * 20
    texts += ["The quick brown fox jumps over the lazy dog. 0123456789 <think> </think> <answer> </answer>"] * 20
    model = train_sentencepiece(texts, folder / "tiny", vocab_size=512)
    return load_tokenizer(f"sentencepiece:{model}")
