"""The decode step on buffers of fixed shape and address (`sprout.model.static_decode`, the step a
CUDA graph captures), run eagerly on the CPU: its logits equal `Decoder`'s and the full forward's
to 1e-5 of their scale on a Llama-shaped model (grouped-query attention, q/k/v biases, tied
embeddings, Llama 3 rotary scaling), left-padded prompts of different lengths shared by several
rows; stale values past the current slot never count; no buffer is reallocated between steps;
`generate_tokens(cuda_graph=True)` gives the eager path's greedy tokens (stop ids, num_generations
> 1) and its sampled ones; "auto" is CUDA only and never under torch.distributed; autocast's
pre-cast weights give autocast's own logits; the compiled static step (slow; also at oneDNN's
width, the lm_head inside the compiled step); the CUDA graph itself where CUDA is (skipped
elsewhere; benchmarks/gpu_check.py's decode stage runs it)."""

import pytest
import torch

import sprout.model.generate as generate_module
from sprout.errors import SproutError
from sprout.model.decode import Decoder, DecodeWeights
from sprout.model.generate import generate_tokens, pad_prompts, static_decode_wanted
from sprout.model.onednn import ONEDNN_MIN_WIDTH, onednn_available
from sprout.model.static_decode import StaticDecoder
from sprout.model.transformer import ModelConfig, Transformer
from test_decode import assert_logits_close, random_model

PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 8], [11, 12, 13, 14]]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def llama_shaped(**overrides) -> Transformer:
    """A tiny model of an imported Llama/Qwen2's kind: 2 key/value heads for 4 query heads, q/k/v biases,
    tied embeddings, Llama 3 rotary scaling; weights large enough that the tokens differ."""
    return random_model(**{"attention_bias": True, "tie_embeddings": True, "rope_scaling": LLAMA3} | overrides)


def step_logits(decoder, ids, mask, new, repeats=1):
    """Prefill and one step per column of `new`, each step's logits copied (a graph's buffer is reused)."""
    with torch.no_grad():
        out = [decoder.prefill(ids, mask, repeats=repeats)]
        out += [decoder.step(new[:, t]).clone() for t in range(new.shape[1])]
    return torch.stack(out, 1)


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": None, "attention_bias": False, "tie_embeddings": False}],
                         ids=["llama-shaped", "plain"])
def test_static_step_equals_the_decoder(overrides):
    model = llama_shaped(**overrides)
    ids, mask = pad_prompts(PROMPTS)
    G, steps = 2, 9
    new = torch.randint(0, 64, (3 * G, steps), generator=torch.Generator().manual_seed(0))
    # a cache longer than the steps need: the slots past them are masked too
    static = step_logits(StaticDecoder(model, 3 * G, ids.shape[1] + steps + 5, graph=False), ids, mask, new, G)
    eager = step_logits(Decoder(model, 3 * G, ids.shape[1] + steps), ids, mask, new, G)
    assert_logits_close(static, eager)


def test_stale_cache_values_past_the_slot_never_count():
    """The static step attends over every slot; those past the new token's (here filled with large
    values, as a reused buffer may hold) get weight 0, as do the prompts' padding slots."""
    model = llama_shaped()
    ids, mask = pad_prompts(PROMPTS)
    new = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    clean = StaticDecoder(model, 3, ids.shape[1] + 6, graph=False)
    dirty = StaticDecoder(model, 3, ids.shape[1] + 6, graph=False)
    g = torch.Generator().manual_seed(2)
    for t in dirty.k + dirty.v:
        t.copy_(torch.randn(t.shape, generator=g) * 100)
    assert_logits_close(step_logits(dirty, ids, mask, new), step_logits(clean, ids, mask, new))


def test_buffers_keep_their_addresses_and_the_state_advances_in_place():
    """What a replayed graph relies on: every input and the cache stay where they were allocated."""
    model = llama_shaped()
    ids, mask = pad_prompts(PROMPTS)
    decoder = StaticDecoder(model, 3, ids.shape[1] + 4, graph=False)
    buffers = [decoder.tokens, decoder.positions, decoder.slot, decoder.padding_bias, *decoder.k, *decoder.v]
    before = [t.data_ptr() for t in buffers]
    step_logits(decoder, ids, mask, torch.ones(3, 4, dtype=torch.long))
    assert [t.data_ptr() for t in buffers] == before
    assert decoder.slot.tolist() == [ids.shape[1] + 4] and decoder.positions.tolist() == [11, 6, 8]
    with pytest.raises(ValueError, match="KV cache full"):
        decoder.step(torch.ones(3, dtype=torch.long))


def test_generate_with_the_static_step_gives_the_eager_tokens():
    """Greedy tokens equal (with stop ids that end some rows early, and G > 1), logits' rounding aside;
    sampled tokens from the same generator too."""
    model = llama_shaped()
    ids, mask = pad_prompts(PROMPTS)
    kwargs = dict(max_new_tokens=20, num_generations=2, greedy=True)
    free = generate_tokens(model, ids, mask, cuda_graph=False, **kwargs)
    stop = int(free.completion_ids[0, 4])  # row 0 stops at its 5th token; the others where they meet it
    eager = generate_tokens(model, ids, mask, cuda_graph=False, stop_ids={stop}, **kwargs)
    static = generate_tokens(model, ids, mask, cuda_graph=True, stop_ids={stop}, **kwargs)
    assert eager.lengths[0] == 5 and bool(eager.eos.any()) and not bool(eager.eos.all())
    for field in ("completion_ids", "completion_mask", "lengths", "eos", "truncated", "prompt_ids"):
        assert torch.equal(getattr(static, field), getattr(eager, field)), field
    sampled = [generate_tokens(model, ids, mask, max_new_tokens=12, num_generations=3, cuda_graph=graph,
                               generator=torch.Generator().manual_seed(7)) for graph in (False, True)]
    assert torch.equal(sampled[0].completion_ids, sampled[1].completion_ids)
    torch.testing.assert_close(sampled[1].logprobs, sampled[0].logprobs, rtol=0, atol=1e-5)


def test_which_calls_use_the_static_step(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert static_decode_wanted(True, cpu) and static_decode_wanted("auto", cuda)
    assert not static_decode_wanted("auto", cpu) and not static_decode_wanted(False, cuda)
    monkeypatch.setattr(generate_module, "_distributed", lambda: True)
    assert not static_decode_wanted(True, cuda) and not static_decode_wanted("auto", cuda)
    monkeypatch.undo()

    built = []

    class Spy(StaticDecoder):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(generate_module, "StaticDecoder", Spy)
    model = llama_shaped()
    ids, mask = pad_prompts(PROMPTS)
    generate_tokens(model, ids, mask, max_new_tokens=3, greedy=True)  # "auto" on the CPU: the Decoder
    assert built == []
    generate_tokens(model, ids, mask, max_new_tokens=3, greedy=True, cuda_graph=True)
    assert built == [{"graph": True, "compile": False, "weight_cache": None}]
    for bad in ("yes", 1, None):
        with pytest.raises(SproutError, match="generate: cuda_graph must be True, False or 'auto'"):
            generate_tokens(model, ids, mask, max_new_tokens=3, cuda_graph=bad)


def test_autocast_weights_are_cast_once_with_the_same_logits():
    """Under autocast the fused matrices are stored in its dtype; the logits equal (exactly) those of
    fp32 copies that autocast casts at every matmul."""
    model = llama_shaped()
    ids, mask = pad_prompts(PROMPTS)
    new = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(3))
    uncast = DecodeWeights.of(model, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = Decoder(model, 3, ids.shape[1] + 4)
        assert decoder.weights.layers[0][0][0].dtype == decoder.weights.lm_head.dtype == torch.bfloat16
        assert decoder.weights.layers[0][0][2].dtype == torch.float32  # the q/k/v bias: an add, not cast
        cast = step_logits(decoder, ids, mask, new)
        decoder = Decoder(model, 3, ids.shape[1] + 4)
        decoder.weights = uncast
        assert torch.equal(step_logits(decoder, ids, mask, new), cast)
        static = StaticDecoder(model, 3, ids.shape[1] + 4, graph=False)
        torch.testing.assert_close(step_logits(static, ids, mask, new), cast, rtol=0,
                                   atol=0.02 * float(cast.abs().max()))  # bf16 rounding of longer sums


@pytest.mark.slow
def test_compiled_static_step_equals_eager_and_compiles_once():
    """The static step under torch.compile: the eager logits, one graph for two cache sizes."""
    from torch._dynamo.utils import counters

    model = llama_shaped()
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    for prompts, extra in ((PROMPTS, 5), ([[3, 4, 5, 6, 7, 8, 9, 10, 11], [1], [2, 3]], 12)):
        ids, mask = pad_prompts(prompts)
        new = torch.randint(0, 64, (3, extra), generator=torch.Generator().manual_seed(extra))
        eager = step_logits(StaticDecoder(model, 3, ids.shape[1] + extra, graph=False), ids, mask, new)
        compiled = step_logits(StaticDecoder(model, 3, ids.shape[1] + extra, graph=False, compile=True), ids, mask,
                               new)
        assert_logits_close(compiled, eager)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_static_step_on_onednn_weights():
    """At oneDNN's width on the CPU the compiled static step holds the lm_head too: its weight is the
    kind a compiled graph takes (the packed one alone fails to compile), and the logits are the
    eager static step's."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, d_model=ONEDNN_MIN_WIDTH, n_layers=1, n_heads=4,
                                    max_seq_len=64)).eval()
    ids, mask = pad_prompts(PROMPTS)
    new = torch.randint(0, 64, (3, 3), generator=torch.Generator().manual_seed(4))
    compiled = StaticDecoder(model, 3, ids.shape[1] + 3, graph=False, compile=True)
    if not onednn_available(model.lm_head.weight, ONEDNN_MIN_WIDTH):
        pytest.skip("no oneDNN here")
    assert compiled.weights.head_kind == "onednn_op"
    eager = step_logits(StaticDecoder(model, 3, ids.shape[1] + 3, graph=False), ids, mask, new)
    assert_logits_close(step_logits(compiled, ids, mask, new), eager)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs CUDA")
def test_cuda_graph_gives_the_eager_tokens():
    model = llama_shaped().cuda()
    ids, mask = pad_prompts(PROMPTS, "cuda")
    new = torch.randint(0, 64, (6, 8), generator=torch.Generator().manual_seed(0)).cuda()
    graph = StaticDecoder(model, 6, ids.shape[1] + 8, graph=True)
    assert_logits_close(step_logits(graph, ids, mask, new, 2),
                        step_logits(StaticDecoder(model, 6, ids.shape[1] + 8, graph=False), ids, mask, new, 2))
    assert graph.graph is not None
    kwargs = dict(max_new_tokens=16, num_generations=2, greedy=True)
    assert torch.equal(generate_tokens(model, ids, mask, cuda_graph=True, **kwargs).completion_ids,
                       generate_tokens(model, ids, mask, cuda_graph=False, **kwargs).completion_ids)
