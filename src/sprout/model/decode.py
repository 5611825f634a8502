"""Sampling's forward passes: the prompts' prefill, then one new token per row per step.

    decoder = make_decoder(model, rows=N, max_len=P + steps, compile=False)
    logits = decoder.prefill(ids, mask, repeats=G)  # [N, V]: each prompt's last token, on its G rows
    logits = decoder.step(tokens)                   # [N, V]: tokens [N] appended, one per row

`Decoder` runs the transformer's forward written out on plain tensors, on copies of its
weights (`DecodeWeights`) and on KV buffers of its own, in two forms: `prefill_step` for the
prompts and `decode_step` for one token per row. Both compute the module's function (the
tests hold their logits to the forward's within 1e-5 of their scale); what differs changes
only float rounding:

- fused projections: q, k and v are one matmul, gate and up one matmul. The weights are
  copied when the decoder is built, once per `generate_tokens` call: the parameters keep
  their names and layout, and they change between calls (RL updates them) but never within
  one. The copies hold one more copy of the matmul weights for the length of the call. The
  softmax scale 1/sqrt(head_dim) is folded into the query rows, and one rotary pass turns
  the query and key heads together.
- the prefill runs once per distinct prompt (B, not B × G rows; each prompt's keys/values
  are then written to its G rows), its matmuls on the real tokens only, gathered [T, d],
  and its attention in the left-padded layout [B, heads, P, D] (causal, over real keys).
- a decode step's attention is not `scaled_dot_product_attention`: one query per row, so it
  is q · K over the filled slots plus an additive bias (0, or -inf on a row's padding
  slots), softmax, times V. Grouped-query heads read their shared keys/values in place
  (queries viewed as [N, kv_heads, group, head_dim]), nothing is repeated.
- logits for the last prompt token and the new tokens only, float32 as the model's.

The matmul weights (`matmul_weight`, `linear`): on a CPU with oneDNN, for float32 parameters
and no autocast (`onednn_available`), each copy is packed into the blocked layout oneDNN
picks for the batch (`torch.ops.mkldnn._reorder_linear_weight`, the packing inductor's CPU
weight prepacking uses) and multiplied by `torch.ops.mkldnn._linear_pointwise`: for 16 rows
on the 2-core AMD EPYC of benchmarks/rl_throughput.py, 1.3-3x faster than MKL's matmul on a
dense weight (most for the widest, gate/up and the lm_head, and with 2 threads). A oneDNN
call costs about 20 us more than an MKL one whatever its size, so narrower models
(d_model < `ONEDNN_MIN_WIDTH`: with 16 rows, 6 layers and 2 threads there, a decode step
of d_model 128 ran 3.3 ms packed and 3.1 ms dense, of d_model 256 5.6 and 7.2) keep dense
weights. Elsewhere (an accelerator, bf16
weights, autocast, which these ops would bypass) they are transposed dense copies, x @ w.

Compiled (`compile=True`): `torch.compile(decode_step, fullgraph=True)` with the slot
dimension of the cache and of the bias marked dynamic, so one graph serves every step,
prompt length and cache size (per number of rows and model shape): no recompile per step
or per call. Inductor fuses each layer's cache write, attention and softmax into one loop
nest. A graph takes dense tensors only, so on oneDNN its matmul weights are dense copies,
each carrying its packed copy as an attribute, and the matmul is `onednn_linear`, a custom
op the compiler does not look into, which multiplies by the packed copy (the weights held
twice for the call). The lm_head runs outside the graph (`DecodeWeights.logits`) and the
prefill eager.

`ModelDecoder` has the same two methods through the module's forward: one forward over the
B prompts into a `KVCache` (copied to their G rows), then one `model(tokens [N, 1],
cache=...)` per step. Generation uses it for anything that is not a `Transformer` with an
lm_head in one process: under FSDP the sharded parameters are gathered by the module's
forward alone, so every step must be one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sprout.model.heads import padding_inputs
from sprout.model.transformer import KVCache, Transformer


ONEDNN_MIN_WIDTH = 256  # d_model from which oneDNN-packed matmuls outrun dense ones (see the module doc)
_PACKED = "_sprout_onednn"  # the attribute of a dense weight holding its oneDNN-packed copy ("onednn_op")


def matmul_weight(weight: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
    """`weight` [out, in] as `linear` takes it: "dense", transposed [in, out] for x @ w; "onednn",
    packed in the layout oneDNN picks for `rows` rows (`torch.ops.mkldnn._reorder_linear_weight`);
    "onednn_op", dense with its packed copy attached (for `onednn_linear` in a compiled graph)."""
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    dense = weight.t().contiguous()
    if kind == "onednn_op":
        setattr(dense, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight, rows))
    return dense


def linear(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """x [N, in] @ W.T -> [N, out] for a `matmul_weight(W, rows, kind)`."""
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    if kind == "onednn_op":
        return onednn_linear(x, weight)
    return torch.matmul(x, weight)


@torch.library.custom_op("sprout::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight for a dense weight [in, out], multiplied by the oneDNN-packed copy attached to
    it when there is one (an op opaque to torch.compile: a graph takes the dense tensor, the
    packed one never enters it); a plain x @ weight otherwise."""
    packed = getattr(weight, _PACKED, None)
    if packed is None:
        return torch.matmul(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


@dataclass
class DecodeWeights:
    """A transformer's weights as `decode_step` reads them (tensors only, so that a compiled
    step takes them as inputs and its graph serves any weights of the same shapes)."""

    embed: torch.Tensor  # [V, d]
    layers: list[tuple[torch.Tensor, ...]]  # per block: (input norm, qkv, o, post norm, gate_up, down)
    norm: torch.Tensor  # [d]
    lm_head: torch.Tensor
    rope_cos: torch.Tensor  # [max_seq_len, D]
    rope_sin: torch.Tensor  # [max_seq_len, D], signed as `sprout.model.transformer.rope_tables`
    kind: str = "dense"  # the layers' matmul weights (see `matmul_weight`)
    head_kind: str = "dense"  # the lm_head's

    @classmethod
    @torch.no_grad()
    def of(cls, model: Transformer, rows: int = 1, kind: str = "dense", head_kind: str = "dense"):
        """The weights of `model` now: every matmul weight a `matmul_weight` copy (q/k/v and gate/up
        concatenated: qkv [(H + 2 KV) D, d], gate_up [2F, d]); norms, embedding, rotary tables shared."""
        def mat(*weights, kind=kind):
            return matmul_weight(torch.cat(weights), rows, kind)

        layers = []
        for block in model.layers:
            a, m = block.self_attn, block.mlp
            q = a.q_proj.weight * (1.0 / math.sqrt(a.head_dim))  # the softmax scale, folded in
            layers.append((block.input_layernorm.weight, mat(q, a.k_proj.weight, a.v_proj.weight),
                           mat(a.o_proj.weight), block.post_attention_layernorm.weight,
                           mat(m.gate_proj.weight, m.up_proj.weight), mat(m.down_proj.weight)))
        return cls(model.embed_tokens.weight, layers, model.norm.weight, mat(model.lm_head.weight, kind=head_kind),
                   model.rope_cos, model.rope_sin, kind, head_kind)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] of `decode_step`'s hidden states [N, d]."""
        return linear(hidden, self.lm_head, self.head_kind).float()


def onednn_available(model) -> bool:
    """Whether `model`'s decode matmuls can run on oneDNN-packed weights: float32 parameters on a
    CPU with oneDNN, no CPU autocast (the packed matmul would bypass it), and the two ops present."""
    p = model.lm_head.weight
    return (p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and not torch.is_autocast_enabled("cpu") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`sprout.model.transformer.RMSNorm`'s forward on [N, d]."""
    rstd = torch.rsqrt(torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps)).unsqueeze(-1)
    return torch.mul(x, rstd).mul_(weight)


def decode_step(w: DecodeWeights, tokens: torch.Tensor, positions: torch.Tensor, ks: list[torch.Tensor],
                vs: list[torch.Tensor], bias: torch.Tensor, shape: tuple[int, int, int, float]) -> torch.Tensor:
    """Final normed hidden states [N, d] (`DecodeWeights.logits` takes them to logits) of tokens
    [N] at rotary `positions` [N], appended to the cache.

    `ks`/`vs`: every layer's cache buffers [N, kv_heads, S, D]; `bias` [N, L]: the slots the new
    token attends to, 0 or -inf (a row's padding), so that the new keys/values go to slot L - 1
    and attention reads slots 0..L-1 only. `shape`: (n_heads, kv_heads, head_dim, norm eps).
    """
    H, KV, D, eps = shape
    N, G, slot = tokens.shape[0], H // KV, bias.shape[1] - 1
    x = F.embedding(tokens, w.embed)
    cos, sin = w.rope_cos[positions][:, None], w.rope_sin[positions][:, None]  # [N, 1, D]
    bias = bias[:, None, None]  # [N, 1, 1, L]
    for (ln1, qkv_w, o_w, ln2, gate_up_w, down_w), ck, cv in zip(w.layers, ks, vs):
        qkv = linear(_rms_norm(x, ln1, eps), qkv_w, w.kind)
        if cos.dtype != qkv.dtype:  # bf16 under autocast
            cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        qk = qkv[:, : (H + KV) * D].view(N, H + KV, D)
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)  # rotary, as apply_rope
        ck.select(2, slot).copy_(qk[:, H:])
        cv.select(2, slot).copy_(qkv[:, (H + KV) * D :].view(N, KV, D))
        scores = torch.matmul(qk[:, :H].view(N, KV, G, D), ck[:, :, : slot + 1].transpose(2, 3))  # [N, KV, G, L]
        y = torch.matmul((scores + bias).softmax(dim=-1).to(cv.dtype), cv[:, :, : slot + 1])
        x = x + linear(y.view(N, H * D), o_w, w.kind)
        gate, up = linear(_rms_norm(x, ln2, eps), gate_up_w, w.kind).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, down_w, w.kind)
    return _rms_norm(x, w.norm, eps)


def prefill_step(w: DecodeWeights, ids: torch.Tensor, mask: torch.Tensor, ks: list[torch.Tensor],
                 vs: list[torch.Tensor], repeats: int, shape: tuple[int, int, int, float]) -> torch.Tensor:
    """Final normed hidden states [B, d] of each prompt's last token; the prompts' keys/values
    written to slots 0..P-1 of `ks`/`vs` [B × repeats, kv_heads, S, D], each prompt's to its
    `repeats` adjacent rows.

    Prompts ids [B, P] left-padded (`mask` 1 on real tokens): the matmuls run on the T real
    tokens only, gathered [T, d]; attention runs in the padded layout [B, heads, P, D], causal
    over real keys (a padding query sees its own slot only, so no row of the mask is empty;
    its output is dropped).
    """
    H, KV, D, eps = shape
    (B, P), real = ids.shape, mask.bool()
    index = real.flatten().nonzero()[:, 0]  # real token -> its position in [B × P]
    positions = (mask.cumsum(1) - 1)[real]
    x = F.embedding(ids.flatten()[index], w.embed)  # [T, d]
    cos, sin = w.rope_cos[positions][:, None], w.rope_sin[positions][:, None]  # [T, 1, D]
    causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
    allowed = (causal & real[:, None, :]) | torch.eye(P, dtype=torch.bool, device=ids.device)  # [B, P, P]
    for (ln1, qkv_w, o_w, ln2, gate_up_w, down_w), ck, cv in zip(w.layers, ks, vs):
        qkv = linear(_rms_norm(x, ln1, eps), qkv_w, w.kind).view(-1, H + 2 * KV, D)
        if cos.dtype != qkv.dtype:  # bf16 under autocast
            cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
        heads = qkv.new_zeros(B * P, H + 2 * KV, D)
        heads[index, : H + KV] = torch.addcmul(qkv[:, : H + KV] * cos, qkv[:, : H + KV].roll(D // 2, -1), sin)
        heads[index, H + KV :] = qkv[:, H + KV :]
        q, k, v = heads.view(B, P, H + 2 * KV, D).transpose(1, 2).split([H, KV, KV], dim=1)
        ck.view(B, repeats, *ck.shape[1:])[:, :, :, :P] = k[:, None]
        cv.view(B, repeats, *cv.shape[1:])[:, :, :, :P] = v[:, None]
        y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed[:, None], scale=1.0,
                                           enable_gqa=KV != H)
        x = x + linear(y.transpose(1, 2).reshape(B * P, H * D)[index], o_w, w.kind)
        gate, up = linear(_rms_norm(x, ln2, eps), gate_up_w, w.kind).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, down_w, w.kind)
    last = mask.sum(1).cumsum(0) - 1  # each prompt's last token among the T
    return _rms_norm(x[last], w.norm, eps)


_compiled_decode_step = None


def compiled_decode_step():
    """`decode_step` under torch.compile, built once per process (its graphs are cached per shape)."""
    global _compiled_decode_step
    if _compiled_decode_step is None:
        _compiled_decode_step = torch.compile(decode_step, fullgraph=True)
    return _compiled_decode_step


def prefill(model, cache: KVCache, ids: torch.Tensor, mask: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """Logits [B × repeats, V] of each prompt's last position through the module's forward, `cache`
    [B × repeats rows] filled with the prompts ids [B, P] (left-padded, `mask` 1 on real tokens),
    each prompt's keys/values in its `repeats` adjacent rows: the model runs on the B prompts."""
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


class Decoder:
    """`prefill_step`, then `decode_step`, on fused weights and cache buffers of its own (see the module doc)."""

    def __init__(self, model: Transformer, rows: int, max_len: int, compile: bool = False):
        c, p = model.config, model.lm_head.weight
        onednn = onednn_available(model) and c.d_model >= ONEDNN_MIN_WIDTH
        kind = ("onednn_op" if compile else "onednn") if onednn else "dense"  # a graph takes dense tensors only
        self.weights = DecodeWeights.of(model, rows, kind, "onednn" if onednn else "dense")
        shape = (rows, c.kv_heads, max_len, c.head_dim)
        self.k = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(c.n_layers)]
        self.v = [torch.zeros(shape, device=p.device, dtype=p.dtype) for _ in range(c.n_layers)]
        self.shape = (c.n_heads, c.kv_heads, c.head_dim, c.norm_eps)
        self.compile = compile
        self.step_fn = compiled_decode_step() if compile else decode_step
        if compile:  # one graph for every cache size and length
            for t in self.k + self.v:
                torch._dynamo.mark_dynamic(t, 2)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """Logits [B × repeats, V] of the prompts' last tokens (ids [B, P] left-padded, `mask`)."""
        (B, P), S = ids.shape, self.k[0].shape[2]
        hidden = prefill_step(self.weights, ids, mask, self.k, self.v, repeats, self.shape)
        # A new token attends to its row's real prompt slots and to every later slot (up to its own).
        bias = torch.zeros(B, S, dtype=torch.float32, device=ids.device)
        bias[:, :P].masked_fill_(mask == 0, float("-inf"))
        self.bias = bias.repeat_interleave(repeats, 0)
        self.positions = mask.sum(1).repeat_interleave(repeats, 0)
        self.length = P
        return self.weights.logits(hidden).repeat_interleave(repeats, 0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of tokens [N], one per row, appended."""
        if self.length >= self.k[0].shape[2]:
            raise ValueError(f"KV cache full: {self.length + 1} slots needed, {self.k[0].shape[2]} allocated")
        self.length += 1
        bias = self.bias[:, : self.length]
        if self.compile:
            torch._dynamo.mark_dynamic(bias, 1)
        hidden = self.step_fn(self.weights, tokens.contiguous(), self.positions, self.k, self.v, bias, self.shape)
        self.positions += 1
        return self.weights.logits(hidden)


class ModelDecoder:
    """The `Decoder` interface through the module's forward: one `model(tokens [N, 1], cache=...)` a step."""

    def __init__(self, model, rows: int, max_len: int):
        self.model, self.cache = model, model.new_cache(rows, max_len)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        return prefill(self.model, self.cache, ids, mask, repeats)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens[:, None], cache=self.cache)[:, -1]


def make_decoder(model, rows: int, max_len: int, compile: bool = False, fused: bool = True):
    """A `Decoder` for a plain `Transformer` (or subclass with an lm_head) when `fused`, else a `ModelDecoder`."""
    if fused and isinstance(model, Transformer) and hasattr(model, "lm_head"):
        return Decoder(model, rows, max_len, compile)
    return ModelDecoder(model, rows, max_len)
