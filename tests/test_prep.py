import gzip
import json
import pickle
import runpy
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import zstandard

from data_fixtures import make_docs, train_tiny_sp
from sprout.errors import SproutError
from sprout.formats.h5tokens import open_tokens_h5
from sprout.formats.manifest import read_manifest
from sprout.prep.pretrain import PrepConfig, prepare
from sprout.formats.shards import list_shards, open_shard
from sprout.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
STORIES = make_docs(300, seed=1, prefix="A ")
WEB = make_docs(200, seed=2, prefix="B ")
NEWS = make_docs(100, seed=3, prefix="C ")
RUSSIAN = "Жили-были дед да баба, и была у них курочка Ряба. Снесла курочка яичко, да не простое, а золотое."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_sp(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "stories.txt").write_text("\n<|endoftext|>\n".join(STORIES) + "\n<|endoftext|>\n")
    with gzip.open(d / "web.jsonl.gz", "wt") as f:
        for text in WEB + [STORIES[0].upper(), STORIES[1], "too short", RUSSIAN * 3]:
            f.write(json.dumps({"text": text, "url": "http://x"}) + "\n")
        f.write("{not json}\n")
    (d / "news.json").write_text(json.dumps([{"body": t} for t in NEWS + [NEWS[0]]], indent=2))
    return d


def sources(corpus, weights=(None, None, None)):
    out = []
    for (path, extra), w in zip((("stories.txt", {}), ("web.jsonl.gz", {}), ("news.json", {"text_field": "body"})), weights):
        out.append({"path": str(corpus / path), "weight": w, **extra})
    return out


def run(tok, corpus, out, **kw):
    cfg = PrepConfig(name="t", sources=kw.pop("sources", sources(corpus)), tokenizer=tok.spec, out=str(out),
                     workers=kw.pop("workers", 1), shard_tokens=kw.pop("shard_tokens", 20_000),
                     run_tokens=kw.pop("run_tokens", 2_000), val_frac=kw.pop("val_frac", 0.1), **kw)
    return prepare(cfg, tokenizer=tok if cfg.workers == 1 else None, progress=False, log=lambda s: None)


def documents(tok, out, split):
    tokens = np.concatenate([open_shard(p) for p in list_shards(out, split)])
    ends = np.flatnonzero(tokens == tok.eot_id)
    assert ends[-1] == len(tokens) - 1
    return [tok.decode(x) for x in np.split(tokens, ends + 1)[:-1]]


def test_end_to_end_counts_shards_and_manifest(tok, corpus, tmp_path):
    m = run(tok, corpus, tmp_path / "out")
    assert read_manifest(tmp_path / "out") == m
    by = {s["name"]: s for s in m["sources"]}
    assert (by["stories"]["documents_read"], by["web"]["documents_read"], by["news"]["documents_read"]) == (300, 204, 101)
    assert by["web"]["invalid_json"] == 1 and by["web"]["too_short"] == 1 and by["web"]["non_ascii"] == 1
    assert by["web"]["duplicates"] == 2 and by["news"]["duplicates"] == 1 and by["stories"]["duplicates"] == 0
    assert [by[n]["documents_kept"] for n in ("stories", "web", "news")] == [300, 200, 100]
    train, val = documents(tok, tmp_path / "out", "train"), documents(tok, tmp_path / "out", "val")
    assert sorted(train + val) == sorted(STORIES + WEB + NEWS)  # every kept document once, cleaned text intact
    assert len(val) == m["splits"]["val"]["documents"] and 30 <= len(val) <= 90  # ~10% by hash
    assert sum(e["num_tokens"] for e in m["shards"]["train"]) == m["splits"]["train"]["tokens"]
    assert all(e["num_tokens"] == 20_000 for e in m["shards"]["train"][:-1])
    assert m["tokenizer"]["vocab_size"] == 400 and m["token_dtype"] == "uint16"


def test_byte_identical_output_for_one_and_two_workers(tok, corpus, tmp_path):
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        m = run(tok, corpus, out, workers=workers, format="both", sources=sources(corpus, (0.5, 0.3, 0.2)))
        outs.append((out, m))
    (a, ma), (b, mb) = outs
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and any(n.endswith(".h5") for n in names)
    for name in names:
        if name != "manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert {**ma, "command": None, "config": None} == {**mb, "command": None, "config": None}
    assert (ma["config"]["workers"], mb["config"]["workers"]) == (1, 2)


def test_a_pool_workers_result_message_fits_one_atomic_pipe_write(tok, tmp_path):
    """The pool's task hands back the counts only, its arrays in a file: a message of at most
    512 bytes (the least PIPE_BUF POSIX allows) goes into the pool's result pipe in one write,
    so a worker killed while sending cannot leave half a message for the pool to wait on for
    ever (the kill-9 test in test_bad_inputs_prep.py looks for a worker blocked at that moment). Read back,
    the file gives exactly the arrays of the in-process path, and is removed."""
    from sprout.prep import pretrain
    from sprout.prep.clean import CleanConfig

    texts = make_docs(pretrain.CHUNK_DOCS, seed=5)  # a full chunk
    spooled = tmp_path / "source0-chunk0000000003.npy"
    pretrain._init_worker(tok.spec, None, asdict(CleanConfig()), "uint16")
    try:
        message = pretrain._spool_chunk((str(spooled), texts))
        tokens, lengths, keys, counts = pretrain._process_chunk(texts)
    finally:
        pretrain._STATE.clear()
    assert len(tokens) > 512  # the arrays themselves would not fit
    assert len(pickle.dumps(message)) <= 256  # room for the pool's own envelope
    back = pretrain._unspool_chunk(spooled, message)
    for got, want in zip(back[:3], (tokens, lengths, keys)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert back[3] == counts and not list(tmp_path.iterdir())


def test_mixture_weights_honoured(tok, corpus, tmp_path):
    m = run(tok, corpus, tmp_path / "o", sources=sources(corpus, (0.2, 0.5, 0.3)), val_frac=0.0)
    shares = [s["train_share"] for s in m["sources"]]
    assert shares == pytest.approx([0.2, 0.5, 0.3], abs=0.01)  # within 1 point: whole documents only
    by = {s["name"]: s["tokens"] for s in m["sources"]}
    assert by["stories"]["train"] < by["stories"]["train_natural"]  # down-sampled
    assert by["web"]["train"] > by["web"]["train_natural"]  # up-sampled
    m = run(tok, corpus, tmp_path / "o2", sources=sources(corpus, (1, 1, 2)), train_tokens=50_000, val_frac=0.0)
    assert m["splits"]["train"]["tokens"] == pytest.approx(50_000, rel=0.01)
    assert [s["train_share"] for s in m["sources"]] == pytest.approx([0.25, 0.25, 0.5], abs=0.01)
    with pytest.raises(SproutError, match="every source or for none"):
        run(tok, corpus, tmp_path / "o3", sources=sources(corpus, (1, None, 1)))


def test_runs_mix_sources_throughout_the_file(tok, corpus, tmp_path):
    run(tok, corpus, tmp_path / "o", run_tokens=1_000, val_frac=0.0)
    train = documents(tok, tmp_path / "o", "train")
    for part in (train[: len(train) // 4], train[-len(train) // 4 :]):
        assert {d[0] for d in part} == {"A", "B", "C"}


def test_val_split_stable_across_seeds_and_counts(tok, corpus, tmp_path):
    vals = []
    for seed in (0, 1):
        run(tok, corpus, tmp_path / f"s{seed}", seed=seed)
        vals.append(sorted(documents(tok, tmp_path / f"s{seed}", "val")))
    assert vals[0] == vals[1]
    assert documents(tok, tmp_path / "s0", "train") != documents(tok, tmp_path / "s1", "train")  # order is seeded
    m = run(tok, corpus, tmp_path / "c", val_docs=7)
    assert [s["val_documents"] for s in m["sources"]] == [7, 7, 7]
    val = set(documents(tok, tmp_path / "c", "val"))
    assert len(val) == 21 and not val & set(documents(tok, tmp_path / "c", "train"))


def test_rerun_replaces_own_outputs_and_refuses_foreign_ones(tok, corpus, tmp_path):
    out = tmp_path / "o"
    run(tok, corpus, out, shard_tokens=5_000)
    n_before = len(list_shards(out, "train"))
    m = run(tok, corpus, out, shard_tokens=50_000)
    assert len(list_shards(out, "train")) == len(m["shards"]["train"]) < n_before  # stale shards removed
    with pytest.raises(SproutError, match="already holds dataset 't'"):
        prepare(PrepConfig(name="other", sources=sources(corpus), tokenizer=tok.spec, out=str(out), workers=1),
                tokenizer=tok, progress=False, log=lambda s: None)


class _BigVocab(Tokenizer):
    """A stand-in with a vocab over 65,536 (like cl100k_base); it never gets to encode."""

    def __init__(self):
        super().__init__("stub:big", None)
        self.name, self.vocab_size, self.eot_id, self.bos_id, self.pad_id = "big", 100_277, 100_257, None, None


def test_uint16_refused_for_large_vocab(corpus, tmp_path):
    cfg = PrepConfig(sources=sources(corpus), out=str(tmp_path / "o"), token_dtype="uint16", workers=1)
    with pytest.raises(SproutError, match=r"stub:big: vocab size 100,277 does not fit uint16"):
        prepare(cfg, tokenizer=_BigVocab(), progress=False)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- bad input through the CLI


def cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["prepare_pretrain_data.py", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "scripts" / "prepare_pretrain_data.py"), run_name="__main__")
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def bad_input_cases(d: Path):
    raw = "".join(json.dumps({"text": t}) + "\n" for t in WEB).encode()
    gz = gzip.compress(raw)
    (d / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (d / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw)[:-20])
    lines = raw.decode().splitlines(keepends=True)
    (d / "bad.jsonl").write_text(lines[0] + "{oops\n" + "".join(lines[1:]))
    (d / "nofield.jsonl").write_text(json.dumps({"text": WEB[0]}) + "\n" + json.dumps({"body": WEB[1]}) + "\n")
    (d / "empty.jsonl").write_text("")
    return {
        "cut.jsonl.gz": "cut.jsonl.gz: truncated gzip stream",
        "cut.jsonl.zst": "cut.jsonl.zst: truncated zstd stream",
        "bad.jsonl": "bad.jsonl:2: invalid JSON line",
        "nofield.jsonl": "nofield.jsonl:2: missing text field 'text'",
        "empty.jsonl": "empty.jsonl: empty input",
    }


def test_bad_inputs_fail_with_one_line_and_no_valid_output(tok, tmp_path, monkeypatch, capsys):
    cases = bad_input_cases(tmp_path)
    for name, message in cases.items():
        out = tmp_path / f"out-{name}"
        strict = ["--strict"] if name == "bad.jsonl" else []
        code, _, err = cli(monkeypatch, capsys, "--source", tmp_path / name, "--tokenizer", tok.spec, "--out", out,
                           "--workers", "1", "--no-progress", *strict)
        lines = err.strip().splitlines()
        assert code == 2 and lines[-1].startswith("error: ") and message in lines[-1], (name, err)
        assert not out.exists() or not any(out.iterdir()), name


def test_invalid_json_line_is_skipped_and_counted_by_default(tok, tmp_path, monkeypatch, capsys):
    bad_input_cases(tmp_path)
    out = tmp_path / "o"
    code, stdout, err = cli(monkeypatch, capsys, "--source", tmp_path / "bad.jsonl", "--tokenizer", tok.spec,
                            "--out", out, "--workers", "1", "--no-progress", "--val-frac", "0.1")
    assert code == 0 and "warning: " in err and "bad.jsonl:2: invalid JSON line" in err
    assert read_manifest(out)["sources"][0]["invalid_json"] == 1
    assert "bad json" in stdout and "total" in stdout  # the summary table


def test_output_dir_with_another_datasets_shards(tok, corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "fineweb_train_000000.bin").write_bytes(b"\0" * 1024)
    code, _, err = cli(monkeypatch, capsys, "--source", corpus / "stories.txt", "--tokenizer", tok.spec,
                       "--out", out, "--name", "demo", "--workers", "1", "--no-progress")
    assert code == 2 and "fineweb_train_000000.bin: output folder already holds another dataset's shards" in err
    assert sorted(p.name for p in out.iterdir()) == ["fineweb_train_000000.bin"]


def test_hdf5_output_matches_bin(tok, corpus, tmp_path):
    m = run(tok, corpus, tmp_path / "o", format="both")
    bins = np.concatenate([open_shard(p) for p in list_shards(tmp_path / "o", "train")])
    h5 = open_tokens_h5(tmp_path / "o" / m["hdf5"]["train"]["file"])
    assert np.array_equal(h5.tokens[:], bins)
    assert h5.attrs["vocab_size"] == 400 and h5.attrs["num_documents"] == m["splits"]["train"]["documents"]
    assert h5.attrs["split_rule"]["method"] == "hash-fraction"
    h5.close()
    m = run(tok, corpus, tmp_path / "h", format="hdf5")
    assert m["shards"] == {"train": [], "val": []} and not list((tmp_path / "h").glob("*.bin"))


# ---------------------------------------------------------------- the demo, end to end


@pytest.mark.slow
def test_demo_data_step_on_the_mirror(mirror, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPROUT_MIRROR", str(mirror))
    monkeypatch.chdir(ROOT)
    prefix = tmp_path / "tokenizer" / "sp4096"
    for script, args in (
        ("train_tokenizer.py", ["--config", "configs/demo/tokenizer.yaml", "--out", prefix]),
        ("prepare_pretrain_data.py", ["--config", "configs/demo/pretrain_data.yaml", "--no-progress",
                                      "--tokenizer", f"sentencepiece:{prefix}.model", "--out", tmp_path / "data"]),
        ("verify_shards.py", [tmp_path / "data"]),
    ):
        monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(str(ROOT / "scripts" / script), run_name="__main__")
        out = capsys.readouterr()
        assert exc.value.code == 0, (script, out.err[-2000:])
    assert "all checks passed" in out.out
    m = read_manifest(tmp_path / "data")
    assert m["tokenizer"]["vocab_size"] == 4096 and m["splits"]["train"]["tokens"] > 500_000
    assert {s["name"] for s in m["sources"]} == {"tinystories", "fineweb", "web"}


def test_tokenizer_training_skips_exactly_the_val_documents(tok, corpus, tmp_path, monkeypatch):
    """train_tokenizer's exclude_val_frac uses prep's hash-fraction rule: it trains on the
    train documents only. It does not deduplicate, so it also sees the upper-cased copy of a
    story that prep's case-insensitive dedup drops."""
    import sprout.prep.tokenizer_train as tokenizer_module
    from sprout.prep.tokenizer_train import TokenizerTrainConfig, train_from_sources

    run(tok, corpus, tmp_path / "out", val_frac=0.2)
    val = set(documents(tok, tmp_path / "out", "val"))
    train = set(documents(tok, tmp_path / "out", "train"))
    seen = []
    monkeypatch.setattr(tokenizer_module, "train_sentencepiece", lambda texts, *a, **k: seen.extend(texts))
    train_from_sources(TokenizerTrainConfig(sources=sources(corpus), exclude_val_frac=0.2, out=str(tmp_path / "sp")))
    assert val and not {t.lower() for t in val} & {t.lower() for t in seen}
    assert {t.lower() for t in seen} == {t.lower() for t in train}
