"""The decode step with every shape and address fixed for a decoder's life, replayed as a CUDA graph on CUDA.

    decoder = StaticDecoder(model, rows=N, max_len=S, graph=True, compile=False)  # graph: capture on CUDA
    logits = decoder.prefill(ids, mask, repeats=G)  # as `Decoder.prefill` (eager: prompt shapes vary)
    logits = decoder.step(tokens)                   # [N, V], valid until the next step

`static_decode_step` reads only buffers the decoder allocates once: the step's tokens [N] and
rotary positions [N], the next cache slot [1], the prompts' padding bias [N, S] and the KV
buffers [N, kv_heads, S, D], and the fused weights (`DecodeWeights`, made once, or a cache's).
Each step attends over all S slots, those past the new token's masked with -inf (softmax gives them
weight exactly 0), so N, S and every address stay the same; it advances positions and slot in
place. On CUDA the first step is captured as a `torch.cuda.CUDAGraph` (one warm-up on a side
stream, the state it advanced put back), and each step copies its tokens in and replays it: no
Python and no kernel launches per layer. Elsewhere the same function runs eagerly (the tests'
path). It computes `Decoder.step`'s logits to float rounding (tests: greedy tokens equal).
`compile=True` runs the step under torch.compile (the graph then holds the compiled kernels),
one compiled graph for every cache size S (the slot dimension is dynamic).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from sprout.model.decode import DecodeWeights, DecodeWeightsCache, decode_kinds, decode_weights, prefill_step
from sprout.model.transformer import Transformer


def static_decode_step(model: Transformer, w: DecodeWeights, tokens: torch.Tensor, positions: torch.Tensor,
                       slot: torch.Tensor, padding_bias: torch.Tensor, ks: list[torch.Tensor],
                       vs: list[torch.Tensor]) -> torch.Tensor:
    """Float32 logits [N, V] of `tokens` [N] at rotary `positions` [N], their keys/values written at
    cache slot `slot` [1] of `ks`/`vs`; attention over every slot up to `slot` where `padding_bias`
    [N, S] is 0 (-inf on prompt padding). Then positions and slot advance by one, in place."""
    S = padding_bias.shape[1]
    x, (cos, sin) = model.embed_tokens(tokens), model.rotary(positions)
    later = torch.arange(S, device=slot.device) > slot  # [S]: slots past the new token's
    bias = padding_bias.masked_fill(later, float("-inf"))[:, None, None]  # [N, 1, 1, S]
    for block, weights, k, v in zip(w.blocks, w.layers, ks, vs):
        x = block.step(x, weights, cos, sin, k, v, bias, w.kind, slot)
    logits = w.logits(w.norm(x))
    positions.add_(1)
    slot.add_(1)
    return logits


@functools.cache
def compiled_static_decode_step():
    """`static_decode_step` under torch.compile, built once per process (its graphs cached per shape)."""
    return torch.compile(static_decode_step, fullgraph=True)


class StaticDecoder:
    """`Decoder`'s interface on buffers of fixed address (see the module doc); `graph`: capture the
    step as a CUDA graph when the model is on CUDA (ignored elsewhere); `compile`: the step compiled;
    `weight_cache`: where its fused weights come from (`sprout.model.decode.DecodeWeightsCache`)."""

    def __init__(self, model: Transformer, rows: int, max_len: int, graph: bool = True, compile: bool = False,
                 weight_cache: DecodeWeightsCache | None = None):
        kind, head_kind = decode_kinds(model, compile)
        if compile:  # the lm_head runs inside the compiled step too: its matmul the op a graph takes
            head_kind = kind
        self.model, self.weights = model, decode_weights(model, rows, kind, head_kind, weight_cache)
        cache = model.new_cache(rows, max_len)  # its keys/values only
        self.k, self.v = cache.k, cache.v
        device = model.lm_head.weight.device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.padding_bias = torch.zeros(rows, max_len, dtype=torch.float32, device=device)
        self.length = 0  # slots filled (the host's count: no read of `slot` per step)
        self.use_graph = graph and device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output buffer
        self.step_fn = compiled_static_decode_step() if compile else static_decode_step
        if compile:  # one compiled graph for every cache size
            for t in self.k + self.v:
                torch._dynamo.mark_dynamic(t, 2)
            torch._dynamo.mark_dynamic(self.padding_bias, 1)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """Logits [B × repeats, V] of the prompts' last tokens (ids [B, P] left-padded, `mask`), their
        keys/values in slots 0..P-1; the step's buffers set in place for the token at slot P."""
        P = ids.shape[1]
        hidden = prefill_step(self.model, self.weights, ids, mask, self.k, self.v)
        self.padding_bias.zero_()
        self.padding_bias[:, :P].masked_fill_((mask == 0).repeat_interleave(repeats, 0), float("-inf"))
        self.positions.copy_(mask.sum(1).repeat_interleave(repeats, 0))
        self.slot.fill_(P)
        self.length = P
        return self.weights.logits(hidden).repeat_interleave(repeats, 0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of tokens [N], one per row, appended; on CUDA the graph's output buffer,
        which the next step overwrites."""
        if self.length >= self.k[0].shape[2]:
            raise ValueError(f"KV cache full: {self.length + 1} slots needed, {self.k[0].shape[2]} allocated")
        self.tokens.copy_(tokens)
        self.length += 1
        if not self.use_graph:
            return self.run()
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.logits

    def run(self) -> torch.Tensor:
        """One `static_decode_step` on the decoder's buffers (what the graph holds)."""
        return self.step_fn(self.model, self.weights, self.tokens, self.positions, self.slot, self.padding_bias,
                            self.k, self.v)

    def capture(self) -> None:
        """Record `run` as a CUDA graph: one warm-up run on a side stream (lazy initialisations, which a
        capture must not meet), the positions and slot it advanced put back (the keys/values it wrote
        at the slot are the ones the first replay writes again), then the capture, which runs
        nothing. Under autocast, with its cast cache off (a cached cast would outlive the graph)."""
        saved = self.positions.clone(), self.slot.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _autocast_uncached():
            self.run()
        torch.cuda.current_stream().wait_stream(side)
        self.positions.copy_(saved[0])
        self.slot.copy_(saved[1])
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), _autocast_uncached():
            self.logits = self.run()


def _autocast_uncached():
    """The CUDA autocast now in force, with its cast cache off; nothing when autocast is off."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
