"""What generates the RL stages' rollouts (`rollout.engine`): an engine behind one small interface.

    engine = make_engine(rollout_cfg, model, tokenizer, accelerator, rows=64)
    out = engine.generate(input_ids, attention_mask, num_generations=8, max_new_tokens=256, temperature=1.0,
                          top_k=None, top_p=None, stop_ids={eot}, generator=g)   # a `Rollout`
    engine.update_weights(model)   # after every optimizer step

`RLStage.sample` makes the one `generate` call, whatever the engine, and `RLStage.setup` hooks
`update_weights` to the optimizer's step; everything else (prompts, rewards, the log-probs the
loss recomputes, `sampling/logp_diff_*`) is the same code for every engine. Engines: `sprout`
(`SproutEngine`: `generate_tokens` on the live policy, so `update_weights` has nothing to do)
and `vllm` (`sprout.stages.vllm_engine`: vLLM in this process on a copy of the weights). An
engine's log-probs are never trusted: the loss takes its own. `check_engine` refuses at start,
in one line, an engine that cannot run here.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from sprout.errors import SproutError
from sprout.model.generate import Rollout, generate_tokens

VLLM_INSTALL = "pip install -e '.[vllm]' in an environment of its own (make venv-vllm; docs/gpus.md)"


class RolloutEngine(Protocol):
    """Generates completions for the RL stages (see the module doc)."""

    name: str

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, num_generations: int,
                 max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None, stop_ids,
                 generator: torch.Generator) -> Rollout:
        """`num_generations` completions of each prompt of `input_ids` [B, P] (left-padded, `attention_mask`
        1 on real tokens), as `generate_tokens` returns them: rows i*G .. i*G+G-1 are prompt i's, each
        stopping at its first id of `stop_ids` (kept) or after `max_new_tokens`; random draws from
        `generator` only, so a resumed run draws the same numbers."""
        ...

    def update_weights(self, model: torch.nn.Module) -> None:
        """Called after every optimizer step with the policy: the next `generate` samples from its
        weights as they are now."""
        ...


class SproutEngine:
    """sprout's own KV-cached decode (`generate_tokens`) on the live policy, in eval mode under the
    accelerator's autocast; `rollout.compile` compiles its decode step, `rollout.cuda_graph` replays
    it as a CUDA graph."""

    name = "sprout"

    def __init__(self, model, vocab_size: int, *, autocast, compile: bool = False, cuda_graph: bool | str = "auto"):
        self.model, self.vocab_size, self.autocast, self.compile = model, vocab_size, autocast, compile
        self.cuda_graph = cuda_graph

    def generate(self, input_ids, attention_mask, *, num_generations, max_new_tokens, temperature, top_k, top_p,
                 stop_ids, generator) -> Rollout:
        self.model.eval()
        try:
            with self.autocast():
                return generate_tokens(self.model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                       num_generations=num_generations, temperature=temperature, top_k=top_k,
                                       top_p=top_p, stop_ids=stop_ids, vocab_size=self.vocab_size,
                                       generator=generator, compile=self.compile, cuda_graph=self.cuda_graph)
        finally:
            self.model.train()

    def update_weights(self, model) -> None:
        """Nothing: `generate` reads the live parameters."""


def sprout_engine(rollout, model, tokenizer, accelerator, rows: int) -> SproutEngine:
    return SproutEngine(model, tokenizer.vocab_size, autocast=accelerator.autocast, compile=rollout.compile,
                        cuda_graph=rollout.cuda_graph)


def vllm_engine(rollout, model, tokenizer, accelerator, rows: int):
    from sprout.stages.vllm_engine import VLLMEngine  # imports vllm: only for rollout.engine vllm

    return VLLMEngine(model, tokenizer.vocab_size, rows=rows, mixed_precision=accelerator.mixed_precision,
                      gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
                      sleep=rollout.vllm_enable_sleep_mode)


# rollout.engine -> its factory(rollout config, policy, tokenizer, accelerator, rows per generate call)
ENGINES = {"sprout": sprout_engine, "vllm": vllm_engine}


def make_engine(rollout, model, tokenizer, accelerator, *, rows: int) -> RolloutEngine:
    """The engine `rollout.engine` names, generating with `model` (the Trainer's generation model)
    for prompts of `tokenizer`; `rows`: completions per `generate` call (prompts × G)."""
    return ENGINES[rollout.engine](rollout, model, tokenizer, accelerator, rows)


def check_engine(name: str, processes: int) -> None:
    """SproutError, in one line, unless engine `name` can run here: vllm must import, in one process."""
    if name != "vllm":
        return
    try:
        importlib.import_module("vllm")
    except ImportError as e:
        raise SproutError(f"rollout.engine: vllm cannot be imported here ({e}); install it with {VLLM_INSTALL}, "
                          f"or set rollout.engine sprout") from None
    if processes != 1:
        raise SproutError(f"rollout.engine: vllm runs colocated in one process (one GPU), and this run has "
                          f"{processes}; launch one process, or set rollout.engine sprout")
