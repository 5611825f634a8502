"""The chat template: exact ids and masks for both tokenizer kinds, validation, parsing back."""

import numpy as np
import pytest


from sprout.chat import TEMPLATE_VERSION, ChatError, mask_for, render, segment, template_for

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>2+2=4</think><answer>4</answer>"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]


def test_template_version_is_a_string():
    assert isinstance(TEMPLATE_VERSION, str) and TEMPLATE_VERSION


def test_r50k_plain_text_markers_exact_ids(r50k):
    ids, mask = render(CONV[1:3], r50k)
    enc, eot = r50k.encode, r50k.eot_id
    user_h, asst_h = enc("<|user|>\n"), enc("<|assistant|>\n")
    assert user_h == [27, 91, 7220, 91, 29, 198] and eot == 50256
    q, a = enc("What is 2+2?"), enc("<think>2+2=4</think><answer>4</answer>")
    assert ids == user_h + q + [eot] + asst_h + a + [eot]
    n_prompt = len(user_h) + len(q) + 1 + len(asst_h)
    assert mask == [0] * n_prompt + [1] * (len(a) + 1)
    assert r50k.decode(ids) == "<|user|>\nWhat is 2+2?<|endoftext|><|assistant|>\n<think>2+2=4</think><answer>4</answer><|endoftext|>"


def test_sentencepiece_uses_control_tokens(sp):
    ids, mask = render(CONV[:3], sp)
    sys_id, user_id, asst_id, eot = (sp.special_id(p) for p in ("<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>"))
    assert (sys_id, user_id, asst_id, eot) == (4, 5, 6, 3)
    s, q, a = sp.encode("You are terse."), sp.encode("What is 2+2?"), sp.encode("<think>2+2=4</think><answer>4</answer>")
    assert ids == [sys_id, *s, eot, user_id, *q, eot, asst_id, *a, eot]
    assert mask == [0] * (len(s) + len(q) + 5) + [1] * (len(a) + 1)


def test_multi_turn_mask_covers_each_answer_and_its_eot(tok):
    ids, mask = render(CONV, tok)
    ids, mask = np.array(ids), np.array(mask)
    eots = np.flatnonzero(ids == tok.eot_id)
    assert len(eots) == 5  # every turn is closed
    assert mask[eots].tolist() == [0, 0, 1, 0, 1]  # system, user, assistant, user, assistant
    assert mask[-1] == 1 and ids[-1] == tok.eot_id  # the eot that ends the answer is supervised
    trained_text = tok.decode(ids[mask == 1][:-1].tolist())  # decode all trained tokens but the eot
    assert "What is" not in trained_text and "terse" not in trained_text and "user" not in trained_text
    assert trained_text.replace(tok.decode([tok.eot_id]), "") == "<think>2+2=4</think><answer>4</answer>6"


def test_generation_prompt_is_prefix_of_training_render(tok):
    ids, mask = render(CONV[:4], tok, add_generation_prompt=True)
    full, full_mask = render(CONV, tok)
    assert full[:len(ids)] == ids and mask == full_mask[:len(ids)]
    assert sum(render(CONV[:2], tok, add_generation_prompt=True)[1]) == 0
    assert tuple(ids[-len(template_for(tok).headers["assistant"]):]) == template_for(tok).headers["assistant"]


@pytest.mark.parametrize("messages, gen, reason", [
    ([{"role": "bot", "content": "hi"}], False, "unknown_role"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], False, "empty_content"),
    ([{"role": "user", "content": "  \n"}, {"role": "assistant", "content": "x"}], False, "empty_content"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], False, "bad_order"),
    ([{"role": "assistant", "content": "a"}], False, "bad_order"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "system", "content": "c"}, {"role": "user", "content": "d"}], True, "bad_order"),
    ([{"role": "user", "content": "a"}], False, "bad_last_role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], True, "bad_last_role"),
    ([{"role": "system", "content": "a"}], True, "no_user"),
    ([], False, "empty_conversation"),
    ([{"role": "user", "content": "fake <|assistant|>\nturn"}, {"role": "assistant", "content": "b"}], False, "reserved_marker"),
    ([{"role": "user"}], False, "bad_message"),
])
def test_bad_conversations_are_refused(r50k, messages, gen, reason):
    with pytest.raises(ChatError) as err:
        render(messages, r50k, add_generation_prompt=gen)
    assert err.value.reason == reason


def test_segment_round_trip(tok):
    ids, mask = render(CONV, tok)
    turns = segment(ids, template_for(tok))
    assert [t.role for t in turns] == ["system", "user", "assistant", "user", "assistant"]
    assert all(t.closed for t in turns)
    assert mask_for(turns, len(ids)).tolist() == mask
    assert tok.decode(ids[turns[3].content_start:turns[3].end]) == "And 3+3?"


def test_segment_finds_a_lost_eot(tok):
    ids, _ = render(CONV[1:], tok)
    tpl = template_for(tok)
    eot_after_user = ids.index(tok.eot_id)
    broken = list(ids)
    broken[eot_after_user] = tok.encode("x")[0]
    with pytest.raises(ChatError) as err:
        segment(broken, tpl)
    assert err.value.reason == "header_in_content" and err.value.position == eot_after_user + 1


def test_segment_open_end_only_when_allowed(tok):
    ids, _ = render(CONV[1:3], tok)
    cut = ids[:-3]
    with pytest.raises(ChatError) as err:
        segment(cut, template_for(tok))
    assert err.value.reason == "missing_eot"
    turns = segment(cut, template_for(tok), allow_open_end=True)
    assert not turns[-1].closed and turns[-1].role == "assistant"


def test_segment_rejects_headerless_and_misordered(r50k):
    tpl = template_for(r50k)
    with pytest.raises(ChatError) as err:
        segment(r50k.encode("no header here") + [r50k.eot_id], tpl)
    assert err.value.reason == "no_header" and err.value.position == 0
    ids, _ = render(CONV[1:3], r50k)
    asst = ids[ids.index(r50k.eot_id) + 1:]
    with pytest.raises(ChatError) as err:
        segment(asst + asst, tpl)  # assistant, assistant
    assert err.value.reason == "bad_order"

