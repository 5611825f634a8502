"""Helpers shared by the post-training tests (reward model, DPO, GRPO, PPO): a tiny LM checkpoint
as SFT would leave it (and the `base` fixture that writes one per test module), seeded synthetic
preference files written through the format's own writer, small configs, and a run folder holding
one checkpoint of another run to resume from."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from sprout.chat import TEMPLATE_VERSION
from sprout.checkpoint import save_checkpoint
from sprout.config import from_dict
from sprout.formats.preference_pairs import read_preferences, write_preferences
from sprout.model.transformer import ModelConfig, Transformer

WORDS = ["apple", "river", "stone", "cloud", "green", "music", "bread", "light", "horse", "paper", "ocean"]
MARK = "tiger"  # the word only chosen answers contain
CONTEXT = 64  # max_seq_len of the tiny model


def write_lm(path: Path, sp, seed: int = 0, meta: dict | None = None, **model) -> Path:
    """A tiny randomly initialised LM checkpoint, with the meta an SFT run writes (`meta`'s
    fields added or replacing them)."""
    torch.manual_seed(seed)
    lm = Transformer(ModelConfig(**{"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4,
                                    "max_seq_len": CONTEXT, **model}))
    meta = {"model_config": lm.config, "tokenizer": sp.spec, "tokenizer_fingerprint": sp.fingerprint(),
            "template_version": TEMPLATE_VERSION, "stage": "sft", "step": 80, **(meta or {})}
    return save_checkpoint(path, lm, meta=meta)


def resume_folder(run: Path, step: int, out: Path) -> Path:
    """`out`, a run folder whose only checkpoint is `run`'s of `step`, its `latest`: what a run
    stopped at `step` leaves, for `resume="latest"`."""
    name = f"step_{step:08d}"
    shutil.copytree(run / "checkpoints" / name, out / "checkpoints" / name)
    (out / "checkpoints" / "latest").write_text(name + "\n")
    return out


@pytest.fixture(scope="module")
def base(sp, tmp_path_factory):
    """The tiny LM checkpoint (`write_lm`, seed 0) a test module's runs start from; a module gets
    it with `from preference_train_fixtures import base`."""
    return write_lm(tmp_path_factory.mktemp("lm") / "ckpt", sp)


def marked_pairs(n: int, seed: int, source=lambda i: "synthetic") -> list[dict]:
    """Pairs of answers of 2-3 random words plus one more at a random place: MARK in the chosen
    answer, another word in the rejected one (same length): the preference a model must learn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.sample(WORDS, rng.randint(2, 3))
        at = rng.randint(0, len(words))
        marked, other = list(words), list(words)
        marked.insert(at, MARK)
        other.insert(at, rng.choice([w for w in WORDS if w not in words]))
        out.append({"id": f"s{seed}-{i}", "source": source(i),
                    "prompt": [{"role": "user", "content": f"Say some words {rng.choice(WORDS)}."}],
                    "chosen": [{"role": "assistant", "content": " ".join(marked)}],
                    "rejected": [{"role": "assistant", "content": " ".join(other)}]})
    return out


def write_pairs(folder: Path, n_train: int = 96, n_test: int = 32, seed: int = 0, **kw) -> Path:
    """folder/preferences.jsonl, and preferences_dev.jsonl and preferences_test.jsonl (the same
    pairs); returns the train file."""
    folder.mkdir(parents=True, exist_ok=True)
    write_preferences(folder / "preferences.jsonl", marked_pairs(n_train, seed, **kw))
    write_preferences(folder / "preferences_dev.jsonl", marked_pairs(n_test, seed + 1000, **kw))
    write_preferences(folder / "preferences_test.jsonl", marked_pairs(n_test, seed + 1000, **kw))
    return folder / "preferences.jsonl"


def grouped_held_out_pairs(data: Path, out: Path) -> Path:
    """out/preferences_test.jsonl: the first four held-out pairs beside `data`, the first three of
    source "arith" with rejected_kind near_miss, near_miss, broken_format, the fourth of source
    "chat" without one (a held-out file for the per-group accuracy of an eval)."""
    kinds = ["near_miss", "near_miss", "broken_format", None]
    rows = list(read_preferences(data.with_name("preferences_test.jsonl")))[:4]
    out.mkdir(parents=True, exist_ok=True)
    write_preferences(out / "preferences_test.jsonl",
                      [{**r, "source": "arith" if k else "chat", **({"rejected_kind": k} if k else {})}
                       for r, k in zip(rows, kinds)])
    return out / "preferences_test.jsonl"


def sections(cls, values: dict) -> dict:
    """{section: fields} for a config class: each key put in the section that declares it."""
    import dataclasses

    names = {s: set(v) for s, v in dataclasses.asdict(from_dict(cls, {})).items() if isinstance(v, dict)}
    out: dict = {}
    for k, v in values.items():
        section = next(s for s in names if k in names[s])
        out.setdefault(section, {})[k] = v
    return out


def tiny_cfg(cls, data: Path, init: Path, out: Path, **values):
    """A small config of `cls` (RewardConfig, DPOConfig); keyword values go to their section."""
    defaults = {"global_pairs": 16, "micro_pairs": 8, "max_steps": 12, "warmup_steps": 2, "lr": 3e-3,
                "weight_decay": 0.0, "log_every": 1, "eval_every": 6, "ckpt_every": 6, "progress": False,
                "peak_tflops": -1.0}
    cfg = sections(cls, {**defaults, **values})
    cfg.setdefault("data", {})["path"] = str(data)
    return from_dict(cls, {"init": str(init), **cfg, "out": str(out)})


def cli_flags(data: Path, init: Path, out: Path, **values) -> list[str]:
    """The same settings as `tiny_cfg` as command-line flags (`--section.field value`)."""
    from sprout.stages.reward import RewardConfig

    defaults = {"global_pairs": 16, "micro_pairs": 8, "max_steps": 12, "warmup_steps": 2, "lr": 3e-3,
                "weight_decay": 0.0, "log_every": 1, "eval_every": 6, "ckpt_every": 6, "progress": "false",
                "peak_tflops": -1.0}
    flags = ["--data", str(data), "--init", str(init), "--out", str(out)]
    for section, fields in sections(RewardConfig, {k: v for k, v in {**defaults, **values}.items()
                                                   if k in defaults}).items():
        for k, v in fields.items():
            flags += [f"--{section}.{k}", str(v)]
    return flags
