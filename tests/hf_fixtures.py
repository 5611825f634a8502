"""Tiny published-style models for the import, export and pipeline tests: random Llama, Qwen2 and
Mistral transformers models (`hf_model`, shapes in MODELS) and a byte-level BPE tokenizer with
ChatML's special tokens and chat template (`write_tokenizer`), written as a Hugging Face folder
by `hf_folder` (the `tiny_llama` fixture of conftest.py is one)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from sprout.chat_formats import SMOLLM2_SYSTEM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
          r"system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
          r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=24, rope_theta=10000.0, rope_scaling=LLAMA3_ROPE)),
    "llama tied": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=24, rope_scaling=LLAMA3_ROPE,
                                                            tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=256, head_dim=16)),
}


def write_tokenizer(folder: Path, template: str | None = CHATML) -> Path:
    """A byte-level BPE with ChatML's special tokens, its config naming eos and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["system\nuser\nassistant\n", SMOLLM2_SYSTEM, "What is 2 + 3? It is 5.", "Name three colours.",
              "The quick brown fox jumps over the lazy dog. 0123456789"]
    tk.train_from_iterator(corpus * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_model(kind: str, **shape):
    """A random tiny transformers model of `kind`, every weight (norms and biases too) random;
    `shape` overrides SHAPE's fields (e.g. a longer max_position_embeddings)."""
    import torch
    import transformers

    config_cls, model_cls, extra = MODELS[kind]
    torch.manual_seed(0)
    # a copy of `extra`: transformers adds to rope dicts
    config = getattr(transformers, config_cls)(**{**SHAPE, **shape}, **copy.deepcopy(extra))
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2 if p.dim() == 1 else 0.1)
    return model


def hf_folder(folder: Path, kind: str, **shape) -> Path:
    """`folder` as a Hugging Face model folder: `hf_model(kind, **shape)` saved with
    save_pretrained, and `write_tokenizer`'s ChatML tokenizer beside it."""
    hf_model(kind, **shape).save_pretrained(folder)
    return write_tokenizer(folder)
