"""Sampling's forward passes: the prompts' prefill, then one new token per row per step.

    decoder = make_decoder(model, rows=N, max_len=P + steps, compile=False)
    logits = decoder.prefill(ids, mask, repeats=G)  # [N, V]: each prompt's last token, on its G rows
    logits = decoder.step(tokens)                   # [N, V]: tokens [N] appended, one per row

`Decoder` runs the blocks' decoding forms (`Block.prefill`, `Block.step`) on KV buffers of its own
and on fused copies of the matmul weights (`DecodeWeights`: q/k/v one matmul, gate/up one,
oneDNN-packed where faster), made per `generate_tokens` call (parameters change between calls,
never within one), or taken from a `DecodeWeightsCache` whose holder knows the parameters have not
changed since it built them (the RL stages' rollout rounds, an evaluation's batches). It computes
the model's forward to float rounding (tests: logits within 1e-5 of their scale); the prefill runs
once per distinct prompt. `compile=True` runs a step under `torch.compile(fullgraph=True)`, one
graph for every step, prompt length and cache size. `ModelDecoder` has the same two methods
through the module's forward, for anything that is not a `Transformer` with an lm_head in one
process: under FSDP only a forward gathers the sharded parameters. `sprout.model.static_decode`
has the step on buffers of fixed shape and address, for a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from sprout.model.heads import padding_inputs
from sprout.model.onednn import linear, matmul_weight, onednn_available
from sprout.model.transformer import Transformer


@dataclass
class DecodeWeights:
    """What `decode_step` reads of a transformer: its blocks and final norm (of the same types in any
    model class, so that a compiled graph serves them all) and their `fused_weights` copies, of a
    `sprout.model.onednn` kind (tensors, so that the graph takes them as inputs, for any weights)."""

    blocks: nn.ModuleList
    norm: nn.Module
    layers: list  # per block: ((qkv, o, qkv bias or None), (gate_up, down))
    lm_head: torch.Tensor
    kind: str = "dense"  # the layers' matmul weights (see `sprout.model.onednn`)
    head_kind: str = "dense"  # the lm_head's

    @classmethod
    def of(cls, model: Transformer, rows: int = 1, kind: str = "dense", head_kind: str = "dense"):
        """The weights of `model` now, packed (where `kind` packs) for `rows` rows. Under autocast the
        dense matrices are stored in its dtype: the matmuls are the ones autocast would run on them
        (it casts both operands), without casting every weight at every step."""
        layers = [block.fused_weights(rows, kind) for block in model.layers]
        head = matmul_weight(model.lm_head.weight, rows, head_kind)
        device = model.lm_head.weight.device.type
        if torch.is_autocast_enabled(device):
            low = torch.get_autocast_dtype(device)
            if kind == "dense":
                layers = [((qkv.to(low), o.to(low), bias), (gate_up.to(low), down.to(low)))
                          for (qkv, o, bias), (gate_up, down) in layers]  # the q/k/v bias stays: an add
            head = head.to(low) if head_kind == "dense" else head
        return cls(model.layers, model.norm, layers, head, kind, head_kind)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] of `decode_step`'s hidden states [N, d]."""
        return linear(hidden, self.lm_head, self.head_kind).float()


class DecodeWeightsCache:
    """The `DecodeWeights` of one model, built once and handed to every decoder that asks for the same
    ones: `get(model, rows, kind, head_kind)` returns the set it holds when it was built of the same
    model object for the same kinds under the same autocast dtype (and the same rows, where a kind
    packs for them: `sprout.model.onednn`), else builds that set, dropping the one it held (one set
    alive at a time: a model's size). The copies do not follow the parameters: whoever holds a cache
    calls `clear()` (or drops it) before the parameters, or which LoRA adapters are on, can have
    changed since its last `get`; a set served from the cache is the very one a fresh build would
    make then, so decoding is bit-for-bit the same."""

    def __init__(self):
        self.key: tuple | None = None
        self.model: Transformer | None = None
        self.weights: DecodeWeights | None = None

    def get(self, model: Transformer, rows: int, kind: str, head_kind: str) -> DecodeWeights:
        device = model.lm_head.weight.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        packs = kind != "dense" or head_kind != "dense"  # a dense copy is the same for any rows
        key = (rows if packs else None, kind, head_kind, low)
        if self.weights is None or self.model is not model or self.key != key:
            self.clear()  # the old set freed before the new one is built
            self.weights, self.model, self.key = DecodeWeights.of(model, rows, kind, head_kind), model, key
        return self.weights

    def clear(self) -> None:
        """Drop the set held (the next `get` builds)."""
        self.key = self.model = self.weights = None


def decode_step(w: DecodeWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ks: list[torch.Tensor],
                vs: list[torch.Tensor], bias: torch.Tensor) -> torch.Tensor:
    """Final normed hidden states [N, d] (`DecodeWeights.logits`) of new tokens' embeddings x [N, d]
    at rotary cos/sin [N, 1, D], each layer's `Block.step` appending them to its cache `ks`/`vs`
    [N, kv_heads, S, D] at slot L - 1 of a `bias` [N, L] (0, or -inf on a row's padding slots)."""
    bias = bias[:, None, None]  # [N, 1, 1, L]
    for block, weights, k, v in zip(w.blocks, w.layers, ks, vs):
        x = block.step(x, weights, cos, sin, k, v, bias, w.kind)
    return w.norm(x)


def prefill_step(model: Transformer, w: DecodeWeights, ids: torch.Tensor, mask: torch.Tensor,
                 ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Final normed hidden states [B, d] of the last tokens of prompts ids [B, P], left-padded (`mask`
    1 on real tokens), through every layer's `Block.prefill`: the blocks take the T real tokens,
    gathered [T, d]; attention is causal over real keys (a padding query sees its own slot only, so
    no row of the mask is empty; its output is dropped). Their keys/values go to slots 0..P-1 of
    `ks`/`vs` [B × G, kv_heads, S, D], each prompt's to its G adjacent rows."""
    P, real = ids.shape[1], mask.bool()
    index = real.flatten().nonzero()[:, 0]  # real token -> its position in [B × P]
    x = model.embed_tokens(ids.flatten()[index])  # [T, d]
    cos, sin = model.rotary((mask.cumsum(1) - 1)[real])  # [T, 1, D]
    causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
    allowed = (causal & real[:, None, :]) | torch.eye(P, dtype=torch.bool, device=ids.device)  # [B, P, P]
    for block, weights, k, v in zip(w.blocks, w.layers, ks, vs):
        x = block.prefill(x, weights, cos, sin, index, allowed[:, None], k, v, w.kind)
    last = mask.sum(1).cumsum(0) - 1  # each prompt's last token among the T
    return w.norm(x[last])


@functools.cache
def compiled_decode_step():
    """`decode_step` under torch.compile, built once per process (its graphs are cached per shape)."""
    return torch.compile(decode_step, fullgraph=True)


def decode_kinds(model: Transformer, compile: bool) -> tuple[str, str]:
    """The `sprout.model.onednn` kinds (the layers', the lm_head's) of `model`'s fused weights here:
    oneDNN-packed where faster; a compiled graph takes dense tensors only (`onednn_op`)."""
    onednn = onednn_available(model.lm_head.weight, model.config.d_model)
    return ("onednn_op" if compile else "onednn") if onednn else "dense", "onednn" if onednn else "dense"


def decode_weights(model: Transformer, rows: int, kind: str, head_kind: str,
                   weight_cache: DecodeWeightsCache | None = None) -> DecodeWeights:
    """`model`'s `DecodeWeights` for `rows` rows: `weight_cache`'s when given, else built now."""
    if weight_cache is None:
        return DecodeWeights.of(model, rows, kind, head_kind)
    return weight_cache.get(model, rows, kind, head_kind)


class Decoder:
    """`prefill_step`, then `decode_step`, on fused weights and cache buffers of its own (see the module doc)."""

    def __init__(self, model: Transformer, rows: int, max_len: int, compile: bool = False,
                 weight_cache: DecodeWeightsCache | None = None):
        self.model, self.weights = model, decode_weights(model, rows, *decode_kinds(model, compile), weight_cache)
        cache = model.new_cache(rows, max_len)  # its keys/values only: the decoder keeps positions and padding itself
        self.k, self.v = cache.k, cache.v
        self.compile = compile
        self.step_fn = compiled_decode_step() if compile else decode_step
        if compile:  # one graph for every cache size and length
            for t in self.k + self.v:
                torch._dynamo.mark_dynamic(t, 2)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """Logits [B × repeats, V] of the prompts' last tokens (ids [B, P] left-padded, `mask`)."""
        (B, P), S = ids.shape, self.k[0].shape[2]
        hidden = prefill_step(self.model, self.weights, ids, mask, self.k, self.v)
        # A new token attends to its row's real prompt slots and to every later slot (up to its own).
        bias = torch.zeros(B, S, dtype=torch.float32, device=ids.device)
        bias[:, :P].masked_fill_(mask == 0, float("-inf"))
        self.bias = bias.repeat_interleave(repeats, 0)
        self.positions, self.length = mask.sum(1).repeat_interleave(repeats, 0), P
        return self.weights.logits(hidden).repeat_interleave(repeats, 0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of tokens [N], one per row, appended."""
        if self.length >= self.k[0].shape[2]:
            raise ValueError(f"KV cache full: {self.length + 1} slots needed, {self.k[0].shape[2]} allocated")
        self.length += 1
        bias = self.bias[:, : self.length]
        if self.compile:
            torch._dynamo.mark_dynamic(bias, 1)
        x, (cos, sin) = self.model.embed_tokens(tokens), self.model.rotary(self.positions)
        hidden = self.step_fn(self.weights, x, cos, sin, self.k, self.v, bias)
        self.positions += 1
        return self.weights.logits(hidden)


class ModelDecoder:
    """The `Decoder` interface through the module's forward: one `model(tokens [N, 1], cache=...)` a step."""

    def __init__(self, model, rows: int, max_len: int):
        self.model, self.cache = model, model.new_cache(rows, max_len)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """As `Decoder.prefill`, by one forward over the B prompts (their keys/values copied to their rows)."""
        model, cache = self.model, self.cache
        segments, positions = (None, None) if bool(mask.all()) else padding_inputs(mask)  # no padding: causal
        if repeats == 1:
            return model(ids, segment_ids=segments, position_ids=positions, cache=cache, logits_to_keep=1)[:, -1]
        B, P = ids.shape
        once = model.new_cache(B, P, dtype=cache.k[0].dtype)
        logits = model(ids, segment_ids=segments, position_ids=positions, cache=once, logits_to_keep=1)[:, -1]
        for full, part in zip(cache.k + cache.v, once.k + once.v):
            full[:, :, :P] = part.repeat_interleave(repeats, 0)
        cache.segments[:, :P] = once.segments.repeat_interleave(repeats, 0)
        cache.next_pos = once.next_pos.repeat_interleave(repeats, 0)
        cache.length, cache.segmented = once.length, once.segmented
        return logits.repeat_interleave(repeats, 0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens[:, None], cache=self.cache)[:, -1]


def fusable(model) -> bool:
    """Whether `model` can decode on fused weights (`Decoder`, `sprout.model.static_decode.StaticDecoder`):
    a plain `Transformer`, or a subclass with an lm_head (in one process: under FSDP only its forward
    gathers the sharded parameters, so callers take a `ModelDecoder` there). A module seen through
    its eager forward after `Module.compile()` (`eager_module`, `sprout.engine.trainer.Uncompiled`)
    is its module: fused decoding never calls the forward."""
    model = getattr(model, "eager_module", model)
    return isinstance(model, Transformer) and hasattr(model, "lm_head")


def make_decoder(model, rows: int, max_len: int, compile: bool = False, fused: bool = True,
                 weight_cache: DecodeWeightsCache | None = None):
    """A `Decoder` for a `fusable` model when `fused` (its weights from `weight_cache` when given),
    else a `ModelDecoder` (no fused weights: `weight_cache` unused)."""
    if fused and fusable(model):
        return Decoder(model, rows, max_len, compile, weight_cache)
    return ModelDecoder(model, rows, max_len)
