"""Batched KV-cache sampling: equal to recomputation and to each row alone, stop ids, vocab
padding, log-probs, top-k/top-p, seeding, context limits, and ranks kept in step under FSDP (slow)."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from sprout.errors import SproutError
from sprout.model.generate import generate, process_logits, sample_next
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
    from proc import run_group

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "configs" / "accelerate" / "cpu_fsdp.yaml"), "--main_process_port", "29551",
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
