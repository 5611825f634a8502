"""Batched KV-cache sampling: equal to recomputation and to each row alone, stop ids, vocab
padding, log-probs, top-k/top-p, seeding, context limits, ranks kept in step under FSDP (slow);
the tensor API (`generate_tokens`: shapes, masks, adjacent samples per prompt, eos/truncated
flags, the chat stop default, the context warning) and the compiled decode step (slow)."""

import json
import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from sprout.errors import SproutError
import sprout.model.generate as generate_module
from sprout.model.generate import generate, generate_tokens, inverse_cdf_sample, process_logits, sample_next
from sprout.model.transformer import ModelConfig, Transformer

PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 8], [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return m


def greedy_by_recomputation(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_kv_cache_greedy_equals_full_recomputation(model):
    out = generate(model, PROMPTS, 12, temperature=0)
    assert out.tokens == [greedy_by_recomputation(model, p, 12) for p in PROMPTS]
    assert out.logprobs == [[0.0] * 12] * 3 and out.finished == [False] * 3


def test_left_padded_batch_equals_each_row_alone(model):
    g = torch.Generator().manual_seed(1)
    batch = generate(model, PROMPTS, 10, temperature=0)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], 10, temperature=0)
        assert batch.tokens[i] == alone.tokens[0]
    # sampling too: the same draws give the same tokens when each row's distribution is unchanged
    sampled = generate(model, PROMPTS, 10, temperature=0.8, top_k=1, generator=g)
    assert sampled.tokens == batch.tokens and all(lp == 0.0 for row in sampled.logprobs for lp in row)


def test_stop_ids_are_honoured_per_row(model):
    free = generate(model, PROMPTS, 12, temperature=0).tokens
    stop_ids = {free[0][2], free[1][6]}

    def cut(row):
        for i, t in enumerate(row):
            if t in stop_ids:
                return row[: i + 1], True
        return row, False

    out = generate(model, PROMPTS, 12, temperature=0, stop_ids=stop_ids)
    expected = [cut(row) for row in free]
    assert out.tokens == [e[0] for e in expected]
    assert out.finished == [e[1] for e in expected]
    assert out.finished[0] and len(out.tokens[0]) <= 3
    assert [len(lp) for lp in out.logprobs] == [len(t) for t in out.tokens]


def test_padded_vocab_ids_are_never_sampled(model):
    g = torch.Generator().manual_seed(0)
    free = generate(model, PROMPTS, 16, temperature=1.0, generator=g)
    assert any(t >= 10 for row in free.tokens for t in row)  # the check below can fail
    g = torch.Generator().manual_seed(0)
    out = generate(model, PROMPTS, 16, temperature=1.0, generator=g, vocab_size=10)
    assert all(t < 10 for row in out.tokens for t in row)
    with torch.no_grad():
        last = model(torch.tensor([PROMPTS[0]]))[0, -1]
    assert generate(model, PROMPTS[:1], 1, temperature=0, vocab_size=10).tokens[0] == [int(last[:10].argmax())]


def test_logprobs_are_those_of_the_processed_distribution(model):
    g = torch.Generator().manual_seed(0)
    settings = dict(temperature=0.7, top_k=20, top_p=0.9)
    out = generate(model, PROMPTS, 8, generator=g, **settings)
    for prompt, toks, lps in zip(PROMPTS, out.tokens, out.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks]))[0, len(prompt) - 1 : -1]
        expected = process_logits(logits, **settings).log_softmax(-1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), expected, rtol=0, atol=1e-5)
        raw = logits.log_softmax(-1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        assert not torch.allclose(torch.tensor(lps), raw)  # not the unprocessed distribution


def test_top_k_and_top_p_hand_checked():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    kept = lambda **kw: torch.isfinite(process_logits(logits, **kw))[0].nonzero()[:, 0].tolist()  # noqa: E731
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.4) == [0]  # 0.5 alone reaches 0.4
    assert kept(top_p=0.6) == [0, 1]  # 0.5 < 0.6 <= 0.7
    assert kept(top_p=0.8) == [0, 1, 2]  # 0.7 < 0.8 <= 0.85
    assert kept(top_p=1.0) == [0, 1, 2, 3, 4]
    # top-k first, then top-p on the renormalised survivors: [0.5, 0.2, 0.15] / 0.85
    assert kept(top_k=3, top_p=0.8) == [0, 1]  # 0.588 < 0.8 <= 0.824
    p = process_logits(logits, temperature=0.5, top_k=2).softmax(-1)[0]
    torch.testing.assert_close(p, torch.tensor([0.25, 0.04, 0, 0, 0]) / 0.29)  # p^(1/T), renormalised
    # the sampler's log-prob is taken under the kept, renormalised distribution
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits.expand(1000, 5), top_k=2, generator=g)
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp[tok == 0][0], torch.tensor(math.log(0.5 / 0.7)))
    assert abs((tok == 0).float().mean().item() - 0.5 / 0.7) < 0.05


def test_inverse_cdf_sampling_draws_the_distribution():
    """Frequencies match the probabilities, a token of probability 0 is never drawn (first,
    middle or last), and a seed gives the same draws."""
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1])
    logp = probs.log().expand(100_000, 5)
    draws = inverse_cdf_sample(logp, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    assert freq[2] == 0 and len(freq) == 5
    torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.01)  # 6 standard deviations
    assert torch.equal(draws, inverse_cdf_sample(logp, torch.Generator().manual_seed(0)))
    one_hot = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [0, 1.0, 0]]).log().repeat(1000, 1)
    assert inverse_cdf_sample(one_hot).tolist() == [0, 2, 1] * 1000


def test_stop_read_every_k_steps_gives_the_same_rollout(model, monkeypatch):
    """Reading "every row stopped" every 5 steps runs steps past the last stop; they are cut,
    so the rollout is the one read every step."""
    ids, mask = padded(PROMPTS)

    def run():
        return generate_tokens(model, ids, mask, max_new_tokens=40, num_generations=4, stop_ids=set(range(0, 64, 3)),
                               generator=torch.Generator().manual_seed(2))

    every = run()
    monkeypatch.setitem(generate_module.STOP_CHECK_EVERY, "cpu", 5)
    sparse = run()
    L = every.completion_ids.shape[1]
    assert bool(every.eos.all()) and L < 40 and L % 5 != 0  # the sparse run did steps past the last stop
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "eos", "truncated",
                 "lengths"):
        assert torch.equal(getattr(every, name), getattr(sparse, name)), name


def test_seeded_sampling_is_reproducible(model):
    def run(seed):
        return generate(model, PROMPTS, 16, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    a, b, c = run(3), run(3), run(4)
    assert a == b
    assert a.tokens != c.tokens


def test_context_limits(model):
    with pytest.raises(SproutError, match="longer than the context"):
        generate(model, [[1] * 65], 4)
    with pytest.raises(SproutError, match="top_p"):
        generate(model, [[1]], 4, top_p=0.0)
    out = generate(model, [[1] * 60, [2, 3]], 10, temperature=0)
    assert [len(t) for t in out.tokens] == [4, 4]  # stops when the longest row fills the context


@pytest.mark.slow
def test_generation_under_fsdp_keeps_every_rank_stepping(tmp_path):
    """2 FSDP2 processes whose rows stop at different steps (rank 0 within 4, rank 1 later): the
    run ends, both ranks run the same number of forwards, and each rank's tokens are those of
    one process given its prompts."""
    from fsdp_generate_worker import PLAN, model, run
    from proc import free_port, run_group

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "configs" / "accelerate" / "cpu_fsdp.yaml"), "--main_process_port", str(free_port()),
           str(root / "tests" / "fsdp_generate_worker.py"), str(tmp_path)]
    proc = run_group(cmd, timeout=180, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in PLAN]
    alone = [run(model().eval(), r) for r in PLAN]
    steps = [max(len(t) for t in g.tokens) for g in alone]
    assert steps[0] < steps[1] and len({len(t) for t in alone[1].tokens}) > 1  # uneven, as intended
    assert got[0]["forwards"] == got[1]["forwards"] == steps[1]  # prefill + steps - 1, on both ranks
    for g, a in zip(got, alone):
        assert g["tokens"] == a.tokens and g["finished"] == a.finished
        assert all(torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
                   for x, y in zip(g["logprobs"], a.logprobs))


# ---- the tensor API: generate_tokens -> Rollout ------------------------------------------------
def padded(prompts, side="left"):
    P = max(len(p) for p in prompts)
    pad = lambda p: [0] * (P - len(p))  # noqa: E731
    ids = [pad(p) + p if side == "left" else p + pad(p) for p in prompts]
    mask = [pad(p) + [1] * len(p) if side == "left" else [1] * len(p) + pad(p) for p in prompts]
    return torch.tensor(ids), torch.tensor(mask)


def test_generate_tokens_shapes_masks_and_flags(model):
    ids, mask = padded(PROMPTS)
    free = generate_tokens(model, ids, mask, max_new_tokens=12, greedy=True)
    stop = int(free.completion_ids[1, 4])  # row 1 stops at or before step 5
    out = generate_tokens(model, ids, mask, max_new_tokens=12, greedy=True, stop_ids={stop}, pad_id=63)
    N, L = out.completion_ids.shape
    assert (N, L) == (3, 12) and out.prompt_ids.shape == (3, 7) and out.prompt_mask.tolist() == mask.tolist()
    assert torch.equal(out.lengths, out.completion_mask.sum(1)) and out.lengths[1] <= 5
    assert torch.equal(out.eos, ~out.truncated) and bool(out.eos[1])
    for r in range(N):
        n = int(out.lengths[r])
        assert out.completion_mask[r].tolist() == [1] * n + [0] * (L - n)  # right-padded
        assert out.completion_ids[r, n:].tolist() == [63] * (L - n)
        assert out.completion_ids[r, :n].tolist() == free.completion_ids[r, :n].tolist()
        assert bool(out.eos[r]) == (int(out.completion_ids[r, n - 1]) == stop)
        assert not (out.completion_ids[r, : n - 1] == stop).any()
    assert not out.eos[0] or int(out.lengths[0]) < 12  # a row without the stop id runs to the end
    assert all(bool(out.truncated[r]) == (int(out.lengths[r]) == 12) for r in range(N))


def test_right_padded_or_unpadded_input_is_left_aligned(model):
    left = generate_tokens(model, *padded(PROMPTS), max_new_tokens=6, greedy=True)
    right = generate_tokens(model, *padded(PROMPTS, "right"), max_new_tokens=6, greedy=True)
    assert torch.equal(left.completion_ids, right.completion_ids) and torch.equal(left.prompt_ids, right.prompt_ids)
    alone = generate_tokens(model, torch.tensor([PROMPTS[0]]), max_new_tokens=6, greedy=True)
    assert alone.completion_ids[0].tolist() == left.completion_ids[0].tolist()
    with pytest.raises(SproutError, match="at least one token"):
        generate_tokens(model, torch.tensor([[1, 2]]), torch.tensor([[0, 0]]), max_new_tokens=2)


def test_num_generations_adjacent_and_seeded(model):
    ids, mask = padded(PROMPTS)

    def run(seed, G=4):
        return generate_tokens(model, ids, mask, max_new_tokens=10, num_generations=G,
                               generator=torch.Generator().manual_seed(seed))

    a, b, c = run(0), run(0), run(1)
    assert a.completion_ids.shape == (12, 10) and torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    for i, p in enumerate(PROMPTS):
        rows = a.prompt_ids[i * 4 : i * 4 + 4]
        assert all(r[a.prompt_mask[i * 4] == 1].tolist() == p for r in rows)  # prompt i's G samples are adjacent
    assert len({tuple(r) for r in a.completion_ids[:4].tolist()}) > 1  # the G samples differ
    greedy = generate_tokens(model, ids, mask, max_new_tokens=10, num_generations=4, greedy=True)
    assert all(torch.equal(greedy.completion_ids[i * 4], greedy.completion_ids[i * 4 + j])
               for i in range(3) for j in range(4))


def test_rollout_logprobs_equal_a_full_forward_at_temperature_1(model):
    ids, mask = padded(PROMPTS)
    out = generate_tokens(model, ids, mask, max_new_tokens=8, num_generations=2,
                          generator=torch.Generator().manual_seed(5), stop_ids={int(7)})
    for r in range(out.completion_ids.shape[0]):
        prompt = out.prompt_ids[r][out.prompt_mask[r] == 1].tolist()
        n = int(out.lengths[r])
        toks = out.completion_ids[r, :n].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks]))[0, len(prompt) - 1 : -1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        torch.testing.assert_close(out.logprobs[r, :n], expected, rtol=0, atol=1e-5)
        assert (out.logprobs[r, n:] == 0).all()


def test_default_stop_is_the_chat_end_of_turn(sp):
    from sprout.model.generate import default_stop_ids
    from sprout.chat import template_for

    tpl = template_for(sp)
    assert default_stop_ids(sp) == {tpl.eot_id} | {h[0] for h in tpl.headers.values()}
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=sp.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)).eval()
    ids = torch.tensor([sp.encode("hello there")])
    free = generate_tokens(m, ids, max_new_tokens=10, greedy=True)
    assert not free.eos.any() and int(free.lengths[0]) == 10  # without a tokenizer nothing stops
    with torch.no_grad():  # make the end-of-turn id twice as likely (in logits) as step 3's greedy pick
        m.lm_head.weight[tpl.eot_id] = 2 * m.lm_head.weight[int(free.completion_ids[0, 2])]
    out = generate_tokens(m, ids, max_new_tokens=10, greedy=True, tokenizer=sp)
    n = int(out.lengths[0])
    assert bool(out.eos[0]) and n <= 3 and int(out.completion_ids[0, n - 1]) == tpl.eot_id


def test_context_warning_once_and_truncated_rows(model, monkeypatch):
    import sprout.model.generate as gen

    monkeypatch.setattr(gen, "_warned", set())
    ids, mask = padded([[1] * 60, [2, 3]])
    with pytest.warns(UserWarning, match="exceed the context of 64"):
        out = generate_tokens(model, ids, mask, max_new_tokens=10, greedy=True)
    assert out.completion_ids.shape[1] == 4 and out.truncated.all() and not out.eos.any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_tokens(model, ids, mask, max_new_tokens=10, greedy=True)  # said once only
        generate_tokens(model, ids, mask, max_new_tokens=4, greedy=True)  # fits: no warning


def test_sampling_defaults_have_top_k_off(model):
    import inspect

    params = inspect.signature(generate_tokens).parameters
    assert params["top_k"].default is None and params["top_p"].default is None
    assert params["temperature"].default == 1.0 and params["greedy"].default is False
    g = torch.Generator().manual_seed(0)
    out = generate_tokens(model, torch.tensor([[1, 2, 3]]), max_new_tokens=1, num_generations=2000, generator=g)
    assert len(set(out.completion_ids[:, 0].tolist())) > 50  # more distinct tokens than a top-50 would allow


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens(model):
    ids, mask = padded(PROMPTS)
    for kw in (dict(greedy=True), dict(temperature=1.0)):
        eager = generate_tokens(model, ids, mask, max_new_tokens=12, num_generations=2, compile=False,
                                generator=torch.Generator().manual_seed(0), **kw)
        compiled = generate_tokens(model, ids, mask, max_new_tokens=12, num_generations=2, compile=True,
                                   generator=torch.Generator().manual_seed(0), **kw)
        assert torch.equal(eager.completion_ids, compiled.completion_ids)
        torch.testing.assert_close(eager.logprobs, compiled.logprobs, rtol=0, atol=1e-5)
