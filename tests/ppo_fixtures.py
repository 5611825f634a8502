"""Helpers of the PPO tests: small configs over the GRPO tests' addition prompts, a tiny reward
model trained to prefer digits, and a launched worker with per-prompt sampling (so 1 and 2
processes generate the same rollouts).

    python tests/ppo_fixtures.py CONFIG.json      # run_ppo with per-prompt sampling (a launched worker)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from grpo_fixtures import CONTEXT, addition_prompts, with_per_prompt_sampling
from sprout.chat import TEMPLATE_VERSION, render
from sprout.checkpoint import save_checkpoint
from sprout.config import from_dict
from sprout.losses.preference import reward_pair_loss
from sprout.model.heads import RewardModel
from sprout.model.transformer import ModelConfig
from sprout.stages.ppo import PPOConfig, PPOStage, run_ppo
from sprout.stages.reward import score_sequences

SECTIONS = {
    "data": ("path", "val_path", "max_prompt_length", "eval_prompts", "eval_batch", "eval_num_generations"),
    "batch": ("global_prompts", "num_generations", "micro_completions", "num_mini_batches"),
    "rollout": ("max_completion_length", "temperature", "top_k", "top_p"),
    "rewards": ("reward_funcs", "reward_weights"),
    "ppo": ("reward_model_weight", "missing_eos", "missing_eos_penalty", "kl_coef", "kl_estimator", "kl_in",
            "adaptive_kl", "target_kl", "horizon", "gamma", "lam", "whiten_rewards", "cliprange", "dual_clip",
            "vf_coef", "cliprange_value", "entropy_coef", "num_ppo_epochs", "value_init", "value_lr", "vf_lr_scale",
            "value_warmup_steps"),
    "optim": ("lr", "warmup_steps", "schedule", "weight_decay"),
    "train": ("max_steps", "log_every", "eval_every", "ckpt_every", "keep_checkpoints", "progress", "peak_tflops",
              "seed"),
}


def config_dict(data: Path, init: Path, out: Path, reward_model: Path | None = None, **values) -> dict:
    defaults = {"max_prompt_length": 24, "eval_prompts": 8, "eval_batch": 8, "eval_num_generations": 0,
                "global_prompts": 4, "num_generations": 2, "micro_completions": 4, "max_completion_length": 12,
                "reward_funcs": ["grpo_fixtures:digit_share"], "num_ppo_epochs": 1, "lr": 3e-3, "warmup_steps": 0,
                "schedule": "constant", "max_steps": 4, "log_every": 1, "eval_every": 0, "ckpt_every": 0,
                "progress": False, "peak_tflops": -1.0}
    cfg: dict = {"init": str(init), "out": str(out), "data": {"path": str(data)},
                 "reward_model": str(reward_model or "")}
    for k, v in {**defaults, **values}.items():
        section = next(s for s, names in SECTIONS.items() if k in names)
        cfg.setdefault(section, {})[k] = v
    return cfg


def tiny_cfg(data: Path, init: Path, out: Path, reward_model: Path | None = None, **values) -> PPOConfig:
    return from_dict(PPOConfig, config_dict(data, init, out, reward_model, **values))


def digit_pairs(n: int, seed: int, sp) -> list[tuple[list[int], list[int]]]:
    """(chosen, rejected) token rows for the addition prompts: a run of digits against a run of letters."""
    rng = random.Random(seed)
    out = []
    for r in addition_prompts(n, seed):
        k = rng.randint(1, 6)
        good = " ".join(rng.choice("0123456789") for _ in range(k))
        bad = " ".join(rng.choice("abcdefghij") for _ in range(k))
        out.append(tuple(render(r["prompt"] + [{"role": "assistant", "content": text}], sp)[0] for text in (good, bad)))
    return out


def write_digit_reward_model(path: Path, sp, steps: int = 30, seed: int = 0) -> Path:
    """A tiny reward model (the policy's tokenizer and context) trained for `steps` full-batch
    Adam steps to score digits above letters, saved with the meta a reward run writes."""
    torch.manual_seed(seed)
    rm = RewardModel(ModelConfig(vocab_size=512, d_model=64, n_layers=1, n_heads=4, max_seq_len=CONTEXT))
    rows = [row for pair in digit_pairs(32, seed + 7, sp) for row in pair]
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    opt = torch.optim.Adam(rm.parameters(), lr=3e-3)
    for _ in range(steps):
        scores = score_sequences(rm, ids, mask)
        loss = reward_pair_loss(scores[0::2], scores[1::2]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    meta = {"model_config": rm.config, "tokenizer": sp.spec, "tokenizer_fingerprint": sp.fingerprint(),
            "template_version": TEMPLATE_VERSION, "stage": "reward", "step": steps}
    return save_checkpoint(path, rm, meta=meta)


def run_per_prompt(cfg: PPOConfig, resume=None) -> dict:
    return with_per_prompt_sampling(PPOStage, run_ppo, cfg, resume)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from sprout.errors import run_main

    run_main(lambda: run_per_prompt(from_dict(PPOConfig, json.loads(Path(sys.argv[1]).read_text()))) and None)
