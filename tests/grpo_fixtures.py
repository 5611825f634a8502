"""Helpers of the GRPO tests: 1-digit addition prompt files (and the `data` fixture that writes
them per test module, used by the PPO tests too), small configs, test reward functions,
and a sampler that draws each prompt's completions from a generator of that prompt alone, so
that 1 process and 2 processes generate the same rollouts (the normaliser tests).

    python tests/grpo_fixtures.py CONFIG.json ...  # run_grpo with per-prompt sampling, one run per
                                                   # config in turn (launched workers: one launch, many runs)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sprout.chat import TEMPLATE_VERSION, render
from sprout.checkpoint import save_checkpoint
from sprout.losses.tokens import token_nll_sum
from sprout.model.transformer import ModelConfig, Transformer

from sprout.config import from_dict
from sprout.formats.prompts import write_prompts
from sprout.answers import parse_answer
from sprout.stages.grpo import GRPOConfig, GRPOStage, run_grpo
from sprout.stages.rl_stage import RLStage, concat_rollouts

CONTEXT = 64  # max_seq_len of the tiny models


def addition_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append({"id": f"add{seed}-{i}", "source": "arithmetic", "level": 1, "gold": str(a + b),
                    "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}]})
    return out


def write_prompt_files(folder: Path, n_train: int = 64, n_test: int = 8) -> Path:
    """prompts.jsonl, prompts_dev.jsonl and prompts_test.jsonl (the same prompts) in `folder`; the
    held-out prompts are questions the train file does not ask (a trainer refuses a shared prompt)."""
    folder.mkdir(parents=True, exist_ok=True)
    train = addition_prompts(n_train, 0)
    asked = {r["prompt"][0]["content"] for r in train}
    test = [r for r in addition_prompts(100, 1) if r["prompt"][0]["content"] not in asked][:n_test]
    write_prompts(folder / "prompts.jsonl", train)
    write_prompts(folder / "prompts_dev.jsonl", test)
    write_prompts(folder / "prompts_test.jsonl", test)
    return folder / "prompts.jsonl"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The prompt files of `write_prompt_files` a test module's runs read; a module gets them
    with `from grpo_fixtures import data`."""
    return write_prompt_files(tmp_path_factory.mktemp("prompts"))


def write_sft_lm(path: Path, sp, steps: int, seed: int = 0) -> Path:
    """A tiny LM trained for `steps` full-batch Adam steps to answer the addition prompts as
    `<answer>N</answer>` (briefly: it answers in that shape, right only part of the time),
    saved with the meta an SFT run writes."""
    torch.manual_seed(seed)
    lm = Transformer(ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=CONTEXT))
    rows = [render(r["prompt"] + [{"role": "assistant", "content": f"<answer>{r['gold']}</answer>"}], sp)
            for r in addition_prompts(100, 5)]
    T = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([i + [0] * (T - len(i)) for i, _ in rows])
    mask = torch.tensor([m + [0] * (T - len(m)) for _, m in rows])
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    for _ in range(steps):
        nll, n = token_nll_sum(lm(ids[:, :-1]), ids[:, 1:], mask[:, 1:])
        opt.zero_grad()
        (nll / n).backward()
        opt.step()
    meta = {"model_config": lm.config, "tokenizer": sp.spec, "tokenizer_fingerprint": sp.fingerprint(),
            "template_version": TEMPLATE_VERSION, "stage": "sft", "step": steps}
    return save_checkpoint(path, lm, meta=meta)


# ---- reward functions the tests name as "grpo_fixtures:<name>" ----
def digit_share(completions, **_):
    """The share of a completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def single_digit(completions, **_):
    """1 when the completion's answer (`<answer>N</answer>`) is a single digit, else 0."""
    answers = [parse_answer(c) for c in completions]
    return [1.0 if a is not None and len(a) == 1 and a.isdigit() else 0.0 for a in answers]


def parity(completions, gold, **_):
    """0 for every completion of a prompt with an even gold (a group that teaches nothing);
    the completion's length parity otherwise."""
    return [0.0 if int(g) % 2 == 0 else float(len(c) % 2) for c, g in zip(completions, gold)]


def constant(completions, **_):
    return [1.0] * len(completions)


SECTIONS = {
    "data": ("path", "val_path", "max_prompt_length", "eval_prompts", "eval_batch", "eval_num_generations"),
    "batch": ("global_prompts", "num_generations", "micro_completions"),
    "rollout": ("max_completion_length", "temperature", "top_k", "top_p"),
    "rewards": ("reward_funcs", "reward_weights"),
    "grpo": ("advantage", "scale_rewards", "multi_objective_aggregation", "normalize_advantages", "loss_type", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
             "num_iterations", "beta", "kl_estimator", "kl_in", "mask_truncated_completions", "dynamic_sampling",
             "max_generation_rounds", "entropy_coef"),
    "optim": ("lr", "warmup_steps", "schedule", "weight_decay"),
    "train": ("max_steps", "log_every", "eval_every", "ckpt_every", "keep_checkpoints", "progress", "peak_tflops",
              "seed"),
}


def config_dict(data: Path, init: Path, out: Path, **values) -> dict:
    defaults = {"max_prompt_length": 24, "eval_prompts": 8, "eval_batch": 8, "global_prompts": 2,
                "num_generations": 4, "micro_completions": 4, "max_completion_length": 12,
                "reward_funcs": ["grpo_fixtures:digit_share"], "lr": 3e-3, "warmup_steps": 0, "schedule": "constant",
                "max_steps": 4, "log_every": 1, "eval_every": 0, "ckpt_every": 0, "progress": False,
                "peak_tflops": -1.0}
    cfg: dict = {"init": str(init), "out": str(out), "data": {"path": str(data)}}
    for k, v in {**defaults, **values}.items():
        section = next(s for s, names in SECTIONS.items() if k in names)
        cfg.setdefault(section, {})[k] = v
    return cfg


def tiny_cfg(data: Path, init: Path, out: Path, **values) -> GRPOConfig:
    return from_dict(GRPOConfig, config_dict(data, init, out, **values))


def per_prompt_sample(self, idx, ids=None):
    """`RLStage.sample`, one prompt at a time, each from a generator seeded by the prompt and
    the loader's position: the same completions whichever rank holds the prompt."""
    parts = []
    for i in idx:
        self.generator.manual_seed(int(i) * 7919 + self.loader.epoch * 131 + self.loader.step)
        parts.append(RLStage.sample(self, np.array([i])))
    return concat_rollouts(parts)


def with_per_prompt_sampling(stage_cls, run, cfg, resume=None) -> dict:
    """`run(cfg, resume=resume)` with `stage_cls.sample` replaced by `per_prompt_sample`."""
    original = stage_cls.sample
    stage_cls.sample = per_prompt_sample
    try:
        return run(cfg, resume=resume)
    finally:
        stage_cls.sample = original


def run_per_prompt(cfg: GRPOConfig, resume=None) -> dict:
    return with_per_prompt_sampling(GRPOStage, run_grpo, cfg, resume)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from sprout.errors import run_main

    def main() -> None:
        import sprout.engine.run_stage as engine_run

        end_processes = engine_run.end_processes
        for i, path in enumerate(sys.argv[1:], 1):
            # a run ends its process group (end_processes); one that is not the last keeps it for the
            # next run (a barrier only): gloo cannot start a second group on the launch's store
            last = i == len(sys.argv) - 1
            engine_run.end_processes = end_processes if last else (lambda acc: acc.wait_for_everyone())
            run_per_prompt(from_dict(GRPOConfig, json.loads(Path(path).read_text())))

    run_main(main)
