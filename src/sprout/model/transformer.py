"""The sprout model: a decoder-only transformer with Llama's parameter layout.

Pre-norm blocks with RMSNorm, rotary embeddings in Hugging Face's `rotate_half` convention, a
SwiGLU MLP, optional grouped-query attention and tied embeddings; for imported models, q, k, v
biases (`attention_bias`), a head size apart from d_model / n_heads (`d_head`) and Llama 3's
rotary scaling. Module names map 1:1 onto `LlamaForCausalLM` (`model.` before all but
`lm_head`), so a checkpoint exports with equal logits.

Invariants: attention never crosses segment ids (packed documents; padding is segment 0, so no
query row is fully masked) and `position_ids` restart per document; a left-padded row in a
`KVCache` computes what its prompt computes alone, and a cache is used only through `reserve`
and `update`. Init (GPT-2): N(0, init_std), o_proj and down_proj N(0, init_std / sqrt(2
n_layers)), norms 1, biases 0; `sprout.model.load.uninitialised` builds a model whose weights are loaded next
without drawing any. `flops_per_token` = 6 N_matmul + 12 n_layers d seq_len (PaLM appendix B), 4 per
frozen parameter instead of 6; `training_flops` counts the lm_head's part only at the positions
whose logits are computed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sprout.errors import SproutError
from sprout.model.config import ModelConfig
from sprout.model.lora import effective_weight
from sprout.model.onednn import linear, matmul_weight


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`RMSNorm`'s output, 1/rms [..., 1]). Eager, the output is scaled in place (no second
    buffer of x's size); traced by torch.compile, out of place, which costs nothing once fused,
    and without which torch 2.11 gave wrong gradients (zero below every norm): tests/test_fsdp.py's
    compiled run against the eager one shows it."""
    if torch.compiler.is_compiling():
        rstd = torch.rsqrt(torch.linalg.vecdot(x, x) / x.shape[-1] + eps).unsqueeze(-1)
        return (x * rstd * weight).to(x.dtype), rstd  # x's dtype, as the in-place product keeps it
    rstd = torch.rsqrt(torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps)).unsqueeze(-1)
    return torch.mul(x, rstd).mul_(weight), rstd


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a hand-written backward (see the module doc): saves x and 1/rms only."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        # y = xhat * w with xhat = x * rstd:  dL/dw = sum(grad_y * xhat) over all but the
        # last dim;  dL/dx = rstd * (g - xhat * mean(g * xhat)) with g = grad_y * w.
        x, weight, rstd = ctx.saved_tensors
        xhat = x * rstd
        grad_w = (grad_y * xhat).flatten(0, -2).sum(0)
        g = grad_y * weight
        mean_g_xhat = torch.linalg.vecdot(g, xhat).div_(x.shape[-1]).unsqueeze(-1)
        return g.sub_(xhat.mul_(mean_g_xhat)).mul_(rstd), grad_w, None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019; HF LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)[0]


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's scaled inverse frequencies, step by step as transformers' `_compute_llama3_parameters`:
    wavelengths longer than original_len / low_freq_factor slow down by `factor`, those shorter
    than original_len / high_freq_factor stay, and those between are interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, max_len: int, theta: float,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [max_len, head_dim] in fp32, for `apply_rope`.

    angle(p, i) = p * inv_freq(i), inv_freq(i) = theta^(-2i / head_dim) for i < head_dim / 2
    (`llama3_inv_freq` of those with Llama 3's `scaling`), repeated over both halves (HF's
    `cat(freqs, freqs)`); the sin table's first half is negated, which folds `rotate_half`'s
    minus sign into the table.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)


def model_rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables` of a model's config: its head size, context, base and scaling."""
    return rope_tables(config.head_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + swap_halves(x) * sin, adding the swapped halves in place: no swapped copy of x."""
    h = x.shape[-1] // 2
    y = x * cos
    y[..., :h].addcmul_(x[..., h:], sin[..., :h])
    y[..., h:].addcmul_(x[..., :h], sin[..., h:])
    return y


class _RopeFunction(torch.autograd.Function):
    """`_rotate`, saving only the tables (see `apply_rope`)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_y):
        # The transpose of a rotation is the rotation by minus the angle: each half of the
        # gradient takes the other half times the *other* half of the signed sin table.
        cos, sin = ctx.saved_tensors
        h = grad_y.shape[-1] // 2
        grad_x = grad_y * cos
        grad_x[..., :h].addcmul_(grad_y[..., h:], sin[..., h:])
        grad_x[..., h:].addcmul_(grad_y[..., :h], sin[..., :h])
        return grad_x, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., H, D] (e.g. [B, T, H, D]) by the `rope_tables` cos/sin, broadcastable to
    [..., 1, D] and cast to x's dtype (a no-op in fp32; bf16 under autocast).

    HF's `x * cos + rotate_half(x) * sin` with rotate_half(x) = cat(-x2, x1); the minus
    sign lives in the sin table, and addcmul_ fuses the last multiply-add.
    """
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return _RopeFunction.apply(x, cos, sin) if torch.is_grad_enabled() else _rotate(x, cos, sin)


class KVCache:
    """Per-layer keys/values [B, n_kv_heads, max_len, head_dim], filled left to right.

    `segments[b, s]` is the segment id of the token in slot s (attention stays within a
    segment), `next_pos[b]` the rotary position the next token of row b gets, `length`
    the number of slots filled (the same for every row: prompts are left-padded).
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device, dtype):
        shape = (batch_size, config.kv_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.segments = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0
        self.segmented = False  # True once any segment ids were given (a mask is then needed)

    def reserve(self, segment_ids: torch.Tensor | None, position_ids: torch.Tensor | None, T: int):
        """Claim T slots for the next forward; returns (start, position_ids, attn_mask or None)."""
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} slots needed, {self.max_len} allocated")
        B = self.segments.shape[0]
        if position_ids is None:
            position_ids = self.next_pos[:, None] + torch.arange(T, device=self.next_pos.device)
        if segment_ids is None:
            # New tokens continue each row's last segment (segment 0 in an empty cache).
            last = self.segments[:, start - 1 : start] if start else self.segments[:, :1]
            segment_ids = last.expand(B, T)
        else:
            self.segmented = True
        self.segments[:, start:end] = segment_ids
        self.next_pos = position_ids[:, -1] + 1
        self.length = end
        if not self.segmented and (T == 1 or start == 0):
            return start, position_ids, None  # plain causal attention over the filled slots
        slots = torch.arange(end, device=self.segments.device)
        causal = slots[None, :] <= (start + torch.arange(T, device=slots.device))[:, None]  # [T, end]
        same = segment_ids[:, :, None] == self.segments[:, None, :end]  # [B, T, end]
        return start, position_ids, (same & causal)[:, None]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Store keys/values [B, n_kv_heads, T, D] at slots start.. ; return all filled slots' k, v."""
        T = k.shape[2]
        ck, cv = self.k[layer_idx], self.v[layer_idx]
        ck[:, :, start : start + T] = k
        cv[:, :, start : start + T] = v
        return ck[:, :, : start + T], cv[:, :, : start + T]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, config.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, config.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, config.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.n_heads * hd, d, bias=False)

    def forward(self, x, cos, sin, mask, cache: KVCache | None, start: int):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, H, T, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, start)
        gqa = self.n_kv_heads != self.n_heads
        if mask is None:  # causal; with a cache only when it was empty or T == 1 (see reserve)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def fused_weights(self, rows: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qkv, o, qkv bias or None) for `step`/`prefill`, the matrices `sprout.model.onednn.matmul_weight`
        copies: q, k and v one matrix [(H + 2 KV) D, d] (their biases one vector), the softmax scale
        1/sqrt(head_dim) folded into q's rows (and q's bias)."""
        scale = 1.0 / math.sqrt(self.head_dim)
        bias = None if self.q_proj.bias is None else torch.cat((self.q_proj.bias * scale, self.k_proj.bias,
                                                                   self.v_proj.bias))  # a LoRA layer's: its base's
        q = effective_weight(self.q_proj) * scale  # LoRA layers: their adapters merged in
        return (matmul_weight(torch.cat((q, effective_weight(self.k_proj), effective_weight(self.v_proj))), rows, kind),
                matmul_weight(effective_weight(self.o_proj), rows, kind), bias)

    @staticmethod
    def _qkv(x, weights, kind: str) -> torch.Tensor:
        """q, k and v of x [N, d] in one matmul on `fused_weights`, [N, (H + 2 KV) D]."""
        qkv = linear(x, weights[0], kind)
        return qkv if weights[2] is None else qkv + weights[2]

    def step(self, x, weights, cos, sin, k_cache, v_cache, bias, kind: str, slot: torch.Tensor | None = None):
        """`forward` of one new token per row, x [N, d] at rotary cos/sin [N, 1, D], on `fused_weights`:
        its key/value to slot L - 1 of the cache [N, KV, S, D], attention over slots 0..L-1 as q · K
        plus `bias` [N, 1, 1, L], softmax, times V (queries [N, KV, group, D]: keys read in place).
        With `slot` (long [1]; shapes that never change, as a CUDA graph needs) the key/value go to that
        slot and attention runs over all S slots, `bias` [N, 1, 1, S] -inf on those past it."""
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        N = x.shape[0]
        qkv = self._qkv(x, weights, kind).view(N, H + 2 * KV, D)
        qk = apply_rope(qkv[:, : H + KV], cos, sin)
        if slot is None:
            last = bias.shape[-1] - 1
            k_cache.select(2, last).copy_(qk[:, H:])
            v_cache.select(2, last).copy_(qkv[:, H + KV :])
            keys, values = k_cache[:, :, : last + 1], v_cache[:, :, : last + 1]
        else:
            k_cache.index_copy_(2, slot, qk[:, H:, None].to(k_cache.dtype))
            v_cache.index_copy_(2, slot, qkv[:, H + KV :, None].to(v_cache.dtype))
            keys, values = k_cache, v_cache
        scores = torch.matmul(qk[:, :H].view(N, KV, H // KV, D), keys.transpose(2, 3))
        y = torch.matmul((scores + bias).softmax(dim=-1).to(values.dtype), values)
        return linear(y.view(N, H * D), weights[1], kind)

    def prefill(self, x, weights, cos, sin, index, allowed, k_cache, v_cache, kind: str):
        """`forward` of B left-padded prompts of P slots on `fused_weights`: matmuls on their real tokens
        x [T, d] at cos/sin [T, 1, D] (`index`: their places in [B × P]), attention padded [B, heads, P, D]
        where `allowed` [B, 1, P, P]; keys/values to slots 0..P-1 of each prompt's G cache rows."""
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        B, P = allowed.shape[0], allowed.shape[-1]
        qkv = self._qkv(x, weights, kind).view(-1, H + 2 * KV, D)
        heads = qkv.new_zeros(B * P, H + 2 * KV, D)
        heads[index, : H + KV], heads[index, H + KV :] = apply_rope(qkv[:, : H + KV], cos, sin), qkv[:, H + KV :]
        q, k, v = heads.view(B, P, H + 2 * KV, D).transpose(1, 2).split([H, KV, KV], dim=1)
        k_cache.view(B, -1, *k_cache.shape[1:])[:, :, :, :P] = k[:, None]
        v_cache.view(B, -1, *v_cache.shape[1:])[:, :, :, :P] = v[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0, enable_gqa=KV != H)
        return linear(y.transpose(1, 2).reshape(B * P, H * D)[index], weights[1], kind)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ff_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ff_dim, bias=False)
        self.down_proj = nn.Linear(config.ff_dim, config.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused_weights(self, rows: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) for `fused`, `sprout.model.onednn.matmul_weight` copies: gate and up one matrix."""
        return (matmul_weight(torch.cat((effective_weight(self.gate_proj), effective_weight(self.up_proj))), rows, kind),
                matmul_weight(effective_weight(self.down_proj), rows, kind))

    def fused(self, x, weights, kind: str):
        """`forward` of x [T, d] on `fused_weights`."""
        gate, up = linear(x, weights[0], kind).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, weights[1], kind)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_weights(self, rows: int, kind: str):
        """(the attention's, the MLP's) `fused_weights`, for `step` and `prefill`: the weights now."""
        return self.self_attn.fused_weights(rows, kind), self.mlp.fused_weights(rows, kind)

    def step(self, x, weights, cos, sin, k_cache, v_cache, bias, kind: str, slot: torch.Tensor | None = None):
        """`forward` of one new token per row, x [N, d], on `fused_weights` (see `Attention.step`)."""
        x = x + self.self_attn.step(self.input_layernorm(x), weights[0], cos, sin, k_cache, v_cache, bias, kind,
                                    slot)
        return x + self.mlp.fused(self.post_attention_layernorm(x), weights[1], kind)

    def prefill(self, x, weights, cos, sin, index, allowed, k_cache, v_cache, kind: str):
        """`forward` of the prompts' real tokens, x [T, d], on `fused_weights` (see `Attention.prefill`)."""
        x = x + self.self_attn.prefill(self.input_layernorm(x), weights[0], cos, sin, index, allowed, k_cache,
                                       v_cache, kind)
        return x + self.mlp.fused(self.post_attention_layernorm(x), weights[1], kind)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size is None:
            raise SproutError("model config: vocab_size is not set (pretraining takes it from the data)")
        self.config = config
        weight = torch.empty(config.vocab_size, config.d_model)
        if not weight.is_meta:  # nn.Embedding's own init, skipped on the meta device (`uninitialised`)
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, _weight=weight)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if self.embed_tokens.weight.is_meta:  # `uninitialised` computes them once the model has memory
            cos = sin = torch.empty(0)
        else:
            cos, sin = model_rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.gradient_checkpointing = False  # set by the Trainer from train.gradient_checkpointing
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std); o_proj/down_proj scaled by 1/sqrt(2 n_layers); norms 1; biases 0."""
        if self.embed_tokens.weight.is_meta:  # `uninitialised`: no values to set
            return
        std = self.config.init_std
        resid_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, resid_std)
            else:
                p.normal_(0.0, std)

    def hidden_states(self, input_ids, *, segment_ids=None, position_ids=None, cache: KVCache | None = None):
        """Final normed hidden states [B, T, d_model] (the input of lm_head or a value head). With
        `gradient_checkpointing`, a training forward with grad keeps only each block's input and
        recomputes the block in backward (same loss and gradients); a cache's forward never does."""
        B, T = input_ids.shape
        start, mask = 0, None
        if cache is not None:
            start, position_ids, mask = cache.reserve(segment_ids, position_ids, T)
        elif segment_ids is not None:
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
            mask = ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal)[:, None]
        if position_ids is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {self.config.max_seq_len}")
            cos, sin = self.rope_cos[None, :T, None], self.rope_sin[None, :T, None]
        else:
            cos, sin = self.rotary(position_ids)
        x = self.embed_tokens(input_ids)
        recompute = self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, mask, None, 0, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache, start)
        return self.norm(x)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, D] for `apply_rope` at rotary positions [...] (one row for all heads)."""
        return self.rope_cos[position_ids].unsqueeze(-2), self.rope_sin[position_ids].unsqueeze(-2)

    def forward(self, input_ids, *, segment_ids=None, position_ids=None, cache: KVCache | None = None,
                return_hidden: bool = False, logits_to_keep: int = 0):
        """Logits [B, T, vocab] in float32; with return_hidden, (logits, hidden_states).

        `logits_to_keep` = k > 0: logits of the last k positions only, [B, k, vocab] (as in
        transformers; a prefill needs the last position's alone); a LongTensor [K]: logits of these
        positions of the flattened [B * T] batch only, [1, K, vocab] (a packed batch's completion
        tokens); hidden states stay [B, T, d].
        """
        h = self.hidden_states(input_ids, segment_ids=segment_ids, position_ids=position_ids, cache=cache)
        if torch.is_tensor(logits_to_keep):
            kept = h.flatten(0, 1)[logits_to_keep][None]
        else:
            kept = h[:, -logits_to_keep:] if logits_to_keep else h
        logits = self.lm_head(kept).float()
        return (logits, h) if return_hidden else logits

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, max_len, p.device, dtype or p.dtype)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once); optionally without the input embedding."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n

    def matmul_params(self) -> tuple[int, int]:
        """(N_matmul, the frozen ones among them): every parameter a token's matmuls use in training
        (all but the input embedding; a tied lm_head counts), and those without a gradient (LoRA's
        base). Counted at the first call and kept: adapters are added before training starts
        (`sprout.model.lora.add_adapters` clears the count)."""
        if getattr(self, "_matmul_counts", None) is None:
            n_matmul = self.num_params(exclude_embeddings=True)
            frozen = sum(p.numel() for name, p in self.named_parameters()
                         if not p.requires_grad and name != "embed_tokens.weight")
            head = getattr(self, "lm_head", None)
            if self.config.tie_embeddings and head is not None:  # the shared matrix still does the lm_head matmul
                n_matmul += head.weight.numel()
                frozen += 0 if head.weight.requires_grad else head.weight.numel()
            params = {id(p): p for p in head.parameters()}.values() if head is not None else ()
            head_flops = float(sum((6 if p.requires_grad else 4) * p.numel() for p in params))
            self._matmul_counts = (n_matmul, frozen, head_flops)  # with `lm_head_flops_per_token`'s
        return self._matmul_counts[:2]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N_matmul + 12 L d T (PaLM appendix B; see module doc), d the
        attention's width n_heads × head_dim (d_model unless `d_head` says otherwise); 4, not 6,
        per frozen parameter: forward and input gradient, no weight gradient (the first
        block's q, k, v, gate and up need no input gradient either, 2 each: a percent or so, not
        counted). A reward model's and a value model's heads are in N_matmul."""
        c = self.config
        n_matmul, frozen = self.matmul_params()
        return 6.0 * n_matmul - 2.0 * frozen + 12.0 * c.n_layers * c.n_heads * c.head_dim * seq_len

    def lm_head_flops_per_token(self) -> float:
        """The lm_head's part of `flops_per_token`: 6 per trained parameter of its matmul (a tied
        head's shared matrix, LoRA adapters on it), 4 per frozen one; 0 for a model without an
        lm_head (a reward or value model). Counted once, as `matmul_params`."""
        self.matmul_params()
        return self._matmul_counts[2]

    def training_flops(self, seq_len: int, tokens: int, logit_positions: int | None = None) -> float:
        """Training FLOPs of `tokens` tokens in rows of `seq_len` of which the logits are computed
        at `logit_positions` only (None: every token): flops_per_token(seq_len) × tokens −
        lm_head_flops_per_token × (tokens − logit_positions), the blocks at every token and the
        lm_head where a loss reads it (`logits_to_keep`)."""
        kept = tokens if logit_positions is None else logit_positions
        return self.flops_per_token(seq_len) * tokens - self.lm_head_flops_per_token() * (tokens - kept)
