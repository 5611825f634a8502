"""The decoder's prefill and one-token steps (the blocks' `prefill` and `step` on fused weights): a
block's equal its forward, and the decoder's logits equal the module forward's over the whole
sequence, to 1e-5 of their scale (left padding, grouped-query attention, tied embeddings, a value
head, q/k/v biases, a head size other than d_model / n_heads with Llama 3's rotary scaling;
dense, oneDNN-packed, and dense with packed copies for the compiled step's op),
shared prefills equal repeated prompts (also unpadded and one-token prompts), the compiled step
equals the eager one and compiles once for every length, cache size and model class (slow), and the weights
are read at each decoder's construction."""

import pytest
import torch

import sprout.model.onednn as onednn_module

from sprout.model.decode import Decoder, DecodeWeights, ModelDecoder, make_decoder
from sprout.model.onednn import onednn_available
from sprout.model.generate import pad_prompts
from sprout.model.heads import PolicyWithValue, padding_inputs
from sprout.model.transformer import ModelConfig, Transformer

PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 8], [11, 12, 13, 14]]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def random_model(cls=Transformer, **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64) | overrides
    m = cls(ModelConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return m


def assert_logits_close(got, expected):
    """Equal to 1e-5 of the logits' scale (float32 rounding through the layers, as the module's own
    cached path shows against its full forward)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def full_forward_logits(model, ids, mask, new):
    """Logits [N, steps + 1, V] at the last prompt position and at each fed token, by one forward
    over prompt + new tokens (no cache), padding as segment 0."""
    seq = torch.cat([ids, new], 1)
    segments, positions = padding_inputs(torch.cat([mask, torch.ones_like(new)], 1))
    with torch.no_grad():
        return model(seq, segment_ids=segments, position_ids=positions)[:, ids.shape[1] - 1 :]


def decoded_logits(decoder, ids, mask, new, repeats=1):
    with torch.no_grad():
        out = [decoder.prefill(ids, mask, repeats=repeats)]
        out += [decoder.step(new[:, t]) for t in range(new.shape[1])]
    return torch.stack(out, 1)


@pytest.mark.parametrize("kv_heads,bias", [(2, False), (None, False), (2, True)], ids=["gqa", "mha", "biases"])
def test_block_prefill_and_step_equal_its_forward(kv_heads, bias):
    """One block's decoding forms on its fused weights: the prefill at the prompts' real tokens and
    each step at its token give the block's forward over the whole left-padded sequence."""
    model, steps = random_model(n_kv_heads=kv_heads, attention_bias=bias), 4
    block, c = model.layers[1], model.config
    ids, mask = pad_prompts(PROMPTS)
    (B, P), real = ids.shape, mask.bool()
    x = torch.randn(B, P + steps, c.d_model, generator=torch.Generator().manual_seed(5))
    segments, positions = padding_inputs(torch.cat([mask, torch.ones(B, steps, dtype=torch.long)], 1))
    cos, sin = model.rotary(positions)  # [B, T, 1, D]
    causal = torch.ones(P + steps, P + steps, dtype=torch.bool).tril()
    k, v = (torch.zeros(B, c.kv_heads, P + steps, c.head_dim) for _ in range(2))
    weights = block.fused_weights(B, "dense")
    index = real.flatten().nonzero()[:, 0]
    allowed = (causal[:P, :P] & real[:, None, :]) | torch.eye(P, dtype=torch.bool)
    bias = torch.zeros(B, P + steps).masked_fill_(torch.cat([~real, torch.zeros(B, steps, dtype=torch.bool)], 1),
                                                  float("-inf"))
    with torch.no_grad():
        expected = block(x, cos, sin, ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None], None, 0)
        got = block.prefill(x[:, :P].reshape(B * P, -1)[index], weights, cos[:, :P][real], sin[:, :P][real], index,
                            allowed[:, None], k, v, "dense")
        assert_logits_close(got, expected[:, :P][real])
        for t in range(P, P + steps):
            got = block.step(x[:, t], weights, cos[:, t], sin[:, t], k, v, bias[:, None, None, : t + 1], "dense")
            assert_logits_close(got, expected[:, t])


@pytest.mark.parametrize("matmul", ["dense", "onednn", "onednn_op"])
@pytest.mark.parametrize("kind", ["gqa", "mha", "tied", "value head", "biases", "head size"])
def test_decode_step_equals_the_full_forward(kind, matmul):
    overrides = {"mha": dict(n_kv_heads=None), "tied": dict(tie_embeddings=True), "biases": dict(attention_bias=True),
                 "head size": dict(d_head=12, rope_scaling=LLAMA3)}.get(kind, {})
    model = random_model(PolicyWithValue if kind == "value head" else Transformer, **overrides)
    if matmul != "dense" and not onednn_available(model.lm_head.weight, onednn_module.ONEDNN_MIN_WIDTH):
        pytest.skip("no oneDNN")
    ids, mask = pad_prompts(PROMPTS)
    new = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    decoder = make_decoder(model, 3, ids.shape[1] + 9)
    assert isinstance(decoder, Decoder) and decoder.weights.kind == "dense"  # d_model 32 < ONEDNN_MIN_WIDTH
    decoder.weights = DecodeWeights.of(model, 3, matmul, "dense" if matmul == "onednn_op" else matmul)
    assert_logits_close(decoded_logits(decoder, ids, mask, new), full_forward_logits(model, ids, mask, new))


def test_autocast_keeps_dense_weights():
    """Under CPU autocast the matmuls stay autocast's (bf16), as in the module forward."""
    model = random_model()
    ids, mask = pad_prompts(PROMPTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not onednn_available(model.lm_head.weight, onednn_module.ONEDNN_MIN_WIDTH)
        decoder = Decoder(model, 3, ids.shape[1] + 2)
        got = decoded_logits(decoder, ids, mask, torch.tensor([[1, 2], [3, 4], [5, 6]]))
        expected = full_forward_logits(model, ids, mask, torch.tensor([[1, 2], [3, 4], [5, 6]]))
    assert decoder.weights.kind == decoder.weights.head_kind == "dense"
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * float(expected.abs().max()))  # bf16 rounding


def test_unpadded_prompts_and_a_full_cache():
    model = random_model()
    ids, mask = pad_prompts([[1, 2, 3], [4, 5, 6]])
    new = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(1))
    decoder = Decoder(model, 2, 3 + 4)
    assert_logits_close(decoded_logits(decoder, ids, mask, new), full_forward_logits(model, ids, mask, new))
    with pytest.raises(ValueError, match="KV cache full"):
        decoder.step(new[:, 0])


def test_shared_prefill_equals_repeated_prompts():
    """Each prompt prefilled once for its G rows gives the logits of the prompts repeated G times."""
    model = random_model()
    ids, mask = pad_prompts(PROMPTS)
    G = 3
    new = torch.randint(0, 64, (3 * G, 5), generator=torch.Generator().manual_seed(2))
    shared = decoded_logits(Decoder(model, 3 * G, ids.shape[1] + 5), ids, mask, new, repeats=G)
    rep_ids, rep_mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    assert_logits_close(shared, full_forward_logits(model, rep_ids, rep_mask, new))
    plain = decoded_logits(ModelDecoder(model, 3 * G, ids.shape[1] + 5), ids, mask, new, repeats=G)
    assert_logits_close(shared, plain)


@pytest.mark.parametrize("prompts", [[[7], [1, 2, 3]], [[1, 2], [3, 4]], [[5]]], ids=["one token", "unpadded", "P=1"])
def test_prefill_edge_cases(prompts):
    model = random_model()
    ids, mask = pad_prompts(prompts)
    B, G = len(prompts), 2
    new = torch.randint(0, 64, (B * G, 3), generator=torch.Generator().manual_seed(4))
    got = decoded_logits(Decoder(model, B * G, ids.shape[1] + 3), ids, mask, new, repeats=G)
    expected = full_forward_logits(model, ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), new)
    assert_logits_close(got, expected)


def test_weights_are_read_when_the_decoder_is_built():
    """Fused copies, so a decoder built after an update sees it (RL changes the weights between calls)."""
    model = random_model()
    before = DecodeWeights.of(model)
    with torch.no_grad():
        model.layers[0].self_attn.k_proj.weight.add_(1.0)
        model.layers[1].mlp.up_proj.weight.mul_(2.0)
    after = DecodeWeights.of(model)
    assert not torch.equal(before.layers[0][0][0], after.layers[0][0][0])  # qkv
    assert not torch.equal(before.layers[1][1][0], after.layers[1][1][0])  # gate_up
    ids, mask = pad_prompts(PROMPTS)
    new = torch.randint(0, 64, (3, 3), generator=torch.Generator().manual_seed(3))
    assert_logits_close(decoded_logits(Decoder(model, 3, ids.shape[1] + 3), ids, mask, new),
                        full_forward_logits(model, ids, mask, new))


@pytest.mark.slow
@pytest.mark.parametrize("onednn", [False, True], ids=["dense", "onednn"])
def test_compiled_step_equals_eager_and_compiles_once(onednn, monkeypatch):
    """The compiled step gives the eager logits, and one graph serves every step, prompt length, cache
    size and model class of a shape of rows (the length dims are dynamic); with oneDNN (the width threshold
    lowered to this model's) its matmuls go through `onednn_linear` on dense weights."""
    from torch._dynamo.utils import counters

    model = random_model()
    if onednn:
        if not onednn_available(model.lm_head.weight, onednn_module.ONEDNN_MIN_WIDTH):
            pytest.skip("no oneDNN")
        monkeypatch.setattr(onednn_module, "ONEDNN_MIN_WIDTH", 32)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    for prompts, extra in ((PROMPTS, 6), ([[3, 4, 5, 6, 7, 8, 9, 10, 11], [1], [2, 3]], 20)):
        ids, mask = pad_prompts(prompts)
        new = torch.randint(0, 64, (3, extra), generator=torch.Generator().manual_seed(extra))
        eager = decoded_logits(Decoder(model, 3, ids.shape[1] + extra), ids, mask, new)
        decoder = Decoder(model, 3, 64, compile=True)
        assert decoder.weights.kind == ("onednn_op" if onednn else "dense")
        compiled = decoded_logits(decoder, ids, mask, new)
        assert_logits_close(compiled, eager)
        assert_logits_close(compiled, full_forward_logits(model, ids, mask, new))
    policy = random_model(PolicyWithValue)  # another model class of the same shape: the same graph
    assert_logits_close(decoded_logits(Decoder(policy, 3, 64, compile=True), ids, mask, new),
                        full_forward_logits(policy, ids, mask, new))
    assert counters["stats"]["unique_graphs"] - graphs == 1
    biased = random_model(attention_bias=True)  # q/k/v biases: a graph of its own, the same logits
    assert_logits_close(decoded_logits(Decoder(biased, 3, 64, compile=True), ids, mask, new),
                        full_forward_logits(biased, ids, mask, new))


def test_a_compiled_modules_eager_view_decodes_on_fused_weights():
    """With train.compile the trainer generates through `Uncompiled(model)` (its eager forward):
    fused decoding never calls the forward, so it still gets a `Decoder`, with the same tokens."""
    from sprout.engine.trainer import Uncompiled
    from sprout.model.generate import generate_tokens

    model = random_model()
    model.compile()  # the forward only; decoding reads the blocks and weights
    view = Uncompiled(model)
    assert isinstance(make_decoder(view, 2, 16), Decoder)
    ids, mask = pad_prompts([[5, 9, 2], [4, 8]])
    greedy = [generate_tokens(m, ids, mask, max_new_tokens=6, greedy=True).completion_ids for m in (view, model)]
    assert torch.equal(greedy[0], greedy[1])
