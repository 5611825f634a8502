"""Best-fit packing: whole documents per row, segment/position ids, the over-long policy,
and no cross-contamination through the model's segment-aware attention."""

import numpy as np
import pytest
import torch

from data_loader.sft_batches import shift
from sprout.prep.packing import best_fit, fit_examples, pack


def example(n_prompt: int, n_answer: int, start: int = 10):
    """ids start, start+1, ...; mask 0 on the prompt, 1 on the answer (last = its 'eot')."""
    ids = list(range(start, start + n_prompt + n_answer))
    return ids, [0] * n_prompt + [1] * n_answer


def test_best_fit_hand_case():
    # capacity 8, lengths 5 4 3 2 2: 5->A(3 left) 4->B(4 left) 3->A(full) 2->B(2) 2->B(full)
    row, off, n = best_fit(np.array([5, 4, 3, 2, 2]), 8)
    assert n == 2
    assert row.tolist() == [0, 1, 0, 1, 1] and off.tolist() == [0, 0, 5, 4, 6]


def test_best_fit_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, 500)
    row, off, n = best_fit(lengths, 64)
    used = np.zeros((n, 64), int)
    for r, o, l in zip(row, off, lengths):
        used[r, o:o + l] += 1
    assert used.max() == 1  # nothing overlaps or spills past the row
    assert used.sum() == lengths.sum()
    assert n <= int(np.ceil(lengths.sum() / 64 * 1.1)) + 1  # best fit wastes little
    again = best_fit(lengths, 64)
    assert (again[0] == row).all() and (again[1] == off).all()  # deterministic


def test_pack_keeps_documents_whole_with_restarting_positions():
    exs = [example(3, 4, 100 * k) for k in range(1, 8)]  # seven docs of 7 tokens
    p = pack(exs, seq_len=16, pad_id=0)
    assert p.tokens.shape == (4, 16) and p.counts["rows"] == 4
    found = 0
    for r in range(p.tokens.shape[0]):
        seg = p.segment_ids[r]
        k = seg.max()
        assert (seg[seg > 0] == np.repeat(np.arange(1, k + 1), 7)).all()  # 1..k then padding
        assert (seg[seg == 0] == 0).all() and (np.flatnonzero(seg == 0) >= 7 * k).all()
        for d in range(1, k + 1):
            doc = p.tokens[r][seg == d]
            assert doc.tolist() in [e[0] for e in exs]  # each document whole, in one row
            assert p.position_ids[r][seg == d].tolist() == list(range(7))
            assert p.loss_mask[r][seg == d].tolist() == [0, 0, 0, 1, 1, 1, 1]
            found += 1
        pad = seg == 0
        assert (p.tokens[r][pad] == 0).all() and (p.loss_mask[r][pad] == 0).all() and (p.position_ids[r][pad] == 0).all()
    assert found == 7
    assert p.counts["tokens"] == 49 and p.counts["pad_tokens"] == 64 - 49
    assert p.counts["trained_tokens"] == 28


def test_truncate_keeps_the_row_and_ends_inside_the_answer():
    kept, c = fit_examples([example(4, 20)], seq_len=10, overlong="truncate")
    ids, mask = kept[0]
    assert len(ids) == 10 and mask.tolist() == [0] * 4 + [1] * 6
    assert c["truncated"] == 1 and c["truncated_open"] == 1


def test_truncate_multi_turn_stops_after_last_complete_answer():
    # prompt 3, answer 2 (ends with its eot), second prompt 6, answer 4: cut at 8 lands in prompt 2
    ids = list(range(15))
    mask = [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    kept, c = fit_examples([(ids, mask)], seq_len=8, overlong="truncate")
    assert kept[0][0].tolist() == [0, 1, 2, 3, 4]  # the untrained tail after the cut is dropped
    assert c["truncated"] == 1 and c["truncated_open"] == 0


def test_drop_policy_and_counted_drops():
    exs = [example(3, 3), example(4, 20), example(12, 3), ([1, 2, 3], [0, 0, 0])]
    kept, c = fit_examples(exs, seq_len=10, overlong="drop")
    assert len(kept) == 1 and c["overlong_dropped"] == 1
    assert c["prompt_too_long"] == 1  # the 12-token prompt cannot fit a 10-token context
    assert c["no_trained_token"] == 1
    kept, c = fit_examples(exs, seq_len=10, overlong="truncate")
    assert len(kept) == 2 and c["prompt_too_long"] == 1 and c["no_trained_token"] == 1
    with pytest.raises(ValueError):
        fit_examples(exs, 10, overlong="wrap")


def test_no_cross_contamination():
    """A packed row's logits for each document equal that document's logits on its own."""
    from sprout.model.transformer import ModelConfig, Transformer

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    exs = [(rng.integers(4, 64, n).tolist(), [0] * (n // 2) + [1] * (n - n // 2)) for n in (9, 5, 12, 7, 3)]
    p = pack(exs, seq_len=20, pad_id=0)
    batch = shift({"tokens": p.tokens, "loss_mask": p.loss_mask,
                   "segment_ids": p.segment_ids, "position_ids": p.position_ids})
    model = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)).eval()
    with torch.no_grad():
        packed = model(batch["input_ids"], segment_ids=batch["segment_ids"], position_ids=batch["position_ids"])
        checked = 0
        for r in range(p.tokens.shape[0]):
            seg = batch["segment_ids"][r]
            for d in seg.unique().tolist():
                if d == 0:
                    continue
                cols = (seg == d).nonzero().flatten()
                alone = model(batch["input_ids"][r, cols][None])[0]
                torch.testing.assert_close(packed[r, cols], alone, rtol=1e-4, atol=1e-5)
                checked += 1
    assert checked == len(exs)
