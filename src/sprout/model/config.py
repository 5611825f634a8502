"""The transformer's shape (`ModelConfig`, checked as it is made) and Llama 3's rotary scaling
fields; no torch, so configs and a trainer's --help read it without loading the network
(`sprout.model.transformer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sprout.ranges import in_range
from sprout.errors import SproutError


@dataclass
class ModelConfig:
    # token ids the embedding holds (the tokenizer's, maybe padded); None: pretraining sets it
    # to the data's tokenizer vocabulary rounded up to a multiple of 64 (`sprout.stages.pretrain.vocab_for_data`)
    vocab_size: int | None = in_range(None, "[1, inf)")
    d_model: int = in_range(256, "[2, inf)")  # width of the residual stream
    n_layers: int = in_range(6, "[1, inf)")   # transformer blocks
    n_heads: int = in_range(8, "[1, inf)")    # attention (query) heads; d_model / n_heads must be even
    n_kv_heads: int | None = in_range(None, "[1, inf)")  # None -> n_heads; fewer -> grouped-query attention
    d_ff: int | None = in_range(None, "[1, inf)")  # None -> SwiGLU hidden: smallest multiple of 64 >= 8/3 d_model
    max_seq_len: int = in_range(512, "[1, inf)")  # longest sequence (context) the model takes
    rope_theta: float = in_range(10000.0, "(0, inf)")  # rotary embedding base
    norm_eps: float = in_range(1e-5, "(0, inf)")  # RMSNorm epsilon
    tie_embeddings: bool = False        # the output head shares the embedding matrix
    init_std: float = in_range(0.02, "(0, inf)")  # std of the normal initial weights
    d_head: int | None = in_range(None, "[2, inf)")  # None -> d_model / n_heads
    attention_bias: bool = False        # biases on q, k, v (Qwen2)
    rope_scaling: dict | None = None    # None, or Llama 3's (see LLAMA3_ROPE)

    def __post_init__(self) -> None:
        if self.d_head is None and self.d_model % self.n_heads:
            raise SproutError(f"model config: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise SproutError(f"model config: head size {self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise SproutError(f"model config: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling, "model config: rope_scaling")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        # 8/3 d keeps a SwiGLU's three matrices at about the parameters of a 4d GELU MLP.
        return self.d_ff or 64 * math.ceil(8 * self.d_model / 3 / 64)


LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling, where: str) -> None:
    """Refuse a `rope_scaling` other than {"rope_type": "llama3"} with a number for each of `LLAMA3_ROPE`."""
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else type(scaling).__name__
    if kind != "llama3":
        raise SproutError(f"{where}: rope type {kind!r} is not supported (only 'llama3')")
    numbers = all(isinstance(scaling.get(k), (int, float)) and not isinstance(scaling[k], bool) for k in LLAMA3_ROPE)
    if not numbers or set(scaling) - {"rope_type", *LLAMA3_ROPE}:
        raise SproutError(f"{where}: llama3 scaling takes a number for each of {', '.join(LLAMA3_ROPE)} "
                          f"and no other field (got {scaling})")
