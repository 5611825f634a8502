import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sprout.errors import SproutError
from sprout.model.heads import PolicyWithValue, RewardModel
from sprout.model.load import uninitialised
from sprout.model.transformer import ModelConfig, Transformer, apply_rope, rope_tables

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, **kw})).eval()
    with torch.no_grad():  # larger weights than init so that every test is sensitive
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def test_causality_future_tokens_do_not_change_past_logits():
    model = tiny()
    x = torch.randint(0, 64, (2, 20))
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 1) % 64
    lx, ly = model(x), model(y)
    torch.testing.assert_close(lx[:, :12], ly[:, :12], rtol=0, atol=1e-5)
    assert (lx[:, 12:] - ly[:, 12:]).abs().max() > 1e-2  # the change is seen from position 12 on


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "tie_embeddings": True}])
def test_kv_cache_decoding_equals_full_forward(kw):
    model = tiny(**kw)
    x = torch.randint(0, 64, (3, 24))
    full = model(x)
    cache = model.new_cache(3, 24)
    steps = [model(x[:, :8], cache=cache), model(x[:, 8:13], cache=cache)]  # prefill, then a chunk
    steps += [model(x[:, t : t + 1], cache=cache) for t in range(13, 24)]  # then one token at a time
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert cache.length == 24 and cache.next_pos.tolist() == [24, 24, 24]


def test_kv_cache_left_padding_matches_each_row_alone():
    model = tiny(n_kv_heads=2)
    prompts = [[5, 9, 2, 7, 1, 3], [4, 8], [11, 12, 13, 14]]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    seg = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    pos = (torch.cumsum(seg, 1) - 1).clamp(min=0)
    cache = model.new_cache(3, P + 4)
    first = model(ids, segment_ids=seg, position_ids=pos, cache=cache)[:, -1]
    assert cache.next_pos.tolist() == [6, 2, 4]  # each row continues at its own length
    nxt = torch.tensor([[20], [21], [22]])
    out = [first] + [model(nxt + i, cache=cache)[:, -1] for i in range(4)]
    for b, p in enumerate(prompts):
        alone = model(torch.tensor([p + [20 + b + i for i in range(4)]]))[0, len(p) - 1 :]
        torch.testing.assert_close(torch.stack([o[b] for o in out]), alone, rtol=0, atol=1e-5)


def test_segment_mask_isolates_packed_documents():
    model = tiny()
    docs = [torch.randint(1, 64, (n,)) for n in (5, 9, 4)]
    pad = 3
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])[None]
    seg = torch.cat([torch.full((len(d),), i + 1) for i, d in enumerate(docs)] + [torch.zeros(pad, dtype=torch.long)])
    seg = seg[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(pad)])[None]
    packed = model(ids, segment_ids=seg, position_ids=pos)
    start = 0
    for d in docs:
        alone = model(d[None])
        torch.testing.assert_close(packed[:, start : start + len(d)], alone, rtol=0, atol=1e-5)
        start += len(d)
    # without the mask the second document would see the first one
    leaky = model(ids, position_ids=pos)
    assert (leaky[:, 5:14] - packed[:, 5:14]).abs().max() > 1e-2


def test_default_positions_and_hidden_hook():
    model = tiny()
    x = torch.randint(0, 64, (2, 10))
    logits, hidden = model(x, return_hidden=True)
    assert hidden.shape == (2, 10, 32) and logits.dtype == torch.float32
    torch.testing.assert_close(model.lm_head(hidden), logits)
    torch.testing.assert_close(model(x, position_ids=torch.arange(10).expand(2, 10)), logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x, segment_ids=torch.ones(2, 10, dtype=torch.long)), logits, rtol=0, atol=1e-5)


def test_rope_is_hf_rotate_half_convention():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 16)
    cos, sin = rope_tables(16, 7, 10000.0)
    # HF LlamaRotaryEmbedding / apply_rotary_pos_emb, written out
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    emb = torch.cat([torch.outer(torch.arange(7).float(), inv)] * 2, dim=-1)
    rotate_half = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    hf = x * emb.cos()[None, :, None] + rotate_half * emb.sin()[None, :, None]
    torch.testing.assert_close(apply_rope(x, cos[None, :, None], sin[None, :, None]), hf)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def test_llama3_rope_tables_equal_transformers():
    """Llama 3's scaled frequencies: the tables equal transformers' LlamaRotaryEmbedding's cos/sin
    (head size 32 and original context 64: every band, slowed, kept and interpolated, occurs)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256,
                                      rope_theta=10000.0, rope_scaling=dict(LLAMA3))
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    x, positions = torch.zeros(1, 256, 64), torch.arange(256)[None]
    cos_hf, sin_hf = rotary(x, positions)
    cos, sin = rope_tables(32, 256, 10000.0, LLAMA3)
    torch.testing.assert_close(cos, cos_hf[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, torch.cat((-sin_hf[0, :, :16], sin_hf[0, :, 16:]), -1), rtol=0, atol=0)
    with pytest.raises(SproutError, match="rope type 'yarn' is not supported"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(SproutError, match="takes a number for each of factor"):
        ModelConfig(rope_scaling={k: v for k, v in LLAMA3.items() if k != "factor"})


def test_head_size_and_biases_of_imported_models():
    """`d_head` sets the head size apart from d_model / n_heads; `attention_bias` gives q, k and v
    biases, zero at init; a config's dict records both and rope_scaling, and builds the same config."""
    from sprout.config import config_to_dict

    m = tiny(d_head=12, n_kv_heads=2, attention_bias=True)
    attn = m.layers[0].self_attn
    assert attn.q_proj.weight.shape == (48, 32) and attn.k_proj.weight.shape == (24, 32)
    assert attn.o_proj.weight.shape == (32, 48) and m.rope_cos.shape[-1] == 12
    assert attn.q_proj.bias.shape == (48,) and not attn.v_proj.bias.any() and attn.o_proj.bias is None
    assert m(torch.randint(0, 64, (2, 9))).shape == (2, 9, 64)
    plain = config_to_dict(ModelConfig())
    assert list(plain) == ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len",
                           "rope_theta", "norm_eps", "tie_embeddings", "init_std", "d_head", "attention_bias",
                           "rope_scaling"]
    assert ModelConfig(**plain) == ModelConfig()
    full = config_to_dict(ModelConfig(d_head=16, attention_bias=True, rope_scaling=dict(LLAMA3)))
    assert (full["d_head"], full["attention_bias"], full["rope_scaling"]) == (16, True, LLAMA3)
    assert ModelConfig(**full).head_dim == 16


def test_gqa_and_tied_variants():
    gqa = tiny(n_kv_heads=1)
    assert gqa.layers[0].self_attn.k_proj.weight.shape == (8, 32)
    assert gqa(torch.randint(0, 64, (2, 9))).shape == (2, 9, 64)
    tied = tiny(tie_embeddings=True)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied(torch.randint(0, 64, (2, 9))).shape == (2, 9, 64)
    assert "lm_head.weight" not in dict(tied.named_parameters())  # counted once


def test_param_count_and_flops_hand_checked():
    cfg = dict(vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16)
    m = Transformer(ModelConfig(**cfg))
    # per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 + gate/up/down 3*8*16 + two norms 2*8 = 592
    per_layer = 64 + 32 + 32 + 64 + 3 * 128 + 16
    assert per_layer == 592
    assert m.num_params() == 10 * 8 + 2 * per_layer + 8 + 8 * 10  # embed, layers, norm, lm_head
    assert m.num_params(exclude_embeddings=True) == 2 * per_layer + 8 + 80
    assert m.flops_per_token(16) == 6 * (2 * per_layer + 8 + 80) + 12 * 2 * 8 * 16
    t = Transformer(ModelConfig(**cfg, tie_embeddings=True))
    assert t.num_params() == 80 + 2 * per_layer + 8
    assert t.flops_per_token(16) == m.flops_per_token(16)  # the lm_head matmul is still done
    assert m.lm_head_flops_per_token() == t.lm_head_flops_per_token() == 6 * 80
    assert m.training_flops(16, 32, 8) == 32 * m.flops_per_token(16) - 24 * 6 * 80  # logits at 8 of 32 tokens
    assert ModelConfig(d_model=256).ff_dim == 704 and ModelConfig(d_model=768).ff_dim == 2048


def test_bad_config_is_a_one_line_error():
    with pytest.raises(SproutError, match="n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(SproutError, match="n_kv_heads"):
        ModelConfig(n_heads=8, n_kv_heads=3)


def test_init_statistics():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=8))
    std = lambda t: t.detach().std().item()  # noqa: E731
    assert abs(std(m.embed_tokens.weight) - 0.02) < 0.001
    assert abs(std(m.lm_head.weight) - 0.02) < 0.001
    assert abs(std(m.layers[0].self_attn.q_proj.weight) - 0.02) < 0.001
    assert abs(std(m.layers[0].mlp.gate_proj.weight) - 0.02) < 0.001
    resid = 0.02 / math.sqrt(12)
    assert abs(std(m.layers[3].self_attn.o_proj.weight) - resid) < 0.0005
    assert abs(std(m.layers[5].mlp.down_proj.weight) - resid) < 0.0005
    assert all((m.layers[i].input_layernorm.weight == 1).all() for i in range(6)) and (m.norm.weight == 1).all()
    with torch.no_grad():  # final hidden has unit RMS, so logits ~ N(0, 0.02^2 d): loss ~ ln V + var / 2
        x = torch.randint(0, 4096, (2, 64))
        loss = F.cross_entropy(m(x)[:, :-1].reshape(-1, 4096), x[:, 1:].reshape(-1))
    assert abs(loss.item() - (math.log(4096) + 0.5 * 0.02**2 * 256)) < 0.02


@pytest.mark.parametrize("cls", [Transformer, RewardModel, PolicyWithValue])
@pytest.mark.parametrize("tie", [False, True])
def test_an_uninitialised_model_loads_into_the_same_function(cls, tie):
    scaling = dict(LLAMA3, original_max_position_embeddings=16) if tie else None  # the tables of either kind
    config = ModelConfig(**{**TINY, "tie_embeddings": tie, "rope_theta": 500.0, "rope_scaling": scaling})
    torch.manual_seed(0)
    built, empty = cls(config).eval(), uninitialised(cls, config).eval()
    assert [(n, p.shape) for n, p in empty.named_parameters()] == [(n, p.shape) for n, p in built.named_parameters()]
    assert all(p.device.type == "cpu" for p in empty.parameters())
    assert set(empty.state_dict()) == set(built.state_dict())  # the rotary tables stay out of it
    torch.testing.assert_close(empty.rope_cos, built.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(empty.rope_sin, built.rope_sin, rtol=0, atol=0)
    if tie and cls is not RewardModel:
        assert empty.lm_head.weight is empty.embed_tokens.weight  # tied again, as __init__ ties them
    empty.load_state_dict(built.state_dict())
    x = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(empty(x), built(x), rtol=0, atol=0)


def test_an_uninitialised_model_runs_no_init_on_the_meta_device():
    """A meta tensor's normal_ (nn.Embedding's init, a head's, reset_parameters') imports
    torch._dynamo, 1.6 s of CPU per process: building an uninitialised model of each class
    imports none."""
    code = """
import sys, torch
from sprout.model.heads import PolicyWithValue, RewardModel
from sprout.model.load import uninitialised
from sprout.model.transformer import ModelConfig, Transformer
for cls in (Transformer, RewardModel, PolicyWithValue):
    uninitialised(cls, ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64))
print("torch._dynamo" in sys.modules)
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "False"


def test_overfits_one_batch():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=32))
    x = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(50):
        loss = F.cross_entropy(m(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, loss.item()


def test_hand_written_backwards_match_autograd():
    """RMSNorm and rotary have hand-written backwards (for CPU speed): gradcheck them in
    float64 and compare with autograd through the plain formulas."""
    from sprout.model.transformer import RMSNorm, _RMSNormFunction, _RopeFunction, apply_rope, rope_tables

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFunction.apply(a, b, 1e-5), (x, w))
    plain = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    norm = RMSNorm(8, 1e-5).double()
    norm.weight.data.copy_(w.detach())
    g = torch.randn_like(plain)
    ref = torch.autograd.grad(plain, (x, w), g)
    got = torch.autograd.grad(norm(x), (x, norm.weight), g)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b)

    cos, sin = (t.double()[:5][None, :, None] for t in rope_tables(8, 16, 10000.0))
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: _RopeFunction.apply(a, cos, sin), (q,))
    half = 4  # HF: q * cat(c, c) + rotate_half(q) * cat(s, s), rotate_half(q) = cat(-q2, q1)
    c, s = cos[..., :half].repeat(1, 1, 1, 2), -sin[..., :half].repeat(1, 1, 1, 2)
    hf = q * c + torch.cat((-q[..., half:], q[..., :half]), -1) * s
    torch.testing.assert_close(apply_rope(q, cos, sin), hf)
