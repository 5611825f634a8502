"""A script's config, dry: its `main` run on a command line with its work replaced, and the
batch sizes of a trainer's config checked against a process count and a context.

`dry_run` runs a prep or training script's own `main` (argument parser, config dataclass,
`--section.field` overrides) with the function it hands its config to (the prep, the trainer's
run; `WORK`) replaced by one that keeps that config, so a config refused at a stage's start is
refused here in the same line. `check_batches` checks what a trainer's start checks of its
sizes: a global batch that divides over the processes into whole micro-batches, and rows and
rollouts that fit the model's context.
"""

from __future__ import annotations

import importlib
import runpy
import shlex
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest

from sprout.engine.stage import micro_steps
from sprout.stages.rl_stage import rollout_micro_steps

# script -> (module, the function its main hands the config to): replaced by one that keeps it
WORK = {
    "train_tokenizer.py": ("sprout.prep.tokenizer_train", "train_from_sources"),
    "prepare_pretrain_data.py": ("sprout.prep.pretrain", "prepare"),
    "prepare_sft_data.py": ("sprout.prep.sft_data", "prepare"),
    "prepare_preference_data.py": ("sprout.prep.preference_data", "prepare"),
    "prepare_rl_prompts.py": ("sprout.prep.rl_prompts", "prepare"),
    "pretrain.py": ("sprout.stages.pretrain", "run_pretrain"),
    "train_sft.py": ("sprout.stages.sft", "run_sft"),
    "train_reward.py": ("sprout.stages.reward", "run_reward"),
    "train_dpo.py": ("sprout.stages.dpo", "run_dpo"),
    "train_ppo.py": ("sprout.stages.ppo", "run_ppo"),
    "train_grpo.py": ("sprout.stages.grpo", "run_grpo"),
}
# what a script's main reads from a tokenizer it loads before its work (none exists yet)
NO_TOKENIZER = types.SimpleNamespace(vocab_size=0, eot_id=0, bos_id=None, pad_id=None, fingerprint=lambda: "")


def dry_run(script: Path, args: list[str], monkeypatch, capsys):
    """The config `script`'s main builds from `args`, its work replaced by keeping that config;
    AssertionError with the script's own error line when it refuses them."""
    kept = []
    module, name = WORK[script.name]
    monkeypatch.setattr(importlib.import_module(module), name,
                        lambda cfg, *_args, **_kwargs: kept.append(cfg) or defaultdict(dict))
    monkeypatch.setattr("sprout.tokenizer.load_tokenizer", lambda *_args, **_kwargs: NO_TOKENIZER)
    monkeypatch.setattr(sys, "argv", [script.name, *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 0 and len(kept) == 1, f"{script.name} {shlex.join(args)}: {err}"
    return kept[0]


def check_batches(script: str, cfg, world: int, context: int, row_len: int | None = None) -> None:
    """The sizes of trainer `script`'s config `cfg` on `world` processes and a model of
    `context` tokens (`row_len`: the SFT rows'); SproutError (the stage's own check) or
    AssertionError when they do not fit."""
    if script == "pretrain.py":
        assert cfg.batch.micro_tokens % cfg.data.seq_len == 0 and cfg.data.seq_len <= context, script
        micro_steps(cfg.batch.global_tokens, cfg.batch.micro_tokens, world)
    elif script == "train_sft.py":
        assert cfg.batch.micro_tokens % row_len == 0, f"micro_tokens {cfg.batch.micro_tokens}, rows of {row_len}"
        assert row_len <= context, f"rows of {row_len}, context {context}"
        micro_steps(cfg.batch.global_tokens, cfg.batch.micro_tokens, world)
    elif script in ("train_reward.py", "train_dpo.py"):
        assert (cfg.data.seq_len or context) <= context, f"data.seq_len {cfg.data.seq_len}, context {context}"
        micro_steps(cfg.batch.global_pairs, cfg.batch.micro_pairs, world, unit="pairs")
    elif script in ("train_ppo.py", "train_grpo.py"):
        assert cfg.batch.global_prompts % world == 0, f"{cfg.batch.global_prompts} prompts on {world} processes"
        rollout_micro_steps(cfg.batch.global_prompts // world, cfg.batch, getattr(cfg.batch, "num_mini_batches", 1))
        longest = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
        assert longest <= context, f"prompt + completion {longest}, context {context}"
