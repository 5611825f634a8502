import hashlib
import pickle
import shutil

import numpy as np
import pytest
import torch

from data_fixtures import make_docs, train_tiny_sp
from sprout.bpb import bits_per_byte, luts_to_torch, token_bytes
from sprout.errors import SproutError
from sprout.prep.sources import SourceSpec, iter_documents
from sprout.prep.tokenizer_train import SPECIAL_PIECES, train_sentencepiece
from sprout.tokenizer import R50K_SHA256, load_tokenizer

TRICKY = ["Hello world", "  two leading spaces", "trailing space ", "tab\there\r\nCRLF\n\n\nblank lines",
          "Café naïve 日本語 ✓ 😀", "a  b   c", "<|endoftext|> and <|user|> typed as text", "12345 + 678 = 13023", ""]


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    return train_tiny_sp(tmp_path_factory.mktemp("sp"))


@pytest.fixture()
def offline_mirror(mirror, tmp_path, monkeypatch):
    """A mirror folder holding only tokenizers/gpt2.tiktoken; any network access fails."""
    root = tmp_path / "mirror"
    (root / "tokenizers").mkdir(parents=True)
    shutil.copy(mirror / "tokenizers" / "gpt2.tiktoken", root / "tokenizers" / "gpt2.tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("SPROUT_MIRROR", "")  # no mirror at all: not even ../shared/data

    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    import requests

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setattr(requests.Session, "request", no_network)
    return root


# ---------------------------------------------------------------- tiktoken


def test_offline_tiktoken_from_mirror_folder(offline_mirror):
    for spec in ("tiktoken:r50k_base", "tiktoken:gpt2"):
        tok = load_tokenizer(spec, mirror=str(offline_mirror))
        assert tok.encode("Hello world") == [15496, 995]
        assert (tok.vocab_size, tok.eot_id, tok.bos_id, tok.pad_id) == (50257, 50256, None, None)
        assert tok.fingerprint() == R50K_SHA256
        assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_mirror_from_environment(offline_mirror, monkeypatch):
    monkeypatch.setenv("SPROUT_MIRROR", str(offline_mirror))
    assert load_tokenizer("tiktoken:r50k_base").encode("Hello") == [15496]


def test_fingerprint_is_the_ranks_file_hash_however_loaded(offline_mirror, tmp_path, monkeypatch):
    # tiktoken's own cache route (no mirror): the fingerprint is rebuilt from the ranks
    cache = tmp_path / "cache"
    cache.mkdir()
    url_sha1 = hashlib.sha1(b"https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken").hexdigest()
    shutil.copy(offline_mirror / "tokenizers" / "gpt2.tiktoken", cache / url_sha1)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    tok = load_tokenizer("tiktoken:r50k_base")
    assert tok.ranks_file is None
    assert tok.fingerprint() == R50K_SHA256


def test_corrupted_or_missing_mirror_file_names_it(offline_mirror):
    path = offline_mirror / "tokenizers" / "gpt2.tiktoken"
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(SproutError, match="gpt2.tiktoken.*corrupted"):
        load_tokenizer("tiktoken:r50k_base", mirror=str(offline_mirror))
    path.unlink()
    with pytest.raises(SproutError, match="gpt2.tiktoken"):
        load_tokenizer("tiktoken:r50k_base", mirror=str(offline_mirror))


def test_tiktoken_ignores_special_strings_and_encode_docs(offline_mirror):
    tok = load_tokenizer("tiktoken:r50k_base", mirror=str(offline_mirror))
    assert tok.eot_id not in tok.encode("a <|endoftext|> b")
    assert tok.special_id("<|endoftext|>") == 50256 and tok.special_id("<|user|>") is None
    flat, lengths = tok.encode_docs(TRICKY)
    expected = [i for t in TRICKY for i in tok.encode(t) + [tok.eot_id]]
    assert flat.tolist() == expected and lengths.tolist() == [len(tok.encode(t)) + 1 for t in TRICKY]
    assert tok.encode_batch(TRICKY) == [tok.encode(t) for t in TRICKY]
    assert pickle.loads(pickle.dumps(tok)).encode("Hello world") == [15496, 995]


def test_bad_specs_are_one_line_errors(tmp_path):
    with pytest.raises(SproutError, match="expected tiktoken:NAME"):
        load_tokenizer("r50k_base")
    with pytest.raises(SproutError, match="unknown tiktoken encoding"):
        load_tokenizer("tiktoken:cl100k_base")
    with pytest.raises(SproutError, match="missing.model"):
        load_tokenizer(f"sentencepiece:{tmp_path}/missing.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(SproutError, match="bad.model: not a valid SentencePiece model"):
        load_tokenizer(f"sentencepiece:{bad}")


# ---------------------------------------------------------------- SentencePiece


def test_trained_sentencepiece_specials_and_vocab(sp):
    assert sp.vocab_size == 400
    assert [sp._sp.id_to_piece(i) for i in range(7)] == list(SPECIAL_PIECES)
    assert (sp.pad_id, sp.bos_id, sp.eot_id) == (0, 2, 3)
    assert [sp.special_id(p) for p in ("<|system|>", "<|user|>", "<|assistant|>")] == [4, 5, 6]
    assert sp.special_id("<|nothing|>") is None
    ids = sp.encode("<|user|> hi <|endoftext|>")  # typed specials stay text
    assert not set(ids) & set(range(7))
    assert sp.name == "tiny" and len(sp.fingerprint()) == 64
    assert (sp.path.with_suffix(".vocab")).is_file()


def test_sentencepiece_round_trip_and_concatenation(sp):
    for text in TRICKY:
        assert sp.decode(sp.encode(text)) == text
    # no dummy prefix: separately encoded pieces decode to the concatenated text
    assert sp.decode(sp.encode("Once upon") + sp.encode(" a time")) == "Once upon a time"
    flat, lengths = sp.encode_docs(TRICKY[:3])
    assert flat.tolist() == [i for t in TRICKY[:3] for i in sp.encode(t) + [3]]
    assert pickle.loads(pickle.dumps(sp)).encode("the dog") == sp.encode("the dog")


def test_train_sentencepiece_rejects_tiny_vocab_and_no_text(tmp_path):
    with pytest.raises(SproutError, match="too small"):
        train_sentencepiece(iter(["text"]), tmp_path / "x", 100)
    with pytest.raises(SproutError, match="x.model"):
        train_sentencepiece(iter([]), tmp_path / "x", 300)
    assert not (tmp_path / "x.model").exists()


def test_split_digits_spells_numbers_digit_by_digit(tmp_path):
    """Trained on text full of the same years, BPE merges them into pieces unless split_digits
    is on; either way the text round-trips."""
    texts = [f"In {year} the river rose, and in {year} it fell again." for year in (1999, 2019, 2024)] * 50
    pieces = {}
    for split in (True, False):
        model = train_sentencepiece(iter(texts), tmp_path / f"sd_{split}", 300, split_digits=split)
        tok = load_tokenizer(f"sentencepiece:{model}")
        ids = tok.encode("In 2019 the river rose")
        assert tok.decode(ids) == "In 2019 the river rose"
        pieces[split] = [tok.decode([i]) for i in ids]
    assert {"2", "0", "1", "9"} <= set(pieces[True]) and not any(
        len(p) > 1 and any(c.isdigit() for c in p) for p in pieces[True])
    assert any(sum(c.isdigit() for c in p) > 1 for p in pieces[False])


# ---------------------------------------------------------------- bits per byte


def test_bpb_pure_functions_hand_computed():
    luts = luts_to_torch((np.array([0, 3, 2, 1], np.int16), np.array([0, 1, 0, 1], bool), np.array([1, 0, 0, 0], bool)))
    prev, tgt = torch.tensor([0, 1, 2]), torch.tensor([1, 3, 1])
    # 3 (leading space dropped after a boundary), 1 + 1, 3 + 1
    assert token_bytes(prev, tgt, luts).tolist() == [3, 2, 4]
    assert bits_per_byte(8 * np.log(2), 4) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)


def _stream_bytes(tok, docs):
    """Bytes the LUTs count over a pretraining stream [doc0 eot doc1 eot ...]."""
    flat, _ = tok.encode_docs(docs)
    ids = torch.from_numpy(np.concatenate([[tok.eot_id], flat]).astype(np.int64))
    return int(token_bytes(ids[:-1], ids[1:], luts_to_torch(tok.byte_luts())).sum())


def _mirror_docs(mirror):
    docs = []
    for path, fld in (("pretrain/tinystories/tinystories_sample.txt", "text"), ("pretrain/fineweb/fineweb_subset.json", "text"),
                      ("pretrain/web/CC-MAIN-20190717121559-20190717143559-00140.jsonl.gz", "text")):
        for i, text in enumerate(iter_documents(SourceSpec(path=str(mirror / path)), fld)):
            if i < 300:
                docs.append(text)
    return docs  # raw text: curly quotes, NBSP, CJK, Cyrillic, emoji, CRLF


def test_byte_tables_exact_on_real_text_tiktoken(offline_mirror, mirror):
    tok = load_tokenizer("tiktoken:r50k_base", mirror=str(offline_mirror))
    docs = _mirror_docs(mirror)
    base, lead, boundary = tok.byte_luts()
    assert not lead.any() and boundary.sum() == 1 and boundary[tok.eot_id]
    for doc in docs:
        assert int(base[tok.encode(doc)].sum()) == len(doc.encode("utf-8"))
    assert _stream_bytes(tok, docs) == sum(len(d.encode("utf-8")) for d in docs)


def test_byte_tables_exact_on_real_text_sentencepiece(mirror, tmp_path):
    docs = _mirror_docs(mirror)
    path = train_sentencepiece(iter(docs), tmp_path / "real", 1024, character_coverage=0.98)  # rare chars: byte fallback
    tok = load_tokenizer(f"sentencepiece:{path}")
    for doc in docs:
        assert tok.decode(tok.encode(doc)) == doc
    assert _stream_bytes(tok, docs) == sum(len(d.encode("utf-8")) for d in docs)


def test_byte_tables_seed_method_for_dummy_prefix_models(mirror):
    # the mirror's botchan model adds a dummy prefix: its "▁" after a boundary is not text
    tok = load_tokenizer("sentencepiece:sentencepiece/botchan_en_bpe_1000.model", mirror=str(mirror))
    assert tok.dummy_prefix
    docs = [d for d in make_docs(50, seed=5) if tok._sp.unk_id() not in tok.encode(d)]  # no byte fallback there
    assert len(docs) > 10
    decoded = [tok.decode(tok.encode(d)) for d in docs]
    assert _stream_bytes(tok, docs) == sum(len(d.encode("utf-8")) for d in decoded)
