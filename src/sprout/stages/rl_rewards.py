"""The reward functions of the RL stages (GRPO, PPO): the `rewards` config section and the
functions it names, built once at start.

`rewards.reward_funcs` lists built-in verifiers (`sprout.rl.verifiers`: correctness, format,
overlong) and "module:function" specs, TRL's signature `fn(completions, **columns) -> floats`;
each spec is imported and checked to be callable as a reward function before anything runs
(`import_reward`), and each function is logged under its own name (`rewards/<name>/mean`).
`rewards.reward_weights`, one per function, are finite numbers (NaN or inf is refused at start).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from sprout.config import require
from sprout.errors import SproutError
from sprout.ranges import in_range, is_finite_number
from sprout.rl.verifiers import (SoftOverlongPenalty, WeightedReward, check_reward_function, correctness_reward,
                                 format_reward)

REWARD_FUNCS = ("correctness", "format", "overlong")


@dataclass
class RewardsConfig:
    """The reward functions that score each completion, and their weights."""
    # correctness, format, overlong, or "module:function" (TRL's signature: fn(completions, **columns) -> floats)
    reward_funcs: list = dataclasses.field(default_factory=lambda: ["correctness", "format"])
    reward_weights: list | None = None  # one per function; None: 1.0 each
    # overlong: the last this many tokens before max_completion_length ramp to -1
    overlong_cache_length: int = in_range(0, "[0, inf)")

    def __post_init__(self) -> None:
        unknown = [f for f in self.reward_funcs if f not in REWARD_FUNCS and ":" not in str(f)]
        require(self.reward_funcs and not unknown, "reward_funcs", self.reward_funcs,
                f"a non-empty list of {', '.join(REWARD_FUNCS)} or module:function")
        require(self.reward_weights is None or len(self.reward_weights) == len(self.reward_funcs),
                "reward_weights", self.reward_weights, f"one weight per reward function ({len(self.reward_funcs)})")
        require(self.reward_weights is None or all(is_finite_number(w) for w in self.reward_weights),
                "reward_weights", self.reward_weights,
                "finite numbers (NaN or inf would make the reward totals NaN or inf)")
        require("overlong" not in self.reward_funcs or self.overlong_cache_length > 0, "overlong_cache_length",
                self.overlong_cache_length, "> 0 when reward_funcs has overlong")


def import_reward(spec: str):
    """The reward function named by "module:function" (the module importable from sys.path),
    refused unless it can be called as one (`sprout.rl.verifiers.check_reward_function`)."""
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (Exception, SystemExit) as exc:  # the module's own code may raise anything, or exit, while imported
        raise SproutError(f"rewards.reward_funcs: cannot import {spec!r} ({type(exc).__name__}: {exc})") from None
    check_reward_function(spec, fn, "rewards.reward_funcs")
    return fn


def build_rewards(cfg: RewardsConfig, max_completion_length: int) -> list[WeightedReward]:
    """The configured reward functions with their weights; each is named in metrics by its
    config name (`rewards/<name>/mean`; a "module:function" by its function's name)."""
    weights = cfg.reward_weights or [1.0] * len(cfg.reward_funcs)
    fns = {"correctness": correctness_reward, "format": format_reward}
    fns.update({spec.partition(":")[2]: import_reward(spec) for spec in cfg.reward_funcs if ":" in spec})
    if "overlong" in cfg.reward_funcs:
        if cfg.overlong_cache_length > max_completion_length:
            raise SproutError(f"rewards.overlong_cache_length {cfg.overlong_cache_length} exceeds "
                              f"rollout.max_completion_length {max_completion_length}")
        fns["overlong"] = SoftOverlongPenalty(max_completion_length, cfg.overlong_cache_length)
    names = [spec.partition(":")[2] if ":" in spec else spec for spec in cfg.reward_funcs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SproutError(f"rewards.reward_funcs: two reward functions are named {twice[0]!r} ({cfg.reward_funcs}); "
                          f"each is logged under its function's name")
    return [WeightedReward(name, fns[name], float(w)) for name, w in zip(names, weights)]
