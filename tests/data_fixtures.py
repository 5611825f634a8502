"""Helpers shared by the data-pipeline tests: synthetic documents and a tiny SentencePiece model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sprout.prep.tokenizer_train import train_sentencepiece
from sprout.tokenizer import load_tokenizer

WORDS = ("the a little girl boy dog cat ball park tree sun happy sad big small red blue went saw "
         "played ran jumped found said mom dad friend house garden river cake toy day night once "
         "upon time there was very and but so then they he she it with to in on at of for").split()


def make_docs(n: int, seed: int = 0, prefix: str = "", min_words: int = 30, max_words: int = 120) -> list[str]:
    """`n` distinct story-like documents (several sentences, a newline now and then)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(min_words, max_words)))
        sentences = [" ".join(words[j : j + 8]).capitalize() + "." for j in range(0, len(words), 8)]
        body = " ".join(sentences[:3]) + "\n" + " ".join(sentences[3:])
        docs.append(f"{prefix}Story {seed}-{i}. {body}")
    return docs


def train_tiny_sp(directory: Path, vocab_size: int = 400):
    """A small SentencePiece BPE model trained on synthetic stories (a couple of seconds)."""
    texts = make_docs(1500, seed=123) + ["Café, naïve, “quotes” — dashes… 日本語 ✓ 😀 tab\tand\r\nCRLF  double  space"] * 5
    path = train_sentencepiece(iter(texts), directory / "tiny", vocab_size)
    return load_tokenizer(f"sentencepiece:{path}")
