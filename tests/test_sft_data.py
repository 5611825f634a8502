"""SFT sources, prep and loader on fixtures in each source's real format (and the mirror)."""

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sft_fixtures import ALPACA, DOLLY_ORIGINAL, GSM8K, source_list, write_jsonl, write_sources

from data_loader.sft_batches import SFTLoader
from sprout.answers import parse_answer
from sprout.chat import template_for
from sprout.errors import SproutError
from sprout.formats.maskcheck_sft import check_arrays
from sprout.formats.packed_sft import SFTFile, val_path
from sprout.chat import ChatError, validate
from sprout.prep.keys import conversation_key, is_val
from sprout.prep.mixture import resample
from sprout.prep.sft_data import SFTDataConfig, prepare
from sprout.prep.chat_sources import SourceConfig, iter_records, read_source, strip_alpaca_wrapper

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def paths(tmp_path):
    return write_sources(tmp_path / "src")


def convs(fmt, path):
    return [ex.messages for ex in read_source(SourceConfig(fmt, fmt, str(path)))]


# ---- sources ---------------------------------------------------------------------------

def test_alpaca_instruction_plus_optional_input(paths):
    c = convs("alpaca", paths["alpaca"])
    assert c[0] == [{"role": "user", "content": "Give three tips for staying healthy."},
                    {"role": "assistant", "content": ALPACA[0]["output"]}]
    assert c[1][0]["content"] == "Arrange the following musical notes\n\nG, B, E"


def test_dolly_both_schemas_give_the_same_conversations(paths):
    original = convs("dolly", paths["dolly_original"])
    reformatted = convs("dolly", paths["dolly_prompt"])
    assert original == reformatted
    assert original[0][0]["content"] == ("When did Virgin Australia start operating?\n"
                                         "Virgin Australia commenced services on 31 August 2000 as Virgin Blue.")
    assert "### Instruction" not in reformatted[0][0]["content"] and "Below is" not in reformatted[0][0]["content"]
    assert strip_alpaca_wrapper("no wrapper here") == "no wrapper here"


def test_gsm8k_think_answer_without_calculator_annotations(paths):
    c = convs("gsm8k", paths["gsm8k"])
    answer = c[0][1]["content"]
    assert answer == ("<think>Natalia sold 48/2 = 24 clips in May.\n"
                      "Natalia sold 48+24 = 72 clips altogether in April and May.</think><answer>72</answer>")
    assert parse_answer(c[1][1]["content"], strict=True) == "1080"  # 1,080 normalised
    assert "<<" not in c[1][1]["content"] and "1,080 pens" in c[1][1]["content"]


def test_gsm8k_without_final_answer_is_an_error_naming_the_line(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [GSM8K[0], {"question": "q?", "answer": "It is 4."}])
    with pytest.raises(SproutError, match=r"g\.jsonl:2: GSM8K answer has no '#### N'"):
        convs("gsm8k", path)


def test_non_utf8_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(DOLLY_ORIGINAL[0]).encode() + b"\n" + b'{"instruction": "caf\xe9"}\n')
    with pytest.raises(SproutError, match=r"bad\.jsonl:2: not valid UTF-8"):
        convs("dolly", path)
    arr = tmp_path / "bad.json"
    arr.write_bytes(b'[\n{"instruction": "a", "input": "", "output": "b"},\n{"instruction": "\xff"}]')
    with pytest.raises(SproutError, match=r"bad\.json:3: not valid UTF-8"):
        convs("alpaca", arr)


def test_bad_json_and_missing_fields_name_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"instruction": "a", "response": "b"}\n{not json\n')
    with pytest.raises(SproutError, match=r"x\.jsonl:2: invalid JSON"):
        convs("dolly", path)
    path.write_text('{"instruction": "a"}\n')
    with pytest.raises(SproutError, match=r"x\.jsonl:1: missing field 'response'"):
        convs("dolly", path)


def test_gzip_jsonl_and_chat_format(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    assert [r for _, r in iter_records(path)][0]["messages"][1]["content"] == "yo"
    assert convs("chat", path)[0][0] == {"role": "user", "content": "hi"}


def test_hub_route_through_datasets_with_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = tmp_path / "dolly_hub"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", DOLLY_ORIGINAL)
    got = [ex.messages for ex in read_source(SourceConfig("dolly", "dolly", hub=str(folder)), mirror=None)]
    assert got == convs("dolly", write_jsonl(tmp_path / "d.jsonl", DOLLY_ORIGINAL))


def test_mirror_paths_and_no_route(tmp_path, monkeypatch):
    (tmp_path / "a.json").write_text(json.dumps(ALPACA[:1]))
    spec = SourceConfig("a", "alpaca", "${SPROUT_MIRROR}/a.json")
    assert len(list(read_source(spec, mirror=tmp_path))) == 1
    monkeypatch.setenv("SPROUT_MIRROR", str(tmp_path))
    assert len(list(read_source(spec))) == 1
    with pytest.raises(SproutError, match="source file not found"):
        list(read_source(SourceConfig("a", "alpaca", "${SPROUT_MIRROR}/nope.json"), mirror=tmp_path))
    monkeypatch.setenv("SPROUT_MIRROR", "")  # no mirror at all, and no hub id
    with pytest.raises(SproutError, match=r"a.json needs a mirror .* and there is no hub id"):
        list(read_source(spec))


# ---- prep --------------------------------------------------------------------------------

def _prepare(tok, paths, out, **kw):
    cfg = SFTDataConfig(tokenizer=tok.spec, out=str(out), seq_len=kw.pop("seq_len", 128),
                        sources=kw.pop("sources", source_list(paths)), **kw)
    return prepare(cfg, tok, log=lambda *_: None)


@pytest.mark.parametrize("which", ["r50k", "sp"])
def test_prepare_writes_checked_files_with_counts(request, paths, tmp_path, which):
    tok = request.getfixturevalue(which)
    out = tmp_path / "sft.h5"
    result = _prepare(tok, paths, out, val_fraction=0.0)
    src = result["sources"]
    assert src["alpaca"]["read"] == 4 and src["alpaca"]["dropped_empty_content"] == 1
    assert src["alpaca"]["duplicates"] == 1 and src["alpaca"]["train"] == 2
    assert src["dolly_hhrlhf"]["duplicates"] == 2  # same conversations as the original-schema Dolly
    assert src["gsm8k"]["train"] == 2
    with SFTFile(out) as f:
        arrays = f.verify()
        attrs = f.attrs
    assert attrs["tokenizer_spec"] == tok.spec and attrs["tokenizer_fingerprint"] == tok.fingerprint()
    assert attrs["template_version"] == "sprout-chat-v1" and attrs["split"] == "train"
    assert attrs["counts"]["split"]["examples_packed"] == 6 == result["train"]["examples_packed"]
    report = check_arrays(arrays, template_for(tok), attrs["pad_id"], attrs["vocab_size"], 0)
    assert report.violations == [] and report.docs == 6 and report.assistant_turns == 6
    # every trained run decodes to one assistant answer plus the eot
    answers = {m["content"] for c in ([*convs("alpaca", paths["alpaca"]), *convs("dolly", paths["dolly_original"]),
                                       *convs("gsm8k", paths["gsm8k"])]) for m in c if m["role"] == "assistant"}
    runs = []
    for r in range(arrays["tokens"].shape[0]):
        m = np.r_[0, arrays["loss_mask"][r].astype(int), 0]
        for a, b in zip(np.flatnonzero(np.diff(m) == 1), np.flatnonzero(np.diff(m) == -1)):
            ids = arrays["tokens"][r, a:b]
            assert ids[-1] == tok.eot_id
            runs.append(tok.decode(ids[:-1].tolist()))
    assert sorted(runs) == sorted(a for a in answers if a)
    with SFTFile(val_path(out)) as f:
        assert f.num_rows == 0 and f.attrs["split"] == "val"


def test_val_split_is_disjoint_and_stable(r50k, paths, tmp_path):
    # the shared key: MD5 of the lower-cased roles and contents joined by the unit separator
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert conversation_key(conv) == hashlib.md5(b"user\x1fhi\x1fassistant\x1fyo").digest()
    unique = {}
    for fmt, name in (("alpaca", "alpaca"), ("dolly", "dolly_original"), ("dolly", "dolly_prompt"), ("gsm8k", "gsm8k")):
        for c in convs(fmt, paths[name]):
            try:
                validate(c)
            except ChatError:
                continue
            unique.setdefault(conversation_key(c), c)
    result = _prepare(r50k, paths, tmp_path / "s.h5", val_fraction=0.5)
    n_val = sum(s.get("val", 0) for s in result["sources"].values())
    n_train = sum(s.get("train", 0) for s in result["sources"].values())
    assert n_val + n_train == len(unique) == 6 and result["val"]["examples_packed"] == n_val
    assert n_val == sum(is_val(k, 0.5) for k in unique)
    with SFTFile(tmp_path / "s.h5") as t, SFTFile(tmp_path / "s_val.h5") as v:
        a, b = t.read(), v.read()
    docs = lambda arr: {tuple(arr["tokens"][r][arr["segment_ids"][r] == d]) for r in range(len(arr["tokens"]))  # noqa: E731
                        for d in set(arr["segment_ids"][r].tolist()) - {0}}
    assert not docs(a) & docs(b)


def test_mixture_weights(r50k, paths, tmp_path):
    rng = np.random.default_rng(0)
    ones = np.ones(10, dtype=np.int64)
    twice = resample(np.arange(10), ones, 2.0 * 10, rng)  # weight 2: every example exactly twice
    assert np.bincount(twice, minlength=10).tolist() == [2] * 10
    half = resample(np.arange(10), ones, 0.5 * 10, rng)   # weight 0.5: 5 distinct examples
    assert len(half) == len(set(half.tolist())) == 5
    counts = np.bincount(resample(np.arange(10), ones, 1.3 * 10, rng), minlength=10)  # each once, 3 twice
    assert counts.sum() == 13 and counts.min() == 1 and (counts == 2).sum() == 3
    assert len(resample(np.arange(10), ones, 0.0, rng)) == 0
    sources = source_list(paths)
    sources[3]["weight"] = 3.0
    sources[0]["weight"] = 0.5
    result = _prepare(r50k, paths, tmp_path / "w.h5", sources=sources, val_fraction=0.0)
    assert result["sources"]["gsm8k"]["train_weighted"] == 6
    assert result["sources"]["alpaca"]["train_weighted"] == 1


def test_prompt_longer_than_context_is_a_counted_drop(r50k, paths, tmp_path):
    result = _prepare(r50k, paths, tmp_path / "t.h5", seq_len=24, val_fraction=0.0)
    assert result["train"]["prompt_too_long"] >= 1
    assert result["train"]["examples_packed"] + result["train"]["prompt_too_long"] == result["train"]["examples_in"]
    drop = _prepare(r50k, paths, tmp_path / "d.h5", seq_len=40, val_fraction=0.0, overlong="drop")
    assert drop["train"]["overlong_dropped"] >= 1 and drop["train"]["truncated"] == 0


def test_bad_config_values(r50k, paths, tmp_path):
    with pytest.raises(SproutError, match="overlong"):
        _prepare(r50k, paths, tmp_path / "x.h5", overlong="wrap")
    with pytest.raises(SproutError, match="unknown format"):
        _prepare(r50k, paths, tmp_path / "x.h5", sources=[{"name": "a", "format": "csv", "path": "a"}])
    with pytest.raises(SproutError, match="unknown key"):
        _prepare(r50k, paths, tmp_path / "x.h5", sources=[{"name": "a", "format": "alpaca", "pth": "a"}])


def test_script_on_the_mirror_then_checker(mirror, tmp_path):
    out = tmp_path / "m.h5"
    cmd = [sys.executable, "scripts/prepare_sft_data.py", "--config", "configs/demo/sft_data.yaml",
           "--tokenizer", "tiktoken:r50k_base", "--mirror", str(mirror), "--out", str(out),
           "--max-examples", "40", "--seq-len", "256"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    with SFTFile(out) as f:
        counts = f.attrs["counts"]
        assert f.attrs["seq_len"] == 256 and f.num_rows > 0
    assert {k: v["read"] for k, v in counts["sources"].items()} == {"alpaca": 40, "dolly": 40, "gsm8k": 40,
                                                                       "arithmetic": 40}
    check = subprocess.run([sys.executable, "scripts/check_loss_mask.py", str(out), "--mirror", str(mirror), "--show", "1"],
                           cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "OK: every row passes" in check.stdout and "trained_fraction" in check.stdout


def test_script_error_is_one_line_exit_2(mirror, tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q?", "answer": "4"}])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"sources:\n  - {{name: g, format: gsm8k, path: {path}}}\n")
    run = subprocess.run([sys.executable, "scripts/prepare_sft_data.py", "--config", str(cfg), "--mirror", str(mirror),
                          "--out", str(tmp_path / "o.h5")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == f"error: {path}:1: GSM8K answer has no '#### N' final answer"


# ---- loader ------------------------------------------------------------------------------

def num_rows(path) -> int:
    with SFTFile(path) as f:
        return f.num_rows


@pytest.fixture
def packed_file(r50k, paths, tmp_path):
    sources = source_list(paths)
    sources[3]["weight"] = 8.0  # enough rows for a few batches
    _prepare(r50k, paths, tmp_path / "l.h5", seq_len=48, sources=sources, val_fraction=0.0)
    return tmp_path / "l.h5"


def test_loader_batches_are_shifted(packed_file):
    loader = SFTLoader(packed_file, batch_size=2, seed=3)
    batch = next(iter(loader))
    rows = loader.indices(0, 0)
    with SFTFile(packed_file) as f:
        raw = f.read(rows)
    assert batch["input_ids"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.bool
    assert batch["input_ids"].shape == (2, 47)
    assert (batch["input_ids"].numpy() == raw["tokens"][:, :-1]).all()
    assert (batch["targets"].numpy() == raw["tokens"][:, 1:]).all()
    assert (batch["loss_mask"].numpy() == raw["loss_mask"][:, 1:].astype(bool)).all()
    assert (batch["segment_ids"].numpy() == raw["segment_ids"][:, :-1]).all()
    assert (batch["position_ids"].numpy() == raw["position_ids"][:, :-1]).all()
    # every trained target sits in the same document as the input that predicts it
    seg_next = torch.from_numpy(raw["segment_ids"][:, 1:].astype(np.int64))
    assert (batch["segment_ids"][batch["loss_mask"]] == seg_next[batch["loss_mask"]]).all()


def test_loader_ranks_are_disjoint_and_deterministic(packed_file):
    n = num_rows(packed_file)
    assert n >= 4
    ranks = [SFTLoader(packed_file, batch_size=1, seed=7, rank=k, world_size=2) for k in range(2)]
    seen = [set(), set()]
    for _ in range(ranks[0].steps_per_epoch):
        for k in range(2):
            seen[k].update(ranks[k].indices(ranks[k].epoch, ranks[k].step).tolist())
            ranks[k].next_batch()
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 2 * (n // 2)
    again = SFTLoader(packed_file, batch_size=1, seed=7, rank=0, world_size=2)
    assert again.indices(0, 0).tolist() == SFTLoader(packed_file, batch_size=1, seed=7, rank=0, world_size=2).indices(0, 0).tolist()
    assert not np.array_equal(again.indices(0, 0), again.indices(1, 0)) or n < 3
    evals = [sum(len(b["input_ids"]) for b in ranks[k].eval_batches()) for k in range(2)]
    assert sum(evals) == n


def test_loader_resumes_exactly(packed_file):
    a = SFTLoader(packed_file, batch_size=2, seed=1)
    for _ in range(a.steps_per_epoch + 1):  # cross an epoch boundary
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(3)]
    b = SFTLoader(packed_file, batch_size=2, seed=1)
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)
    c = SFTLoader(packed_file, batch_size=1, seed=1)
    with pytest.raises(SproutError, match="cannot resume"):
        c.load_state_dict(state)


def test_loader_small_file_evaluates_but_cannot_train(packed_file):
    n = num_rows(packed_file)
    loader = SFTLoader(packed_file, batch_size=n + 1)
    assert sum(len(b["input_ids"]) for b in loader.eval_batches()) == n
    with pytest.raises(SproutError, match="cannot fill one global batch"):
        loader.next_batch()
