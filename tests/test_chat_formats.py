"""Chat formats (`sprout.chat_formats`) and their detection from a Jinja template (`sprout.chat_detect`).

chatml and llama3 need a tokenizer with their special tokens: a small byte-level BPE is
trained here with the `tokenizers` library and wrapped to sprout's tokenizer surface
(`BPETokenizer`); transformers' `apply_chat_template` on the same BPE is the reference."""

import dataclasses
import json

import numpy as np
import pytest

from sprout.chat import TEMPLATE_VERSION, ChatError, mask_for, render, segment, template_for
from sprout.chat_detect import detect_chat_format, detection_cases
from sprout.chat_formats import (CHATML, LLAMA3, QWEN25_SYSTEM, SMOLLM2_SYSTEM, SPROUT, ChatFormat,
                                 check_trained_format, format_for, write_chat_format)
from sprout.errors import SproutError
from sprout.formats.maskcheck_sft import check_arrays
from sprout.formats.maskcheck_pairs import check_preferences, format_pair, pair_violations
from sprout.formats.preference_tokens import render_pair
from sprout.formats.preference_pairs import write_preferences
from sprout.formats.maskcheck_prompts import RenderedPrompt, check_prompts, prompt_violations
from sprout.formats.prompts import write_prompts
from sprout.prep.packing import pack

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

SMOLLM2 = (r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
           r"system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN25 = (r"{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
          r"'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
          r"helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if not (loop.first and "
          r"message.role == 'system') %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + "
          r"'\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
PLAIN_CHATML = (r"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                r"'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_TEMPLATE = (r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   r"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                   r"'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   r"{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
                   r"<|end_header_id|>\n\n' }}{% endif %}")
NO_NEWLINE_CHATML = PLAIN_CHATML.replace("'<|im_end|>' + '\\n'", "'<|im_end|>'")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "<answer>4</answer>"},
     {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "It is 6."},
     {"role": "user", "content": "Thank you"}, {"role": "assistant", "content": "Any time."}],
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "How many legs has a cat?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "A bird?"},
     {"role": "assistant", "content": "Two, usually.\nSometimes one."}],
]
CHATML_KW = {"eos": "<|im_end|>"}
LLAMA3_KW = {"eos": "<|eot_id|>", "bos": "<|begin_of_text|>"}


def prefixes():
    """(messages, add_generation_prompt) for every prefix of CONVERSATIONS that ends a turn."""
    for conv in CONVERSATIONS:
        first = 1 if conv[0]["role"] == "system" else 0
        for n in range(first + 1, len(conv) + 1):
            yield conv[:n], conv[n - 1]["role"] == "user"


class BPETokenizer:
    """A `tokenizers` byte-level BPE with sprout's tokenizer surface: `encode` treats special
    token text as plain text (as sprout's kinds do), `special_id` finds the special tokens."""

    def __init__(self, json_str: str, eos: str, bos: str | None = None, chat_format=None, spec="test-bpe:"):
        from tokenizers import Tokenizer

        self.json_str = json_str
        self._tk = Tokenizer.from_str(json_str)
        self._tk.encode_special_tokens = True
        self._special = {t.content: i for i, t in self._tk.get_added_tokens_decoder().items()}
        self.spec, self.name, self.vocab_size = spec, "test-bpe", self._tk.get_vocab_size()
        self.eos_token, self.bos_token = eos, bos
        self.eot_id, self.bos_id, self.pad_id = self._special[eos], self._special.get(bos), None
        if chat_format is not None:
            self.chat_format = chat_format

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def special_id(self, piece: str):
        return self._special.get(piece)


def train_bpe(pattern: str | None) -> str:
    """tokenizer.json of a 700-id byte-level BPE: GPT-2's split (SmolLM2's) when `pattern` is
    None, else a split by `pattern` (Llama 3's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pattern is None)
    tk.pre_tokenizer = byte_level if pattern is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    tk.decoder = decoders.ByteLevel()
    corpus = [m["content"] for conv in CONVERSATIONS for m in conv] + [SMOLLM2_SYSTEM, QWEN25_SYSTEM]
    corpus += ["system\nuser\nassistant\n\n", "The quick brown fox jumps over the lazy dog. 0123456789"] * 5
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus * 20, trainer)
    return tk.to_str()


@pytest.fixture(scope="module")
def gpt2_bpe():
    return train_bpe(None)


@pytest.fixture(scope="module")
def llama3_bpe():
    return train_bpe(LLAMA3_PAT)


def hf_ids(json_str, template, messages, gen, eos, bos=None) -> list[int]:
    """transformers' `apply_chat_template(tokenize=True)` ids on the same BPE."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json_str), eos_token=eos, bos_token=bos)
    out = hf.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=gen)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---- detection ---------------------------------------------------------------------------
def test_detection_renders_at_least_twenty_conversations():
    cases = detection_cases()
    assert len(cases) >= 20
    assert any(gen for _, gen in cases) and any(not gen for _, gen in cases)
    assert any(m[0]["role"] == "system" for m, _ in cases) and any(m[0]["role"] != "system" for m, _ in cases)


@pytest.mark.parametrize("template, want", [(SMOLLM2, CHATML.with_system(SMOLLM2_SYSTEM)),
                                            (QWEN25, CHATML.with_system(QWEN25_SYSTEM)),
                                            (PLAIN_CHATML, CHATML)])
def test_detects_chatml_with_the_templates_default_system(gpt2_bpe, template, want):
    fmt = detect_chat_format(template, BPETokenizer(gpt2_bpe, **CHATML_KW))
    assert fmt == want and fmt.name == "chatml"
    assert fmt.version == "chatml-v1" if want.default_system is None else fmt.version.startswith("chatml-v1+system-")


def test_detects_llama3(llama3_bpe):
    assert detect_chat_format(LLAMA3_TEMPLATE, BPETokenizer(llama3_bpe, **LLAMA3_KW)) == LLAMA3


def test_detects_sprout_from_the_exported_template(tok):
    from sprout.model.export_tokenizer import chat_template

    assert detect_chat_format(chat_template(tok), tok, eos_token="<|endoftext|>") == SPROUT


def test_a_template_of_no_format_is_refused_naming_the_first_differing_token(gpt2_bpe):
    tok = BPETokenizer(gpt2_bpe, **CHATML_KW)
    with pytest.raises(SproutError) as err:
        detect_chat_format(NO_NEWLINE_CHATML, tok)
    message = str(err.value)
    # conversation 0 is one user question with the generation prompt: after its <|im_end|> the
    # template opens the next header where chatml writes its newline
    messages, gen = detection_cases()[0]
    ids, _ = render(messages, BPETokenizer(gpt2_bpe, chat_format=CHATML, **CHATML_KW), gen)
    p = ids.index(tok.special_id("<|im_end|>")) + 1
    newline = tok.encode("\n")[0]
    assert "\n" not in message and "closest chatml" in message
    assert (f"conversation 0 (1 message, generation prompt) position {p}: expected "
            f"{tok.special_id('<|im_start|>')} ('<|im_start|>') from the template, got {newline} ('\\n') from chatml"
            in message)


# ---- rendering: ids as transformers gives them, masks, parsing back -----------------------------
CASES = [("smollm2", SMOLLM2, CHATML.with_system(SMOLLM2_SYSTEM), CHATML_KW),
         ("chatml", PLAIN_CHATML, CHATML, CHATML_KW),
         ("llama3", LLAMA3_TEMPLATE, LLAMA3, LLAMA3_KW)]


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def case(request, gpt2_bpe, llama3_bpe):
    name, template, fmt, kw = request.param
    json_str = llama3_bpe if fmt.name == "llama3" else gpt2_bpe
    return template, BPETokenizer(json_str, chat_format=fmt, **kw), kw


def test_render_equals_apply_chat_template_on_every_prefix(case):
    template, tok, kw = case
    for messages, gen in prefixes():
        assert render(messages, tok, gen)[0] == hf_ids(tok.json_str, template, messages, gen, **kw), (messages, gen)
    # a prefix ending on an answer, continued with the generation prompt by hand, is the next prompt's start
    ids, _ = render(CONVERSATIONS[0][:2], tok)
    assert render(CONVERSATIONS[0][:3], tok, add_generation_prompt=True)[0][:len(ids)] == ids


def test_mask_covers_exactly_assistant_content_and_end_of_turn(case):
    _, tok, _ = case
    tpl = template_for(tok)
    for conv in CONVERSATIONS:
        ids, mask = render(conv, tok)
        ids, mask = np.asarray(ids), np.asarray(mask)
        want = np.zeros(len(ids), dtype=int)
        answers = [m["content"] for m in conv if m["role"] == "assistant"]
        at = 0
        for answer in answers:  # each answer's tokens sit right after an assistant header
            a = tok.encode(answer)
            header = tpl.headers["assistant"]
            while tuple(ids[at:at + len(header)]) != header:
                at += 1
            start = at + len(header)
            assert ids[start:start + len(a)].tolist() == a and ids[start + len(a)] == tpl.eot_id
            want[start:start + len(a) + 1] = 1
            at = start
        assert mask.tolist() == want.tolist()
        trained = ids[mask == 1]
        assert (trained == tpl.eot_id).sum() == len(answers) and trained[-1] == tpl.eot_id
        if tpl.bos:
            assert ids[0] == tpl.bos[0] and mask[0] == 0
        if tpl.after_eot:
            after = np.flatnonzero(ids == tpl.eot_id) + 1
            assert (mask[after] == 0).all() and (ids[after] == tpl.after_eot[0]).all()


def test_segment_round_trip(case):
    _, tok, _ = case
    tpl = template_for(tok)
    fmt = tpl.format
    for conv in CONVERSATIONS:
        ids, mask = render(conv, tok)
        turns = segment(ids, tpl)
        full = fmt.with_default_system(conv)
        assert [t.role for t in turns] == [m["role"] for m in full]
        assert [tok.decode(ids[t.content_start:t.end]) for t in turns] == [m["content"] for m in full]
        assert mask_for(turns, len(ids)).tolist() == mask
        cut = ids[:-1] if tpl.after_eot else ids  # the untrained text after the last eot may be cut
        assert mask_for(segment(cut, tpl), len(cut)).tolist() == mask[:len(cut)]


def test_segment_names_a_missing_bos_and_wrong_text_after_the_end_of_turn(case):
    _, tok, _ = case
    tpl = template_for(tok)
    ids, _ = render(CONVERSATIONS[1], tok)
    if tpl.bos:
        with pytest.raises(ChatError) as err:
            segment(ids[1:], tpl)
        assert err.value.reason == "no_bos" and err.value.position == 0
    if tpl.after_eot:
        broken = list(ids)
        p = broken.index(tpl.eot_id) + 1
        broken[p] = tok.encode("x")[0]
        with pytest.raises(ChatError) as err:
            segment(broken, tpl)
        assert err.value.reason == "bad_after_eot" and err.value.position == p


def test_content_holding_the_formats_special_pieces_is_refused(case):
    _, tok, _ = case
    piece = template_for(tok).format.reserved[0]
    with pytest.raises(ChatError) as err:
        render([{"role": "user", "content": f"a {piece} b"}, {"role": "assistant", "content": "c"}], tok)
    assert err.value.reason == "reserved_marker"


# ---- the loss-mask checkers ----------------------------------------------------------------------
def sft_arrays(tok, seq_len=64, overlong="truncate"):
    pad = tok.eot_id
    examples = [render(conv[:n], tok) for conv in CONVERSATIONS for n in range(2, len(conv) + 1)
                if conv[n - 1]["role"] == "assistant"]
    packed = pack(examples, seq_len, pad, overlong)
    arrays = {"tokens": packed.tokens, "loss_mask": packed.loss_mask, "segment_ids": packed.segment_ids,
              "position_ids": packed.position_ids}
    return arrays, pad, packed.counts


def test_row_checker_passes_good_rows_and_flags_bad_ones(case):
    _, tok, _ = case
    tpl = template_for(tok)
    for seq_len in (160, 40):  # whole documents; then answers truncated, some inside an answer
        arrays, pad, counts = sft_arrays(tok, seq_len)
        report = check_arrays(arrays, tpl, pad, tok.vocab_size, counts["truncated_open"])
        assert [str(v) for v in report.violations] == [] and report.docs == counts["examples_packed"]
    arrays, pad, counts = sft_arrays(tok, 160)
    tokens, mask = arrays["tokens"], arrays["loss_mask"]
    r, eot = 0, int(np.flatnonzero((tokens[0] == tpl.eot_id) & (mask[0] == 1))[0])
    bad = {k: v.copy() for k, v in arrays.items()}
    bad["loss_mask"][r, eot] = 0
    assert "end-of-turn token not supervised" in str(check_arrays(bad, tpl, pad, tok.vocab_size).violations[0])
    if tpl.after_eot:
        bad = {k: v.copy() for k, v in arrays.items()}
        bad["loss_mask"][r, eot + 1] = 1
        found = str(check_arrays(bad, tpl, pad, tok.vocab_size).violations[0])
        assert f"row 0 position {eot + 1}: loss_mask 1 on the text after the end-of-turn token of assistant" in found
    if tpl.bos:
        second = int(np.flatnonzero(np.diff(arrays["segment_ids"][r].astype(int)) == 1)[0]) + 1
        bad = {k: v.copy() for k, v in arrays.items()}
        bad["tokens"][r, second] = tok.encode("x")[0]
        found = str(check_arrays(bad, tpl, pad, tok.vocab_size).violations[0])
        assert found == f"row 0 position {second}: sequence does not start with the BOS token"


def test_pair_and_prompt_checkers_in_every_format(case, tmp_path):
    _, tok, _ = case
    tpl = template_for(tok)
    records = [{"id": f"p{i}", "source": "t", "prompt": conv[:-1], "chosen": [conv[-1]],
                "rejected": [{"role": "assistant", "content": "I do not know."}]}
               for i, conv in enumerate(CONVERSATIONS)]
    write_preferences(tmp_path / "prefs.jsonl", records)
    report = check_preferences(tmp_path / "prefs.jsonl", tok, tpl, 200, show=2)
    assert [str(v) for v in report.violations] == [] and report.pairs_checked == 2
    shown = format_pair(report.shown[0], tpl, tok, color=False)
    assert f"[[{CONVERSATIONS[0][-1]['content']}]][[{tpl.format.eot}]]" in shown
    pair = render_pair(records[1], tok)
    assert pair.chosen[-1] == tpl.eot_id  # a side ends with the eot closing its response
    shifted = dataclasses.replace(pair, chosen_mask=np.r_[pair.chosen_mask[1:], 0].astype(np.uint8))
    assert "mask 1 on the assistant header" in str(pair_violations(shifted, records[1], tok, tpl, 200)[0])

    prompts = [{"id": f"q{i}", "source": "t", "prompt": conv[:-1], "gold": "4", "level": None}
               for i, conv in enumerate(CONVERSATIONS)]
    write_prompts(tmp_path / "prompts.jsonl", prompts)
    report = check_prompts(tmp_path / "prompts.jsonl", tok, tpl, show=2)
    assert report.violations == [] and report.prompts == 2
    item = report.shown[1]
    cut = RenderedPrompt(item.line, item.record, item.ids[:-1])
    assert "does not end with the assistant header" in prompt_violations(cut, tok, tpl)[0]


# ---- where the format comes from, and where it is recorded ------------------------------------------
def test_format_from_chat_format_json_beside_the_tokenizer(gpt2_bpe, tmp_path):
    fmt = CHATML.with_system(SMOLLM2_SYSTEM)
    write_chat_format(tmp_path, fmt)
    tok = BPETokenizer(gpt2_bpe, spec=f"hf:{tmp_path}", **CHATML_KW)
    assert format_for(tok) == fmt and template_for(tok).format == fmt
    assert ChatFormat.from_json(json.loads((tmp_path / "chat_format.json").read_text())) == fmt
    assert ChatFormat.from_json({"name": "chatml", "default_system": SMOLLM2_SYSTEM}) == fmt
    assert format_for(BPETokenizer(gpt2_bpe, spec=f"hf:{tmp_path / 'tokenizer.json'}", **CHATML_KW)) == fmt
    (tmp_path / "other").mkdir()
    assert format_for(BPETokenizer(gpt2_bpe, spec=f"hf:{tmp_path / 'other'}", **CHATML_KW)) == SPROUT


def test_sprout_records_what_it_always_recorded(tok):
    assert TEMPLATE_VERSION == SPROUT.version == "sprout-chat-v1" and format_for(tok) == SPROUT
    assert set(template_for(tok).to_json()) == {"version", "kind", "eot_id", "headers"}


def test_data_made_in_another_format_is_refused_in_one_line(gpt2_bpe, tok, tmp_path):
    from sprout.prep.held_out import HeldOut
    from sprout.stages.sft import check_sft_data

    chatml = template_for(BPETokenizer(gpt2_bpe, chat_format=CHATML.with_system(SMOLLM2_SYSTEM), **CHATML_KW))
    record = chatml.to_json()
    assert record["version"] == chatml.version and record["format"]["default_system"] == SMOLLM2_SYSTEM
    with pytest.raises(SproutError) as err:
        check_trained_format(chatml.version, format_for(tok), "ckpt/meta.json")
    assert "\n" not in str(err.value) and chatml.version in str(err.value) and "sprout-chat-v1" in str(err.value)
    attrs = {"tokenizer_fingerprint": "f", "template_version": chatml.version, "seq_len": 64, "vocab_size": 700,
             "held_out": HeldOut().record()}
    with pytest.raises(SproutError, match="rendered with chat template 'chatml-v1\\+system-"):
        check_sft_data({"path": str(tmp_path)}, None, tmp_path / "sft.h5", attrs, tmp_path / "sft_val.h5", attrs,
                       SPROUT)
