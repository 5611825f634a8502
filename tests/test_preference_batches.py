"""Preference batches (`data_loader.preference_batches` over `sprout.formats.preference_tokens`):
response-only masks, both sides of a pair in one micro-batch, rank-disjoint seeded order with
exact resume, keep_end truncation and drop counts, eval padding across ranks; fixtures are
preference JSONL files written by the test through the format's own writer."""

import numpy as np
import pytest
import torch

from data_loader.preference_batches import PreferenceLoader
from sprout.errors import SproutError
from sprout.formats import preference_tokens
from sprout.formats.preference_tokens import render_pair, tokenize_preferences
from sprout.formats.preference_pairs import write_preferences


def msg(role, content):
    return {"role": role, "content": content}


def pair(i, prompt=None, chosen=None, rejected=None, **extra):
    return {"id": f"p{i}", "source": "test",
            "prompt": prompt or [msg("user", f"What is {i} plus {i}?")],
            "chosen": [msg("assistant", chosen or f"The answer is {2 * i}.")],
            "rejected": [msg("assistant", rejected or f"I think it is {2 * i + 1}, or maybe not.")], **extra}


MULTI_TURN = pair(100, prompt=[msg("system", "You are terse."), msg("user", "Say hello."),
                               msg("assistant", "Hello there friend."), msg("user", "Now add 2 and 3.")],
                  chosen="5", rejected="It is 6.", margin=1.5)


def write(tmp_path, records, name="prefs.jsonl"):
    path = tmp_path / name
    write_preferences(path, records)
    return path


def response_of(batch, row, tok):
    """The token ids a row trains on (targets under loss_mask)."""
    return batch["targets"][row][batch["loss_mask"][row]].tolist()


def test_masks_cover_the_final_response_only(tmp_path, tok):
    path = write(tmp_path, [MULTI_TURN, pair(1)])
    loader = PreferenceLoader(path, tok, batch_size=2, seq_len=256, shuffle=False)
    batch = loader.next_batch()
    eot = tok.eot_id
    for row, text in ((0, "5"), (2, "It is 6.")):  # pair 0: chosen row 0, rejected row 2
        assert response_of(batch, row, tok) == tok.encode(text) + [eot]
        assert batch["response_lengths"][row] == len(tok.encode(text)) + 1
        end = int(batch["end_index"][row])
        assert batch["input_ids"][row, end] == eot and batch["attention_mask"][row, end]
        assert not batch["attention_mask"][row, end + 1:].any()
        # the earlier assistant turn is in the input but never trained
        earlier = tok.encode("Hello there friend.")
        ids = batch["input_ids"][row].tolist()
        at = next(i for i in range(len(ids)) if ids[i:i + len(earlier)] == earlier)
        assert not batch["loss_mask"][row, at - 1:at + len(earlier) + 1].any()
    assert batch["margin"].tolist() == [1.5, 0.0]
    assert batch["pair_mask"].all()


def test_both_sides_of_each_pair_share_the_batch_and_the_prompt(tmp_path, sp):
    records = [pair(i) for i in range(6)]
    path = write(tmp_path, records)
    loader = PreferenceLoader(path, sp, batch_size=3, seq_len=128, seed=1)
    batch = loader.next_batch()
    assert batch["input_ids"].shape[0] == 6 and batch["pair_index"].shape == (3,)
    for i, p in enumerate(batch["pair_index"].tolist()):
        record = records[p]
        assert response_of(batch, i, sp) == sp.encode(record["chosen"][0]["content"]) + [sp.eot_id]
        assert response_of(batch, 3 + i, sp) == sp.encode(record["rejected"][0]["content"]) + [sp.eot_id]
        prompt_len = loader.pairs[p].prompt_len
        assert torch.equal(batch["input_ids"][i, :prompt_len], batch["input_ids"][3 + i, :prompt_len])
        assert not batch["loss_mask"][i, :prompt_len - 1].any()  # target prompt_len-1 is the first response token
        assert batch["loss_mask"][i, prompt_len - 1]
    # right padding, segment 0 and position 0 on padding, targets shifted
    real = batch["attention_mask"]
    assert torch.equal(batch["segment_ids"], real.long())
    assert (batch["position_ids"][~real] == 0).all() and (batch["input_ids"][~real] == sp.pad_id).all()
    assert torch.equal(batch["targets"][:, :-1], batch["input_ids"][:, 1:])


def test_padded_rows_score_as_alone(tmp_path, sp):
    """segment_ids/position_ids make a right-padded row compute what it computes alone."""
    from sprout.model.heads import RewardModel
    from sprout.model.transformer import ModelConfig

    path = write(tmp_path, [MULTI_TURN, pair(1), pair(22)])
    batch = PreferenceLoader(path, sp, batch_size=3, seq_len=128, shuffle=False).next_batch()
    torch.manual_seed(0)
    model = RewardModel(ModelConfig(vocab_size=sp.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=128))
    with torch.no_grad():
        scores = model(batch["input_ids"], segment_ids=batch["segment_ids"], position_ids=batch["position_ids"])
        for row in range(6):
            end = int(batch["end_index"][row])
            alone = model(batch["input_ids"][row:row + 1, :end + 1])
            assert torch.allclose(scores[row, end], alone[0, end], atol=1e-5)


def test_ranks_take_disjoint_pairs_covering_the_epoch(tmp_path, sp):
    path = write(tmp_path, [pair(i) for i in range(12)])
    loaders = [PreferenceLoader(path, sp, batch_size=2, seq_len=128, seed=3, rank=r, world_size=3) for r in range(3)]
    assert loaders[0].steps_per_epoch == 2
    seen = []
    for _ in range(2):
        for loader in loaders:
            seen += loader.next_batch()["pair_index"].tolist()
    assert sorted(seen) == list(range(12))
    assert all(loader.epoch == 1 and loader.step == 0 for loader in loaders)


def order(loader, steps):
    return [loader.next_batch()["pair_index"].tolist() for _ in range(steps)]


def test_order_is_seeded_and_differs_per_epoch(tmp_path, sp):
    path = write(tmp_path, [pair(i) for i in range(8)])
    make = lambda seed: PreferenceLoader(path, sp, batch_size=4, seq_len=128, seed=seed)  # noqa: E731
    a, b, c = order(make(0), 4), order(make(0), 4), order(make(1), 4)
    assert a == b and a != c
    assert a[0] + a[1] != a[2] + a[3]  # epoch 1 is another permutation
    assert sorted(a[0] + a[1]) == sorted(a[2] + a[3]) == list(range(8))
    assert order(PreferenceLoader(path, sp, batch_size=4, seq_len=128, shuffle=False), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_resume_continues_the_exact_order(tmp_path, sp):
    path = write(tmp_path, [pair(i) for i in range(10)])
    make = lambda: PreferenceLoader(path, sp, batch_size=3, seq_len=128, seed=7)  # noqa: E731
    straight = make()
    expected = [straight.next_batch() for _ in range(7)]  # 3 steps per epoch: crosses two epochs
    first = make()
    for _ in range(4):
        first.next_batch()
    state = first.state_dict()
    assert state["epoch"] == 1 and state["step"] == 1
    resumed = make()
    resumed.load_state_dict(state)
    for want in expected[4:]:
        got = resumed.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)
    other = PreferenceLoader(path, sp, batch_size=2, seq_len=128, seed=7)
    with pytest.raises(SproutError, match="global_batch"):
        other.load_state_dict(state)


def long_history_pair(i):
    """A pair whose prompt carries two long earlier exchanges before the last question."""
    filler = " ".join(["lorem ipsum dolor sit amet"] * 12)
    return pair(i, prompt=[msg("system", "Be brief."), msg("user", filler), msg("assistant", filler),
                           msg("user", "And again: " + filler), msg("assistant", "Again: " + filler),
                           msg("user", "Last question: what is 2 plus 2?")],
                chosen="4", rejected="It is 5, I believe.")


def test_keep_end_drops_oldest_exchanges_and_never_the_response(tmp_path, sp):
    record = long_history_pair(0)
    full = render_pair(record, sp)
    short = render_pair({**record, "prompt": [record["prompt"][0], record["prompt"][-1]]}, sp)
    seq_len = short.longest + 2  # fits only once both earlier exchanges are gone
    assert full.longest > seq_len
    path = write(tmp_path, [record, pair(1)])
    loader = PreferenceLoader(path, sp, batch_size=2, seq_len=seq_len, truncation="keep_end", shuffle=False)
    assert loader.counts == {"pairs_read": 2, "pairs": 2, "dropped_too_long": 0, "truncated": 1,
                             "prompt_turns_dropped": 4}
    assert loader.truncated == [(1, "p0", 4)]
    kept = loader.pairs[0]
    assert np.array_equal(kept.chosen, short.chosen) and np.array_equal(kept.rejected, short.rejected)
    text = sp.decode(kept.chosen.tolist())
    assert "Be brief." in text and "Last question" in text and "lorem" not in text
    batch = loader.next_batch()
    assert response_of(batch, 0, sp) == sp.encode("4") + [sp.eot_id]
    assert response_of(batch, 2, sp) == sp.encode("It is 5, I believe.") + [sp.eot_id]
    assert batch["input_ids"].shape[1] <= seq_len

    # one exchange dropped is enough when the context is a little longer
    one = render_pair({**record, "prompt": record["prompt"][:1] + record["prompt"][3:]}, sp)
    loader = PreferenceLoader(path, sp, batch_size=2, seq_len=one.longest, truncation="keep_end")
    assert loader.counts["prompt_turns_dropped"] == 2 and np.array_equal(loader.pairs[0].chosen, one.chosen)


def test_too_long_pairs_are_dropped_and_counted(tmp_path, sp):
    records = [long_history_pair(0), pair(1), pair(2, rejected="word " * 200)]
    path = write(tmp_path, records)
    seq_len = render_pair(pair(1), sp).longest + 40
    dropped = tokenize_preferences(path, sp, seq_len, "drop")
    assert dropped.counts == {"pairs_read": 3, "pairs": 1, "dropped_too_long": 2, "truncated": 0,
                              "prompt_turns_dropped": 0}
    assert [(line, pid) for line, pid, _ in dropped.dropped] == [(1, "p0"), (3, "p2")]
    assert all(longest > seq_len for _, _, longest in dropped.dropped)
    # keep_end rescues the long history but never cuts a long response
    kept = tokenize_preferences(path, sp, seq_len, "keep_end")
    assert kept.counts["pairs"] == 2 and kept.counts["truncated"] == 1
    assert [(line, pid) for line, pid, _ in kept.dropped] == [(3, "p2")]
    with pytest.raises(SproutError, match="truncation"):
        PreferenceLoader(path, sp, batch_size=1, seq_len=seq_len, truncation="cut")
    with pytest.raises(SproutError, match="no pair fits"):
        PreferenceLoader(path, sp, batch_size=1, seq_len=8)


def test_eval_pads_every_rank_to_the_same_batches(tmp_path, sp):
    path = write(tmp_path, [pair(i) for i in range(7)])
    seen, counts = [], []
    for r in range(3):
        loader = PreferenceLoader(path, sp, batch_size=2, seq_len=128, rank=r, world_size=3)
        batches = list(loader.eval_batches())
        counts.append([b["pair_mask"].shape[0] for b in batches])
        for b in batches:
            real = b["pair_mask"]
            seen += b["pair_index"][real].tolist()
            pad_rows = torch.cat([~real, ~real])
            assert not b["loss_mask"][pad_rows].any() and (b["response_lengths"][pad_rows] == 0).all()
            assert b["loss_mask"][~pad_rows].any(dim=1).all()
    assert counts == [[2, 1]] * 3  # ceil(7 / 3) = 3 pairs per rank
    assert sorted(seen) == list(range(7))


def test_prompt_tokens_that_differ_between_sides_are_an_error(tmp_path, sp, monkeypatch):
    path = write(tmp_path, [pair(0), pair(1)])
    real_render = preference_tokens.render

    def crafted(messages, tok, add_generation_prompt=False):
        ids, mask = real_render(messages, tok, add_generation_prompt)
        if messages[-1]["content"].startswith("I think it is 3"):  # the rejected side of pair 1
            ids = [ids[0] + 1] + ids[1:]
        return ids, mask

    monkeypatch.setattr(preference_tokens, "render", crafted)
    with pytest.raises(SproutError, match=r"prefs\.jsonl:2: the prompt tokens of the rejected side differ"):
        PreferenceLoader(path, sp, batch_size=1, seq_len=128)
