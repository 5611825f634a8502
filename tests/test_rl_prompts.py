"""RL prompts: the JSONL contract (reader, verifier, writer) and the prep from GSM8K, the
arithmetic generator and local JSONL, with fixtures in each source's format."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sprout.config import from_dict
from sprout.errors import SproutError
from sprout.formats.prompts import read_prompts, verify_prompts, write_prompts
from sprout.prep import arithmetic
from sprout.prep.chat_sources import gsm8k_messages
from sprout.prep.keys import is_val
from sprout.prep.rl_prompts import ANSWER_FORMAT, PromptDataConfig, prepare, prompt_key

ROOT = Path(__file__).resolve().parents[1]


def _prompt(i=0, **extra):
    return {"id": f"q{i}", "source": "t", "prompt": [{"role": "user", "content": f"question {i}"}],
            "gold": "4", "level": None, **extra}


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _gsm8k_row(question: str, final: str, reasoning: str = "She has 2 + 2 = <<2+2=4>>4 apples.") -> dict:
    """A GSM8K record as openai/grade-school-math writes it: reasoning lines, then `#### N`."""
    return {"question": question, "answer": f"{reasoning}\n#### {final}"}


def _run(tmp_path, sources, **cfg):
    out = tmp_path / "out"
    manifest = prepare(PromptDataConfig(out=str(out), sources=sources, **cfg), log=lambda *_: None)
    return manifest, list(read_prompts(out / "prompts.jsonl")), list(read_prompts(out / "prompts_test.jsonl"))


# ---- the contract ------------------------------------------------------------------------

def test_contract_round_trip(tmp_path):
    rows = [_prompt(0), _prompt(1, gold="-2.5", level=3),
            {**_prompt(2), "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}],
             "gold": "1/3", "level": 0}]
    assert write_prompts(tmp_path / "p.jsonl", rows) == 3
    assert list(read_prompts(tmp_path / "p.jsonl")) == rows
    report = verify_prompts(tmp_path / "p.jsonl")
    assert report["errors"] == [] and report["valid"] == 3
    assert report["sources"] == {"t": 3} and report["levels"] == {"null": 1, "3": 1, "0": 1}


BAD_RECORDS = [
    ({k: v for k, v in _prompt().items() if k != "gold"}, "missing key(s) gold"),
    ({k: v for k, v in _prompt().items() if k != "level"}, "missing key(s) level"),
    ({**_prompt(), "answer": "4"}, "unknown key(s) answer"),
    ({**_prompt(), "source": ""}, "'source'"),
    ({**_prompt(), "prompt": [{"role": "bot", "content": "x"}]}, "unknown role"),
    ({**_prompt(), "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "end with a user"),
    ({**_prompt(), "prompt": []}, "non-empty list"),
    ({**_prompt(), "prompt": "what is 2+2?"}, "non-empty list"),
    ({**_prompt(), "prompt": [{"role": "user", "content": "  "}]}, "empty content"),
    ({**_prompt(), "prompt": [{"role": "user", "content": "a <|assistant|> b"}]}, "reserved marker"),
    ({**_prompt(), "gold": 4}, "'gold' must be a string"),
    ({**_prompt(), "gold": "four"}, "is not a number"),
    ({**_prompt(), "gold": "1,234"}, "not normalised (write '1234')"),
    ({**_prompt(), "gold": "$5"}, "not normalised (write '5')"),
    ({**_prompt(), "gold": "0.50"}, "not normalised (write '0.5')"),
    ({**_prompt(), "level": "1"}, "'level'"),
    ({**_prompt(), "level": -1}, "'level'"),
    ({**_prompt(), "level": True}, "'level'"),
    ("[1, 2]", "JSON object"),
    ("{not json", "invalid JSON"),
    ("", "empty line"),
]


@pytest.mark.parametrize("record,message", BAD_RECORDS)
def test_reader_refuses_with_file_and_line(tmp_path, record, message):
    path = _jsonl(tmp_path / "p.jsonl", [_prompt(0), record, _prompt(2)])
    with pytest.raises(SproutError) as err:
        list(read_prompts(path))
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)
    assert "\n" not in str(err.value)
    report = verify_prompts(path)
    assert report["records"] == 3 and report["valid"] == 2
    assert len(report["errors"]) == 1 and report["errors"][0].startswith(f"{path}:2: ")


def test_repeated_id_missing_file_and_atomic_writer(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [_prompt(0), _prompt(0)])
    with pytest.raises(SproutError, match=r":2: id 'q0' repeats line 1"):
        list(read_prompts(path))
    with pytest.raises(SproutError, match="prompt file not found"):
        list(read_prompts(tmp_path / "missing.jsonl"))
    assert verify_prompts(tmp_path / "missing.jsonl")["errors"][0].endswith("prompt file not found")
    with pytest.raises(SproutError, match=r"record 2 \(q1\): 'gold' '1,000' is not normalised"):
        write_prompts(tmp_path / "w.jsonl", [_prompt(0), _prompt(1, gold="1,000")])
    assert not (tmp_path / "w.jsonl").exists()  # atomic: nothing half-written


# ---- GSM8K ---------------------------------------------------------------------------------

def test_gsm8k_gold_edge_cases_and_counted_drops(tmp_path):
    rows = [_gsm8k_row("How many in all?", "1,234"), _gsm8k_row("How many dollars?", "$5"),
            _gsm8k_row("What is the change?", "-3"), _gsm8k_row("How many liters?", "2.5"),
            _gsm8k_row("What share is left?", "3/4"), _gsm8k_row("How far?", "  1,000,000 "),
            _gsm8k_row("How many pens?", "five"), _gsm8k_row("How many cats?", "12 cats"),
            _gsm8k_row("How many dogs?", "1,00"),
            {"question": "How many birds?", "answer": "There are 7 birds."}]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    manifest, train, test = _run(tmp_path, [{"name": "gsm8k", "format": "gsm8k", "path": str(path)}],
                                 test_fraction=0.0)
    assert test == []
    golds = {r["prompt"][0]["content"]: r["gold"] for r in train}
    assert golds == {"How many in all?": "1234", "How many dollars?": "5", "What is the change?": "-3",
                     "How many liters?": "2.5", "What share is left?": "0.75", "How far?": "1000000"}
    assert all(r["level"] is None and r["source"] == "gsm8k" for r in train)
    assert manifest["dropped"] == {"unparsable_gold": 3, "no_final_answer": 1}
    src = manifest["sources"]["gsm8k"]
    assert src["read"] == 10 and src["train"] == 6 and src["dropped_unparsable_gold"] == 3
    assert "'five'" in manifest["first_drops"]["gsm8k/unparsable_gold"]


def test_gsm8k_prompt_is_the_sft_prompt(tmp_path):
    row = _gsm8k_row("  Tom has 3 apples and buys 4 more.\nHow many now?  ", "7")
    path = _jsonl(tmp_path / "train.jsonl", [row])
    _, train, _ = _run(tmp_path, [{"name": "gsm8k", "format": "gsm8k", "path": str(path)}], test_fraction=0.0)
    sft_user = gsm8k_messages(row, "x")[0]
    assert train[0]["prompt"] == [sft_user]  # the same user message the SFT model was trained on

    _, train, _ = _run(tmp_path, [{"name": "gsm8k", "format": "gsm8k", "path": str(path)}], test_fraction=0.0,
                       instruction=ANSWER_FORMAT)
    assert train[0]["prompt"][0]["content"] == f"{sft_user['content']}\n\n{ANSWER_FORMAT}"


def test_gsm8k_row_missing_a_field_names_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "train.jsonl", [_gsm8k_row("q?", "1"), {"question": "no answer here"}])
    with pytest.raises(SproutError, match=r"train.jsonl:2: missing field 'answer'"):
        _run(tmp_path, [{"name": "gsm8k", "format": "gsm8k", "path": str(path)}])


def test_own_split_keeps_the_source_split(tmp_path):
    train_path = _jsonl(tmp_path / "train.jsonl", [_gsm8k_row(f"Train question {i}?", str(i)) for i in range(30)])
    test_path = _jsonl(tmp_path / "test.jsonl", [_gsm8k_row(f"Test question {i}?", str(i)) for i in range(10)]
                       + [_gsm8k_row("Train question 3?", "3")])  # also in train: a duplicate, dropped
    manifest, train, test = _run(tmp_path, [
        {"name": "gsm8k", "format": "gsm8k", "path": str(train_path), "split": "train", "own_split": True},
        {"name": "gsm8k_test", "format": "gsm8k", "path": str(test_path), "split": "test", "own_split": True}],
        test_fraction=0.5)
    assert {r["source"] for r in train} == {"gsm8k"} and len(train) == 28  # 16 and 18: the dev slice
    assert manifest["sources"]["gsm8k"]["dropped_held_out"] == 2 and manifest["held_out"]["dropped"]["gsm8k_dev"] == 2
    assert {r["source"] for r in test} == {"gsm8k_test"} and len(test) == 10
    assert manifest["sources"]["gsm8k_test"]["duplicates"] == 1 and manifest["split"]["in_both"] == 0
    assert manifest["split"]["own_split_sources"] == {"gsm8k": "train", "gsm8k_test": "test"}


# ---- split, dedup, arithmetic, local JSONL -------------------------------------------------

def test_hash_split_is_disjoint_by_prompt(tmp_path):
    rows = [{"prompt": f"What is twice {i}?", "gold": str(2 * i)} for i in range(200)]
    path = _jsonl(tmp_path / "mine.jsonl", rows)
    manifest, train, test = _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}],
                                 test_fraction=0.25, dev_fraction=0.0)
    train_keys = {prompt_key(r["prompt"]) for r in train}
    test_keys = {prompt_key(r["prompt"]) for r in test}
    assert len(train) + len(test) == 200 and not train_keys & test_keys
    assert 20 <= len(test) <= 80  # a quarter, give or take the hash
    assert all(is_val(k, 0.25) for k in test_keys) and not any(is_val(k, 0.25) for k in train_keys)
    assert manifest["split"]["in_both"] == 0 and manifest["split"]["method"] == "hash-fraction"


def test_dedup_by_prompt_first_wins(tmp_path):
    path = _jsonl(tmp_path / "mine.jsonl", [{"prompt": "What is 2 + 2?", "gold": "4"},
                                            {"prompt": "WHAT IS 2 + 2?", "gold": "4"},  # the key is lower-cased
                                            {"prompt": [{"role": "user", "content": "What is 2 + 2? "}], "gold": "5"},
                                            {"prompt": "What is 3 + 3?", "gold": "6"}])
    manifest, train, test = _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}])
    kept = {r["prompt"][0]["content"]: r["gold"] for r in train + test}
    assert kept == {"What is 2 + 2?": "4", "What is 3 + 3?": "6"}
    assert manifest["sources"]["mine"]["duplicates"] == 2
    assert manifest["sources"]["mine"]["duplicates_other_gold"] == 1

    manifest, train, test = _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}], dedup=False)
    assert len(train) + len(test) == 4 and len({r["id"] for r in train + test}) == 4


def test_arithmetic_levels_recorded(tmp_path):
    manifest, train, test = _run(tmp_path, [
        {"name": "arith", "format": "arithmetic", "count": 120, "levels": [1, 2, 3, 4], "split": "train", "own_split": True},
        {"name": "arith_test", "format": "arithmetic", "count": 12, "levels": [2, 4], "split": "test", "own_split": True}],
        seed=3)
    assert len(train) == 120 and len(test) == 12
    expected = {p.question: (p.gold, p.level) for p in arithmetic.generate(120, [1, 2, 3, 4], 3, "train")}
    assert {r["prompt"][0]["content"]: (r["gold"], r["level"]) for r in train} == expected
    assert manifest["levels"]["train"] == {"1": 30, "2": 30, "3": 30, "4": 30}
    assert {r["level"] for r in test} == {2, 4}
    assert all(arithmetic.Problem(r["prompt"][0]["content"], "", 0, ()).split == "test" for r in test)


def test_local_jsonl_normalises_gold_and_counts_drops(tmp_path):
    path = _jsonl(tmp_path / "mine.jsonl", [
        {"id": "x", "source": "elsewhere", "prompt": [{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "How many grams?"}],
         "gold": "1,000", "level": 2},
        {"prompt": "How many?", "gold": 7},
        {"prompt": "How old?", "gold": "about ten"},
        {"prompt": "say <|endoftext|> now", "gold": "1"},
        {"prompt": "   ", "gold": "1"}])
    manifest, train, test = _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}], test_fraction=0.0)
    assert [(r["gold"], r["level"], r["source"]) for r in sorted(train, key=lambda r: r["gold"])] == \
        [("1000", 2, "mine"), ("7", None, "mine")]
    assert manifest["dropped"] == {"empty_content": 1, "reserved_marker": 1, "unparsable_gold": 1}


@pytest.mark.parametrize("row,message", [
    ({"prompt": "q"}, "missing field 'gold'"),
    ({"prompt": "q", "gold": "1", "answer": "1"}, "unknown field(s) answer"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "gold": "1"},
     "the prompt must end with a user turn"),
    ({"prompt": "q", "gold": 1.5}, "'gold' must be a string or an integer"),
    ({"prompt": "q", "gold": "1", "level": "easy"}, "'level'"),
])
def test_local_jsonl_bad_row_names_file_and_line(tmp_path, row, message):
    path = _jsonl(tmp_path / "mine.jsonl", [{"prompt": "ok", "gold": "1"}, row])
    with pytest.raises(SproutError) as err:
        _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}])
    assert f"mine.jsonl:2: {message}" in str(err.value)


def test_output_is_deterministic(tmp_path):
    sources = [{"name": "arith", "format": "arithmetic", "count": 50}]
    a = prepare(PromptDataConfig(out=str(tmp_path / "a"), sources=sources, seed=1), log=lambda *_: None)
    b = prepare(PromptDataConfig(out=str(tmp_path / "b"), sources=sources, seed=1), log=lambda *_: None)
    assert a["files"] == b["files"]


@pytest.mark.parametrize("cfg,message", [
    ({"sources": []}, "no sources"),
    ({"sources": [{"name": "g", "format": "gsm8k"}]}, "needs a path or a hub id"),
    ({"sources": [{"name": "g", "format": "math"}]}, "unknown format"),
    ({"sources": [{"name": "a", "format": "arithmetic", "count": 5, "split": "all", "own_split": True}]},
     "own_split needs split train, dev or test"),
    ({"sources": [{"name": "a", "format": "arithmetic", "count": 0}]}, "count must be > 0"),
    ({"sources": [{"name": "a", "format": "arithmetic", "count": 5, "levels": [9]}]}, "levels"),
    ({"test_fraction": 1.0, "sources": [{"name": "a", "format": "arithmetic", "count": 5}]}, "test_fraction"),
])
def test_bad_config_is_one_line(tmp_path, cfg, message):
    with pytest.raises(SproutError, match=message):
        prepare(from_dict(PromptDataConfig, {"out": str(tmp_path / "o"), **cfg}), log=lambda *_: None)


# ---- the script ------------------------------------------------------------------------------

def _script(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts/prepare_rl_prompts.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_script_end_to_end(tmp_path):
    mirror = tmp_path / "mirror"
    (mirror / "sft/gsm8k").mkdir(parents=True)
    _jsonl(mirror / "sft/gsm8k/train.jsonl", [_gsm8k_row(f"Question {i}?", f"{i},000") for i in range(20)])
    _jsonl(mirror / "sft/gsm8k/test.jsonl", [_gsm8k_row(f"Test question {i}?", str(i)) for i in range(5)]
           + [_gsm8k_row("Broken?", "n/a")])
    config = tmp_path / "rl.yaml"
    config.write_text("test_fraction: 0.2\nsources:\n"
                      "  - {name: arith, format: arithmetic, count: 40, levels: [1, 2], split: train, own_split: true}\n"
                      "  - {name: gsm8k, format: gsm8k, path: '${SPROUT_MIRROR}/sft/gsm8k/train.jsonl', "
                      "hub: openai/gsm8k, hub_config: main, split: train, own_split: true}\n"
                      "  - {name: gsm8k_test, format: gsm8k, path: '${SPROUT_MIRROR}/sft/gsm8k/test.jsonl', "
                      "hub: openai/gsm8k, hub_config: main, split: test, own_split: true}\n")
    out = tmp_path / "out"
    proc = _script("--config", str(config), "--mirror", str(mirror), "--out", str(out),
                   "--max-examples", "10", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert {k: v["read"] for k, v in manifest["sources"].items()} == {"arith": 10, "gsm8k": 10, "gsm8k_test": 6}
    assert manifest["dropped"] == {"unparsable_gold": 1}
    assert manifest["config"]["seed"] == 1 and "--max-examples" in manifest["command"]
    train, test = verify_prompts(out / "prompts.jsonl"), verify_prompts(out / "prompts_test.jsonl")
    assert train["errors"] == test["errors"] == []
    assert (train["valid"], test["valid"]) == (20, 5) == (manifest["files"]["train"]["records"],
                                                          manifest["files"]["test"]["records"])
    assert train["levels"] == {"1": 5, "2": 5, "null": 10}

    _jsonl(mirror / "sft/gsm8k/train.jsonl", [_gsm8k_row("q?", "1"), {"question": "x"}])
    proc = _script("--config", str(config), "--mirror", str(mirror), "--out", str(tmp_path / "out2"))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "train.jsonl:2: missing field 'answer'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ---- check_loss_mask on a prompt file ------------------------------------------------------

def _check_script(*args):
    return subprocess.run([sys.executable, "scripts/check_loss_mask.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    write_prompts(path, [_prompt(0, prompt=[{"role": "user", "content": "What is 2 + 2?"}], level=1),
                         _prompt(1, prompt=[{"role": "system", "content": "Answer with a number."},
                                            {"role": "user", "content": "What is 1 + 1?"},
                                            {"role": "assistant", "content": "2"},
                                            {"role": "user", "content": "And 20 + 2?"}], gold="22"),
                         _prompt(2, prompt=[{"role": "user", "content": " ".join(["many words"] * 40)}])])
    return path


def test_prompt_check_passes_shows_and_lists_long_prompts(tmp_path, tok):
    from sprout.chat import template_for
    from sprout.formats.maskcheck_prompts import check_prompts, format_prompt

    path = _prompt_file(tmp_path)
    lengths = [len(item.ids) for item in check_prompts(path, tok, template_for(tok), show=3).shown]
    assert lengths[2] > max(lengths[:2])
    report = check_prompts(path, tok, template_for(tok), seq_len=lengths[2], show=2)
    assert report.violations == [] and report.prompts == 3 and len(report.shown) == 2
    assert report.longest == lengths[2] and report.tokens == sum(lengths)
    assert [(line, pid) for line, pid, _ in report.too_long] == [(3, "q2")]
    text = format_prompt(report.shown[1], template_for(tok), tok, color=False)
    assert "line 2, gold 22, level None" in text
    assert text.rstrip("\n").endswith("And 20 + 2?<|endoftext|><|assistant|>")  # the generation header last
    assert text.count("<|user|>") == 2 and "<|system|>" in text


def test_check_loss_mask_script_on_a_prompt_file(tmp_path, sp):
    path, page = _prompt_file(tmp_path), tmp_path / "prompts.html"
    result = _check_script(path, "--tokenizer", sp.spec, "--seq-len", 100, "--html", page, "--no-color", "--show", 1)
    assert result.returncode == 0, result.stderr
    assert "OK: every prompt passes" in result.stdout and "too long: line 3 (q2)" in result.stdout
    assert "<|user|>What is 2 + 2?<|endoftext|><|assistant|>" in result.stdout  # the model's control ids
    html = page.read_text()
    assert html.startswith("<!doctype html>") and "What is 2 + 2?" in html and "trained'" not in html
    result = _check_script(path)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "--tokenizer" in result.stderr


def test_check_loss_mask_fails_a_bad_rendering_naming_the_line(tmp_path, sp, monkeypatch, capsys):
    """A renderer that changes a prompt token of line 2, or loses its generation header, fails."""
    import runpy

    from sprout.formats import maskcheck_prompts

    path = _prompt_file(tmp_path)
    real = maskcheck_prompts.render

    def crafted(messages, tok, add_generation_prompt=False):
        ids, mask = real(messages, tok, add_generation_prompt)
        if messages[-1]["content"] == "And 20 + 2?":
            ids = ids[:-3] + tok.encode("x")[:1] + ids[-2:]  # a token of the last user turn
        if messages[-1]["content"].startswith("many words"):
            ids, mask = ids[:-1], mask[:-1]
        return ids, mask

    monkeypatch.setattr(maskcheck_prompts, "render", crafted)
    monkeypatch.setattr(sys, "argv", ["check_loss_mask.py", str(path), "--tokenizer", sp.spec])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / "check_loss_mask.py"), run_name="__main__")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert f"FAIL {path}: line 2 (q1) position " in err and "turn 3 (user) decodes to" in err
    assert f"FAIL {path}: line 3 (q2): does not end with the assistant header" in err
    assert "line 1 " not in err


def test_dedup_off_warns_when_a_held_out_prompt_is_also_trained_on(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 2?", "gold": "4"}) + "\n")
    warned = []
    sources = [{"name": "a", "format": "jsonl", "path": str(path), "split": "train", "own_split": True},
               {"name": "b", "format": "jsonl", "path": str(path), "split": "test", "own_split": True}]
    manifest = prepare(PromptDataConfig(out=str(tmp_path / "out"), sources=sources, dedup=False),
                       log=lambda *_: None, warn=warned.append)
    assert manifest["split"]["in_both"] == 1
    assert [w for w in warned if "also in prompts.jsonl (dedup: false); PPO and GRPO refuse" in w], warned
    warned.clear()
    prepare(PromptDataConfig(out=str(tmp_path / "out2"), sources=sources), log=lambda *_: None, warn=warned.append)
    assert not [w for w in warned if "PPO and GRPO refuse" in w]  # dedup on: never in both
