"""The synthetic inputs of benchmarks/gpu_check.py, made on the spot with nothing downloaded
(the machine it runs on may have neither internet nor a data mirror):

- `random_shards`: uniform random token ids with an unnamed tokenizer, for the throughput
  runs of the real pretraining shapes (gpt2-small's 50,257-token vocabulary);
- `train_tokenizer`: a 512-piece SentencePiece model (`sprout.prep.tokenizer_train`, with
  the chat role pieces) trained on `synthetic_texts`;
- `text_shards`: `synthetic_texts` encoded with that tokenizer, each document followed by
  its eot: the shards of the base model every post-training run starts from, so the base
  checkpoint records the tokenizer and its vocabulary is the tokenizer's;
- `sft_rows`, `preference_pairs`, `rl_prompts`: the SFT, preference and RL prompt files
  written by the real prep pipelines (`sprout.prep.sft_data`, `.preferences`, `.rl_prompts`)
  from their `arithmetic` sources (`sprout.prep.arithmetic`), which need no data file;
- `tiny_export`: a random model of SmolLM2's kind with that tokenizer as a transformers
  folder, what the trl_compare stage imports on the CPU (benchmarks/gpu_check_trl.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from sprout.config import from_dict
from sprout.formats.manifest import write_shard_manifest
from sprout.formats.shards import dtype_for_vocab, shard_name, write_shard
from sprout.model.config import ModelConfig
from sprout.prep import arithmetic
from sprout.prep import preference_data as preference_prep
from sprout.prep import rl_prompts as prompt_prep
from sprout.prep import sft_data as sft_prep
from sprout.prep.tokenizer_train import train_sentencepiece
from sprout.tokenizer import load_tokenizer

TOKENIZER_VOCAB = 512  # about the most BPE pieces the synthetic text below can give
WORDS = ("the a little girl boy dog cat ball park tree sun happy sad big small red blue went saw "
         "played ran jumped found said mom dad friend house garden river cake toy day night once "
         "upon time there was very and but so then they he she it with to in on at of for").split()


def quiet(*_args, **_kwargs) -> None:
    """A `log` for the prep pipelines: their per-file lines would drown the runs' output."""


def random_shards(folder: Path, vocab: int, train_tokens: int, val_tokens: int) -> Path:
    """Random token shards with a manifest giving the vocab (no tokenizer spec)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab)
    write_shard(folder / shard_name("synthetic", "train", 0), rng.integers(0, vocab, train_tokens), dtype)
    write_shard(folder / shard_name("synthetic", "val", 0), rng.integers(0, vocab, val_tokens), dtype)
    write_shard_manifest(folder, "synthetic", vocab)
    return folder


def synthetic_texts(n: int, seed: int = 0) -> list[str]:
    """`n` documents: worked arithmetic answers (the post-training data's text) alternating
    with story-like word salad."""
    rng = random.Random(seed)
    problems = list(arithmetic.generate(n // 2 + 1, seed=seed, split="all"))
    texts = []
    for i in range(n):
        if i % 2 == 0:
            p = problems[(i // 2) % len(problems)]
            texts.append(f"{p.question} {p.worked}")
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 80))]
            texts.append(" ".join(words).capitalize() + ".")
    return texts


def train_tokenizer(folder: Path):
    """The SentencePiece tokenizer of every post-training run (`TOKENIZER_VOCAB` pieces)."""
    model = train_sentencepiece(synthetic_texts(4000), folder / f"sp{TOKENIZER_VOCAB}", TOKENIZER_VOCAB)
    return load_tokenizer(f"sentencepiece:{model}")


def text_shards(folder: Path, tok, train_tokens: int, val_tokens: int) -> Path:
    """`synthetic_texts` encoded by `tok`, documents each followed by eot, repeated to fill
    `train_tokens` (train) and `val_tokens` (val, other documents)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, tokens, seed in (("train", train_tokens, 0), ("val", val_tokens, 1)):
        flat, _ = tok.encode_docs(synthetic_texts(2000, seed=seed))
        ids = np.resize(flat, tokens)  # the documents again and again
        write_shard(folder / shard_name("synthetic", split, 0), ids, dtype_for_vocab(tok.vocab_size))
    write_shard_manifest(folder, "synthetic", tok.vocab_size, tok.eot_id)
    return folder


def sft_rows(path: Path, tok, seq_len: int, problems: int) -> Path:
    """Packed SFT rows of `seq_len` tokens (and the `_val` file beside them): `problems`
    arithmetic questions with worked answers, rendered with the chat template."""
    cfg = from_dict(sft_prep.SFTDataConfig, {
        "tokenizer": tok.spec, "out": str(path), "seq_len": seq_len, "val_fraction": 0.05,
        "sources": [{"name": "arithmetic", "format": "arithmetic", "count": problems}]})
    sft_prep.prepare(cfg, tok, command="benchmarks/gpu_check.py", log=quiet)
    return path


def preference_pairs(folder: Path, pairs: int) -> Path:
    """preferences.jsonl and preferences_test.jsonl (and their manifest): arithmetic pairs,
    a worked answer against a near miss or a broken format."""
    cfg = from_dict(preference_prep.PreferenceDataConfig, {
        "out": str(folder), "test_fraction": 0.1,
        "sources": [{"name": "arithmetic", "format": "arithmetic", "count": pairs}]})
    preference_prep.prepare(cfg, command="benchmarks/gpu_check.py", log=quiet)
    return folder / "preferences.jsonl"


def rl_prompts(folder: Path, train: int, test: int) -> Path:
    """prompts.jsonl, prompts_dev.jsonl and prompts_test.jsonl: the generator's train, dev and
    test problems, with gold answers and levels."""
    cfg = from_dict(prompt_prep.PromptDataConfig, {
        "out": str(folder),
        "sources": [{"name": "arithmetic", "format": "arithmetic", "count": train, "split": "train",
                     "own_split": True},
                    {"name": "arithmetic_dev", "format": "arithmetic", "count": test, "split": "dev",
                     "own_split": True},
                    {"name": "arithmetic_test", "format": "arithmetic", "count": test, "split": "test",
                     "own_split": True}]})
    prompt_prep.prepare(cfg, command="benchmarks/gpu_check.py", log=quiet)
    return folder / "prompts.jsonl"


def tiny_export(folder: Path, tok) -> Path:
    """A random model (seed 0) of SmolLM2's kind, grouped-query attention and tied embeddings,
    at the demo scale (d_model 64, 2 layers, context 256), with `tok`, written by
    `sprout.model.export.export_model` as a transformers folder (replacing one there)."""
    from sprout.model.export import export_model
    from sprout.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    max_seq_len=256, tie_embeddings=True))
    export_model(model, tok, folder, overwrite=True)
    return folder
