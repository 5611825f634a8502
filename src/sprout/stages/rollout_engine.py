"""What generates the RL stages' rollouts (`rollout.engine`): an engine behind one small interface.

    engine = make_engine(rollout_cfg, model, tokenizer, accelerator, rows=64)
    out = engine.generate(input_ids, attention_mask, num_generations=8, max_new_tokens=256, temperature=1.0,
                          top_k=None, top_p=None, stop_ids={eot}, generator=g)   # a `Rollout`
    engine.update_weights(model)   # after every optimizer step
    with engine.generating():      # around one step's generate calls (GRPO's dynamic-sampling rounds)
        ...

`RLStage.sample` makes the one `generate` call, whatever the engine, and `RLStage.setup` hooks
`update_weights` to the optimizer's step; everything else (prompts, rewards, the log-probs the
loss recomputes, `sampling/logp_diff_*`) is the same code for every engine. Engines: `sprout`
(`SproutEngine`: `generate_tokens` on the live policy; inside `generating()` its fused weight
copies are built once and reused until the block ends or `update_weights`) and `vllm`
(`sprout.stages.vllm_engine`: vLLM in this process on a copy of the weights). An engine's
log-probs are never trusted: the loss takes its own. `check_engine` refuses at start, in one line,
an engine that cannot run here.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import ContextManager, Protocol

import torch

from sprout.errors import SproutError
from sprout.model.decode import DecodeWeightsCache
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

    def generating(self) -> ContextManager[None]:
        """A block of `generate` calls on weights that do not change inside it (one optimizer step's
        rollouts): what an engine prepares per call it may keep for the block, and frees at its end."""
        ...


class SproutEngine:
    """sprout's own KV-cached decode (`generate_tokens`) on the live policy, in eval mode under the
    accelerator's autocast; `rollout.compile` compiles its decode step, `rollout.cuda_graph` replays
    it as a CUDA graph.

    Fused weight copies (`sprout.model.decode.DecodeWeights`, a model's size; with LoRA each
    W + s·B·A): outside `generating()` each `generate` builds its own and drops them on return.
    Inside, `weight_cache` (a `DecodeWeightsCache`) keeps the set the first call built and hands it
    to every later call of the same rows, kinds and autocast dtype; it is emptied by
    `update_weights` (the parameters changed) and dropped at the block's end, so no copy lives
    through the training forwards and backwards. The rule that makes the reuse exact: nothing
    changes the policy's parameters, nor which of its adapters are on, inside the block except an
    optimizer step, which calls `update_weights`. Under torch.distributed `generate_tokens` decodes
    through the module's forward (`ModelDecoder`): no copies, nothing kept."""

    name = "sprout"

    def __init__(self, model, vocab_size: int, *, autocast, compile: bool = False, cuda_graph: bool | str = "auto"):
        self.model, self.vocab_size, self.autocast, self.compile = model, vocab_size, autocast, compile
        self.cuda_graph = cuda_graph
        self.weight_cache: DecodeWeightsCache | None = None  # inside `generating()` only

    def generate(self, input_ids, attention_mask, *, num_generations, max_new_tokens, temperature, top_k, top_p,
                 stop_ids, generator) -> Rollout:
        self.model.eval()
        try:
            with self.autocast():
                return generate_tokens(self.model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                       num_generations=num_generations, temperature=temperature, top_k=top_k,
                                       top_p=top_p, stop_ids=stop_ids, vocab_size=self.vocab_size,
                                       generator=generator, compile=self.compile, cuda_graph=self.cuda_graph,
                                       weight_cache=self.weight_cache)
        finally:
            self.model.train()

    def update_weights(self, model) -> None:
        """Empty the weight cache: the next `generate` builds its copies of the parameters as they are now."""
        if self.weight_cache is not None:
            self.weight_cache.clear()

    @contextlib.contextmanager
    def generating(self):
        """A block whose `generate` calls share one set of fused weight copies, freed at its end (see
        the class doc); a block inside another is part of it."""
        if self.weight_cache is not None:
            yield
            return
        self.weight_cache = DecodeWeightsCache()
        try:
            yield
        finally:
            self.weight_cache = None


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
