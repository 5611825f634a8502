"""sprout: a small language model from raw text to an aligned reasoning model.

Imports go one way, down the layers (`tests/test_imports.py` checks it), listed here lowest
first: base (errors .. answers), text (tokenizer .. bpb), formats, prep, checkpoint, model with
losses, rl, evaluation, then the top-level `data_loader`, engine, stages, pipeline, scripts.

    errors.py        SproutError and `run_main`: what a user can cause ends in one line, exit 2
    atomic.py        atomic writes, write errors as one line, file hashing
    locks.py         folder locks: one process at a time writes a folder (a flock naming its pid)
    config.py        YAML config + command-line overrides -> typed, validated dataclasses
    config_help.py   a config's fields as a script's --help lists them
    ranges.py        the valid range of a numeric config field, declared beside the field
    option_names.py  hints for an unknown option: another spelling, or TRL's name for it
    mirror.py        the local data mirror: which folder, and `${SPROUT_MIRROR}` in paths
    answers.py       `<think>…</think><answer>N</answer>` answers and their exact numbers
    tokenizer.py     runtime tokenizers (tiktoken, SentencePiece, Hugging Face) and byte tables
    tokenizer_files.py  a tokenizer's files against what data or a checkpoint recorded of them
    chat_formats.py  chat formats as data: sprout, chatml, llama3
    chat.py          the chat template: a conversation -> (ids, loss_mask), and back
    chat_detect.py   the chat format a Jinja chat template writes
    bpb.py           bits per byte, a loss comparable across tokenizers
    formats/         the on-disk contracts, their readers, writers and checks (no torch)
    prep/            raw data -> those formats: pretraining, SFT, preference and RL prompt data (no torch)
    checkpoint.py    checkpoint files: weights, meta.json and their sha256, training state
    lora_weights.py  LoRA adapters as tensors: checkpoint names, merging, PEFT's file names
    model/           the transformer, heads, loading, generation, chat, import and export
    losses/          loss maths as pure functions of tensors, with their counts
    rl/              RL pieces that are not losses: verifiers, advantages, KL estimates
    evaluation/      held-out evaluation: pass@k, accuracy, intervals
    (data_loader)    top-level package: the on-disk formats as torch batches
    engine/          the one training loop every stage runs on
    stages/          one module per algorithm: pretrain, sft, reward, dpo, ppo, grpo
    pipeline/        the preset runner and its report card
"""

__version__ = "0.1.0"
