"""The hf: tokenizer kind: a tokenizer.json read through `tokenizers` encodes and decodes as
transformers' AutoTokenizer does, its byte tables count exactly the bytes decoding gives, it
travels with a run folder, and every bad path is a one-line error naming the file."""

import hashlib
import json
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data_fixtures import make_docs
from sprout.bpb import luts_to_torch, token_bytes
from sprout.checkpoint import bundle_tokenizer, checkpoint_tokenizer, read_meta, save_rotating
from sprout.errors import SproutError
from sprout.model.transformer import ModelConfig, Transformer
from sprout.prep.pretrain import PrepConfig, prepare
from sprout.prep.tokenizer_train import TokenizerTrainConfig, train_from_sources
from sprout.tokenizer import HFTokenizer, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIECES = {
    "words": ["the", "quick", "brown", "fox", "Hello", "world", "don't", "it's", "I'll", "(x)", "a.b,c;", "-->",
              "def f():", "return", "MixedCase", "x=1", "#!", "~"],
    "unicode": ["café", "naïve", "日本語", "中文字", "テスト", "😀", "👍🏽", "🇫🇷", "e\u0301", "a\u0308\u0323",
                "Жили-были", "straße", "\u200b", "\u00a0", "ǅ", "𝔘𝔫𝔦", "عربى", "ﬁ", "Ａ"],
    "space": [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \t \n ", "\n\n\n", "\u3000"],
    "digits": ["0", "7", "42", "2024", "3.14159", "1,000,000", "007", "12345678901234567890"],
    "specials": SPECIALS + ["<think>", "<|im_start|>user\n", "<|im_end|>\n", "<|endoftext|><|endoftext|>"],
}


def random_strings(n: int, seed: int, specials: list[str] | None = None) -> list[str]:
    """`n` seeded strings mixing words, unicode (emoji, CJK, combining marks), whitespace runs,
    digits and special tokens typed as text."""
    rng = random.Random(seed)
    kinds = {k: v for k, v in dict(PIECES, specials=PIECES["specials"] if specials is None else specials).items() if v}
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 14)):
            parts.append(rng.choice(kinds[rng.choice(list(kinds))]))
            if rng.random() < 0.5:
                parts.append(rng.choice(["", " ", "  ", "\n"]))
        out.append("".join(parts))
    return out


def write_bpe(folder: Path, config: dict | None = None, specials=tuple(SPECIALS)) -> Path:
    """A byte-level BPE (GPT-2 style) trained on a few KB of text, saved as `folder`/tokenizer.json
    with a tokenizer_config.json (`config`, when given) beside it; returns `folder`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = make_docs(40, seed=3) + random_strings(100, seed=99, specials=[])
    tk.train_from_iterator(text, trainer)
    tk.add_tokens([AddedToken("<think>", special=False)])  # an added token that is text, not control
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


CONFIG = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
          "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}}  # a token as an object


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_bpe(tmp_path_factory.mktemp("hf") / "tiny_bpe", CONFIG)


@pytest.fixture(scope="module")
def hf(hf_dir):
    return load_tokenizer(f"hf:{hf_dir}")


def assert_matches_transformers(tok, folder: Path, texts: list[str]) -> None:
    """sprout's ids and decode == AutoTokenizer's (add_special_tokens=False); decode round-trips;
    the byte tables count exactly the UTF-8 bytes of the decoded text, special ids excluded."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(folder)
    assert tok.vocab_size == len(ref)
    base, lead, boundary = tok.byte_luts()
    special = set(ref.all_special_ids) | {i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert not lead.any() and set(np.flatnonzero(boundary)) == special
    ids_all = tok.encode_batch(texts)
    for text, ids in zip(texts, ids_all):
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ids == tok.encode(text)
        decoded = tok.decode(ids)
        assert decoded == ref.decode(ids) == text, text
        text_only = ref.decode(ids, skip_special_tokens=True)
        assert int(base[ids].sum()) == len(text_only.encode("utf-8")), text
        if not special & set(ids):
            assert int(base[ids].sum()) == len(text.encode("utf-8"))


# ---------------------------------------------------------------- against transformers


def test_ids_decode_and_byte_tables_match_transformers_on_random_strings(hf, hf_dir):
    texts = random_strings(500, seed=0)
    assert sum(any(s in t for s in SPECIALS) for t in texts) > 100  # specials typed as text are exercised
    assert_matches_transformers(hf, hf_dir, texts + ["", " ", "\n\n", "<|endoftext|>"])


def test_surface_ids_from_the_config(hf, hf_dir):
    tk = hf._tk
    assert hf.vocab_size == tk.get_vocab_size(with_added_tokens=True) == max(tk.get_vocab().values()) + 1
    assert [hf.special_id(p) for p in SPECIALS] == [0, 1, 2]
    assert hf.special_id("<think>") == hf.vocab_size - 1 and hf.special_id("<|user|>") is None
    assert (hf.eot_id, hf.bos_id, hf.pad_id) == (0, 1, 0)  # eot: <|endoftext|> even though eos is <|im_end|>
    assert hf.encode("a<|im_start|>b")[1] == 1  # typed specials are split out, as transformers does
    assert hf.name == "tiny_bpe" and isinstance(hf, HFTokenizer)
    assert hf.fingerprint() == hashlib.sha256((hf_dir / "tokenizer.json").read_bytes()).hexdigest()
    same = load_tokenizer(f"hf:{hf_dir / 'tokenizer.json'}")  # the file itself names the same tokenizer
    assert (same.fingerprint(), same.bos_id, same.encode("Hello world")) == (hf.fingerprint(), 1, hf.encode("Hello world"))
    docs = ["Hello world", "café 😀", ""]
    flat, lengths = hf.encode_docs(docs)
    assert flat.tolist() == [i for d in docs for i in hf.encode(d) + [0]]
    assert lengths.tolist() == [len(hf.encode(d)) + 1 for d in docs]
    assert pickle.loads(pickle.dumps(hf)).encode("the quick fox") == hf.encode("the quick fox")


def test_byte_tables_exact_over_a_pretraining_stream(hf):
    docs = make_docs(30, seed=8) + [t for t in random_strings(200, seed=4, specials=[]) if t]
    flat, _ = hf.encode_docs(docs)
    ids = torch.from_numpy(np.concatenate([[hf.eot_id], flat]).astype(np.int64))
    covered = int(token_bytes(ids[:-1], ids[1:], luts_to_torch(hf.byte_luts())).sum())
    assert covered == sum(len(d.encode("utf-8")) for d in docs)


def test_eot_rule_and_config_layouts(tmp_path):
    no_eot = write_bpe(tmp_path / "chatml", {"eos_token": "<|im_end|>"}, specials=("<|im_start|>", "<|im_end|>"))
    tok = load_tokenizer(f"hf:{no_eot}")
    assert (tok.eot_id, tok.bos_id, tok.pad_id) == (1, None, None)  # no <|endoftext|>: the config's eos
    (no_eot / "tokenizer_config.json").unlink()
    with pytest.raises(SproutError, match=r"chatml/tokenizer.json: no special <\|endoftext\|> token and no eos_token"):
        load_tokenizer(f"hf:{no_eot}")
    bare = write_bpe(tmp_path / "bare")  # no config at all: <|endoftext|> is eot, no bos or pad
    assert (load_tokenizer(f"hf:{bare}").eot_id, load_tokenizer(f"hf:{bare}").bos_id) == (0, None)
    # special_tokens_map.json overrides the config only when the config has no added_tokens_decoder
    (bare / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_end|>"}))
    token_map = {"bos_token": {"content": "<|im_start|>"}, "pad_token": "<|im_end|>"}
    (bare / "special_tokens_map.json").write_text(json.dumps(token_map))
    assert (load_tokenizer(f"hf:{bare}").bos_id, load_tokenizer(f"hf:{bare}").pad_id) == (1, 2)
    (bare / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_end|>", "added_tokens_decoder": {}}))
    assert (load_tokenizer(f"hf:{bare}").bos_id, load_tokenizer(f"hf:{bare}").pad_id) == (2, None)


def test_non_byte_level_tokenizer_refuses_byte_tables(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.train_from_iterator(make_docs(20), trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"],
                                                              show_progress=False))
    (tmp_path / "sp_style").mkdir()
    tk.save(str(tmp_path / "sp_style" / "tokenizer.json"))
    tok = load_tokenizer(f"hf:{tmp_path / 'sp_style'}")
    assert tok.decode(tok.encode("Once upon a time")) == "Once upon a time"
    with pytest.raises(SproutError, match=r"sp_style/tokenizer.json: bits per byte needs a byte-level tokenizer "
                                          r"\(decoder ByteLevel\), this one decodes with Metaspace"):
        tok.byte_luts()


# ---------------------------------------------------------------- errors


def test_bad_paths_and_files_are_one_line_errors(hf_dir, tmp_path):
    cases = []
    with pytest.raises(SproutError, match=r"nowhere/tokenizer.json: Hugging Face tokenizer not found \(no such folder") as e:
        load_tokenizer(f"hf:{tmp_path / 'nowhere'}")
    cases.append(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SproutError, match=r"empty/tokenizer.json: Hugging Face tokenizer not found "
                                          r"\(no tokenizer.json there") as e:
        load_tokenizer(f"hf:{tmp_path / 'empty'}")
    cases.append(e)
    bad = tmp_path / "bad"
    bad.mkdir()
    for content in (b'{"version": "1.0", "model": {', b"\xff\xfe not text", b'{"version": "1.0"}'):
        (bad / "tokenizer.json").write_bytes(content)
        with pytest.raises(SproutError, match=r"bad/tokenizer.json: not a valid tokenizer.json \(") as e:
            load_tokenizer(f"hf:{bad}")
        cases.append(e)
    broken = tmp_path / "broken_config"
    shutil.copytree(hf_dir, broken)
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(SproutError, match=r"broken_config/tokenizer_config.json: cannot read") as e:
        load_tokenizer(f"hf:{broken}")
    cases.append(e)
    (broken / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nothing|>"}))
    with pytest.raises(SproutError, match=r"broken_config: eos_token '<\|nothing\|>' of tokenizer_config.json "
                                          r"is not a token") as e:
        load_tokenizer(f"hf:{broken}")
    cases.append(e)
    with pytest.raises(SproutError, match="expected tiktoken:NAME, sentencepiece:PATH.model or hf:PATH") as e:
        load_tokenizer("hf:")
    cases.append(e)
    with pytest.raises(SproutError, match="only SentencePiece models are trained here") as e:
        train_from_sources(TokenizerTrainConfig(sources=["x.txt"], out=f"hf:{tmp_path / 'new'}"))
    cases.append(e)
    assert all("\n" not in str(e.value) for e in cases)


# ---------------------------------------------------------------- run folders and prep


def test_bundled_in_a_run_folder_and_reloaded_from_there(hf, hf_dir, tmp_path, monkeypatch):
    src = tmp_path / "work" / "tok"
    shutil.copytree(hf_dir, src)
    monkeypatch.chdir(tmp_path / "work")
    spec = "hf:tok"  # relative to the directory the run started in
    fields = bundle_tokenizer(spec, tmp_path / "run")
    digest = hashlib.sha256((hf_dir / "tokenizer_config.json").read_bytes()).hexdigest()
    assert fields == {"tokenizer_file": "tokenizer/tok/tokenizer.json", "tokenizer_sha256": hf.fingerprint(),
                      "tokenizer_side_sha256": {"tokenizer_config.json": digest}}
    assert bundle_tokenizer(spec, tmp_path / "run") == fields  # a resume: the same files, kept
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=hf.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    meta = {"model_config": model.config, "tokenizer": spec, "tokenizer_fingerprint": hf.fingerprint(), **fields}
    save_rotating(tmp_path / "run" / "checkpoints", 1, model, meta=meta)
    shutil.move(tmp_path / "run", tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    assert bundle_tokenizer(spec, tmp_path / "moved") == fields  # spec gone from here: the run's copy stands in
    tok = checkpoint_tokenizer(read_meta(tmp_path / "moved"))
    assert tok.spec == f"hf:{tmp_path / 'moved' / 'tokenizer' / 'tok' / 'tokenizer.json'}"
    assert (tok.fingerprint(), tok.bos_id, tok.pad_id, tok.eot_id) == (hf.fingerprint(), 1, 0, 0)
    (tmp_path / "moved" / "tokenizer" / "tok" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_end|>"}))
    with pytest.raises(SproutError, match=r"moved/tokenizer/tok/tokenizer_config.json: sha256 does not match "
                                          r"tokenizer_side_sha256 in .*meta.json"):
        checkpoint_tokenizer(read_meta(tmp_path / "moved"))
    with pytest.raises(SproutError, match=r"moved/tokenizer/tok/tokenizer.json: this run folder already holds a "
                                          r"different tokenizer"):
        bundle_tokenizer(f"hf:{src}", tmp_path / "moved")  # the same tokenizer.json, another config


def test_prep_with_an_hf_tokenizer_one_and_two_workers(hf, hf_dir, tmp_path, monkeypatch):
    corpus = tmp_path / "docs.txt"
    docs = make_docs(60, seed=11) + ["Café naïve 日本語 😀 tab\there"]
    corpus.write_text("\n<|endoftext|>\n".join(docs) + "\n")
    shutil.copytree(hf_dir, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)  # a relative spec: workers get it by absolute path
    outs = []
    for workers in (1, 2):
        cfg = PrepConfig(name="t", sources=[str(corpus)], tokenizer="hf:tok", out=f"w{workers}", workers=workers,
                         val_frac=0.1, run_tokens=2_000)
        outs.append(prepare(cfg, progress=False, log=lambda s: None))
    assert outs[0]["tokenizer"]["fingerprint"] == hf.fingerprint() and outs[0]["token_dtype"] == "uint16"
    shards = sorted(p.name for p in (tmp_path / "w1").iterdir() if p.suffix == ".bin")
    assert shards and all((tmp_path / "w1" / n).read_bytes() == (tmp_path / "w2" / n).read_bytes() for n in shards)


# ---------------------------------------------------------------- a published tokenizer


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_tokenizer_from_the_mirror_gguf(mirror, tmp_path):
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, 49,152 ids, ChatML specials), rebuilt by
    transformers from the mirror's GGUF and saved as a tokenizer.json folder."""
    pytest.importorskip("gguf", reason="the gguf package (extra sprout[import]) reads the GGUF's tokenizer")
    from transformers import AutoTokenizer

    gguf = mirror / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path / "smollm2")
    tok = load_tokenizer(f"hf:{tmp_path / 'smollm2'}")
    assert (tok.vocab_size, tok.eot_id, tok.bos_id, tok.pad_id) == (49152, 0, 1, 2)
    assert [tok.special_id(p) for p in SPECIALS] == [0, 1, 2]
    assert_matches_transformers(tok, tmp_path / "smollm2", random_strings(500, seed=1))
