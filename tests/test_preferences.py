"""Preference pairs: the JSONL contract (reader, verifier, writer) and the prep from
HH-RLHF, UltraFeedback, local JSONL and arithmetic, with fixtures in each source's format."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sprout.errors import SproutError
from sprout.formats.preference_pairs import read_preferences, verify_preferences, write_preferences
from sprout.prep.preference_data import Drop, PreferenceDataConfig, parse_hh, prepare, prompt_key
from sprout.prep.keys import is_val

ROOT = Path(__file__).resolve().parents[1]


def _pair(i=0, **extra):
    return {"id": f"p{i}", "source": "t", "prompt": [{"role": "user", "content": f"question {i}"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}], **extra}


def _jsonl(path: Path, rows, gz=False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def _hh(*turns) -> str:
    """An HH-RLHF transcript from (speaker, text) turns, as the dataset writes it."""
    return "".join(f"\n\n{who}: {text}" for who, text in turns)


def _run(tmp_path, sources, **cfg):
    out = tmp_path / "out"
    manifest = prepare(PreferenceDataConfig(out=str(out), sources=sources, **cfg), log=lambda *_: None)
    train = list(read_preferences(out / "preferences.jsonl"))
    test = list(read_preferences(out / "preferences_test.jsonl"))
    return manifest, train, test


# ---- the contract ------------------------------------------------------------------------

def test_contract_round_trip(tmp_path):
    rows = [_pair(0), _pair(1, margin=2.5), {**_pair(3), "rejected_kind": "near_miss"},
            {**_pair(2), "prompt": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]}]
    assert write_preferences(tmp_path / "p.jsonl", rows) == 4
    assert list(read_preferences(tmp_path / "p.jsonl")) == rows
    report = verify_preferences(tmp_path / "p.jsonl")
    assert report["errors"] == [] and report["valid"] == 4 and report["with_margin"] == 1
    assert report["sources"] == {"t": 4}


BAD_RECORDS = [
    ({k: v for k, v in _pair().items() if k != "rejected"}, "missing key"),
    ({**_pair(), "extra": 1}, "unknown key"),
    ({**_pair(), "id": ""}, "'id'"),
    ({**_pair(), "prompt": [{"role": "bot", "content": "x"}]}, "unknown role"),
    ({**_pair(), "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "end with a user"),
    ({**_pair(), "prompt": []}, "non-empty list"),
    ({**_pair(), "chosen": [{"role": "user", "content": "x"}]}, "one assistant message"),
    ({**_pair(), "chosen": []}, "non-empty list"),
    ({**_pair(), "rejected": [{"role": "assistant", "content": "  "}]}, "'rejected' is empty"),
    ({**_pair(), "rejected": [{"role": "assistant", "content": "good "}]}, "same text"),
    ({**_pair(), "chosen": [{"role": "assistant", "content": 5}]}, "must be a string"),
    ({**_pair(), "margin": "big"}, "margin"),
    ({**_pair(), "rejected_kind": "Near miss"}, "'rejected_kind' must be a lowercase identifier"),
    ({**_pair(), "rejected_kind": 3}, "'rejected_kind' must be a lowercase identifier"),
    ({**_pair(), "prompt": [{"role": "user", "content": "a <|user|> b"}]}, "reserved marker"),
    ("[1, 2]", "JSON object"),
    ("{not json", "invalid JSON"),
]


@pytest.mark.parametrize("record,message", BAD_RECORDS)
def test_reader_refuses_with_file_and_line(tmp_path, record, message):
    path = _jsonl(tmp_path / "p.jsonl", [_pair(0), record])
    with pytest.raises(SproutError) as err:
        list(read_preferences(path))
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)
    assert "\n" not in str(err.value)
    report = verify_preferences(path)
    assert report["records"] == 2 and report["valid"] == 1
    assert len(report["errors"]) == 1 and report["errors"][0].startswith(f"{path}:2: ")


def test_repeated_id_and_writer_refusal(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [_pair(0), _pair(0)])
    with pytest.raises(SproutError, match=r":2: id 'p0' repeats line 1"):
        list(read_preferences(path))
    with pytest.raises(SproutError, match="same text"):
        write_preferences(tmp_path / "w.jsonl", [{**_pair(), "rejected": _pair()["chosen"]}])
    assert not (tmp_path / "w.jsonl").exists()  # atomic: nothing half-written


# ---- HH-RLHF -----------------------------------------------------------------------------

def test_parse_hh_keeps_turns():
    text = _hh(("Human", "hi"), ("Assistant", "hello"), ("Human", "a joke?"), ("Assistant", "no"))
    assert parse_hh(text) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "a joke?"}, {"role": "assistant", "content": "no"}]
    inline = _hh(("Human", "say Human: twice"), ("Assistant", "ok"))
    assert parse_hh(inline)[0]["content"] == "say Human: twice"  # only turn starts split


@pytest.mark.parametrize("text", [
    "hello" + _hh(("Human", "hi"), ("Assistant", "x")),  # text before the first turn
    _hh(("Human", "hi"), ("Human", "again"), ("Assistant", "x")),  # not alternating
    _hh(("Human", "hi"), ("Assistant", "x"), ("Human", "more")),  # ends with the human
    _hh(("Assistant", "x"), ("Human", "hi"), ("Assistant", "y")),  # starts with the assistant
    "no turns at all",
])
def test_parse_hh_malformed(text):
    with pytest.raises(Drop) as drop:
        parse_hh(text)
    assert drop.value.reason == "malformed_transcript"


def test_hh_source_counts_every_drop(tmp_path):
    base = [("Human", "what is a pen?"), ("Assistant", "a tool"), ("Human", "and a pencil?")]
    rows = [
        {"chosen": _hh(*base, ("Assistant", "also a tool")), "rejected": _hh(*base, ("Assistant", "no idea"))},
        {"chosen": _hh(("Human", "q2"), ("Assistant", "yes")), "rejected": _hh(("Human", "q2"), ("Assistant", "no"))},
        {"chosen": _hh(*base, ("Assistant", "fine")),  # earlier turns differ
         "rejected": _hh(("Human", "what is a pen?"), ("Assistant", "A TOOL"), ("Human", "and a pencil?"), ("Assistant", "x"))},
        {"chosen": _hh(("Human", "q3"), ("Assistant", "")), "rejected": _hh(("Human", "q3"), ("Assistant", "no"))},
        {"chosen": _hh(("Human", "q4"), ("Assistant", "same")), "rejected": _hh(("Human", "q4"), ("Assistant", "same"))},
        {"chosen": _hh(("Human", "q5"), ("Human", "q5b"), ("Assistant", "a")), "rejected": _hh(("Human", "q5"), ("Assistant", "b"))},
        {"chosen": _hh(("Human", "q2"), ("Assistant", "yes")), "rejected": _hh(("Human", "q2"), ("Assistant", "no"))},
    ]
    path = _jsonl(tmp_path / "test.jsonl.gz", rows, gz=True)
    manifest, train, test = _run(tmp_path, [{"name": "hh", "format": "hh_rlhf", "path": str(path)}])
    counts = manifest["sources"]["hh"]
    assert counts["read"] == 7 and counts["train"] + counts["test"] == 2
    assert counts["dropped_mismatched_turns"] == 1 and counts["dropped_empty_side"] == 1
    assert counts["dropped_identical_sides"] == 1 and counts["dropped_malformed_transcript"] == 1
    assert counts["duplicates"] == 1
    assert manifest["dropped"] == {"empty_side": 1, "identical_sides": 1, "malformed_transcript": 1, "mismatched_turns": 1}
    multi = next(r for r in train + test if len(r["prompt"]) == 3)
    assert multi["prompt"] == [{"role": "user", "content": "what is a pen?"}, {"role": "assistant", "content": "a tool"},
                               {"role": "user", "content": "and a pencil?"}]
    assert multi["chosen"] == [{"role": "assistant", "content": "also a tool"}]
    assert multi["rejected"] == [{"role": "assistant", "content": "no idea"}]


def test_hh_row_missing_a_field_names_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "hh.jsonl", [{"chosen": _hh(("Human", "q"), ("Assistant", "a")),
                                           "rejected": _hh(("Human", "q"), ("Assistant", "b"))},
                                          {"chosen": _hh(("Human", "q"), ("Assistant", "a"))}])
    with pytest.raises(SproutError, match=rf"^{path}:2: missing field 'rejected'"):
        _run(tmp_path, [{"name": "hh", "format": "hh_rlhf", "path": str(path)}])


# ---- UltraFeedback and TRL forms ------------------------------------------------------------

def test_ultrafeedback_both_forms_and_margin(tmp_path):
    flat = {"prompt": "Write a haiku.", "chosen": "Leaves fall", "rejected": "No.", "source_index": 3,
            "metadata": {"score_chosen": 9.0, "score_rejected": 6.5}}
    lists = {"prompt": "Name a colour.", "prompt_id": "abc",
             "chosen": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
             "rejected": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Seven."}],
             "messages": [], "score_chosen": 8, "score_rejected": 2}
    same = {**flat, "prompt": "Say hi.", "chosen": "hi", "rejected": "hi"}
    path = _jsonl(tmp_path / "uf.jsonl", [flat, lists, same])
    src = {"name": "uf", "format": "ultrafeedback", "path": str(path), "margin": True}
    manifest, train, test = _run(tmp_path, [src])
    got = {r["prompt"][0]["content"]: r for r in train + test}
    assert got["Write a haiku."]["margin"] == 2.5 and got["Name a colour."]["margin"] == 6.0
    assert got["Name a colour."]["prompt"] == [{"role": "user", "content": "Name a colour."}]
    assert got["Name a colour."]["chosen"] == [{"role": "assistant", "content": "Blue."}]
    assert manifest["sources"]["uf"]["dropped_identical_sides"] == 1
    _, train, test = _run(tmp_path, [{**src, "margin": False}])
    assert all("margin" not in r for r in train + test)


def test_margin_asked_without_scores_names_the_line(tmp_path):
    path = _jsonl(tmp_path / "uf.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(SproutError, match=rf"^{path}:1: margin asked but 'score_chosen'"):
        _run(tmp_path, [{"name": "uf", "format": "ultrafeedback", "path": str(path), "margin": True}])


def test_local_jsonl_trl_forms_and_contract(tmp_path):
    rows = [
        {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},  # TRL plain strings
        {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "assistant", "content": "Go away."}]},  # TRL conversational
        {"chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
         "rejected": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Green."}]},  # implicit prompt
        {**_pair(7), "margin": 1.5, "rejected_kind": "off_topic"},  # the contract itself
    ]
    path = _jsonl(tmp_path / "mine.jsonl", rows)
    _, train, test = _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}])
    got = {r["prompt"][-1]["content"]: r for r in train + test}
    assert set(got) == {"What is 2+2?", "Hi", "Sky?", "question 7"}
    assert got["What is 2+2?"]["chosen"] == [{"role": "assistant", "content": "4"}]
    assert got["Sky?"]["prompt"] == [{"role": "user", "content": "Sky?"}]
    assert got["question 7"]["margin"] == 1.5 and got["question 7"]["source"] == "mine"
    assert got["question 7"]["rejected_kind"] == "off_topic" and "rejected_kind" not in got["Hi"]


@pytest.mark.parametrize("row,message", [
    ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' must be a string or a non-empty list"),
    ({"prompt": [{"role": "robot", "content": "q"}], "chosen": "a", "rejected": "b"}, "prompt[0] must be"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "chosen": "a",
      "rejected": "b"}, "must end with a user turn"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "one assistant message"),
    ({"chosen": "a", "rejected": "b"}, "plain strings"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "x"}, "'margin' must be a finite number"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "rejected_kind": "near miss"}, "'rejected_kind' must be"),
    ("not json", "invalid JSON"),
    ("[1]", "expected a JSON object"),
])
def test_local_jsonl_bad_line_names_file_and_line(tmp_path, row, message):
    path = _jsonl(tmp_path / "mine.jsonl", [{"prompt": "ok", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(SproutError) as err:
        _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}])
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)


# ---- arithmetic, split, dedup ----------------------------------------------------------

def test_arithmetic_pairs(tmp_path):
    manifest, train, test = _run(tmp_path, [{"name": "arith", "format": "arithmetic", "count": 60,
                                             "levels": [2, 4], "broken_format_fraction": 0.5}], dev_fraction=0.0)
    from sprout.answers import parse_answer

    pairs = train + test
    assert len(pairs) == 60
    counts = manifest["sources"]["arith"]
    assert counts["rejected_near_miss"] + counts["rejected_broken_format"] == 60
    assert counts["rejected_near_miss"] > 10 and counts["rejected_broken_format"] > 10
    for r in pairs:
        question = r["prompt"][0]["content"]
        gold = str(eval(question[len("What is "):-1], {"__builtins__": {}}))
        assert parse_answer(r["chosen"][0]["content"], strict=True) == gold
        assert parse_answer(r["rejected"][0]["content"]) != gold
        # each pair says how its wrong answer was made: a near miss parses (strictly) to a wrong number
        near = parse_answer(r["rejected"][0]["content"], strict=True) is not None
        assert r["rejected_kind"] == ("near_miss" if near else "broken_format")
    assert sum(r["rejected_kind"] == "near_miss" for r in pairs) == counts["rejected_near_miss"]


def test_split_by_prompt_and_dedup(tmp_path):
    rows = []
    for i in range(60):  # two different pairs per prompt, and one exact repeat
        rows += [{"prompt": f"prompt {i}", "chosen": "yes", "rejected": "no"},
                 {"prompt": f"prompt {i}", "chosen": "sure", "rejected": "never"}]
    rows.append(rows[0])
    a = _jsonl(tmp_path / "a.jsonl", rows)
    b = _jsonl(tmp_path / "b.jsonl", rows[:4])  # a second source repeating the first's pairs
    manifest, train, test = _run(tmp_path, [{"name": "a", "format": "jsonl", "path": str(a)},
                                            {"name": "b", "format": "jsonl", "path": str(b)}], test_fraction=0.3,
                                 dev_fraction=0.0)
    assert manifest["sources"]["a"]["duplicates"] == 1 and manifest["sources"]["b"]["duplicates"] == 4
    assert len(train) + len(test) == 120 and 10 < len(test) < 60
    train_prompts = {r["prompt"][0]["content"] for r in train}
    test_prompts = {r["prompt"][0]["content"] for r in test}
    assert not train_prompts & test_prompts
    assert all(is_val(prompt_key(r["prompt"]), 0.3) for r in test)
    assert manifest["files"]["test"]["records"] == len(test)
    _, train2, test2 = _run(tmp_path, [{"name": "a", "format": "jsonl", "path": str(a)}], test_fraction=0.3, dedup=False,
                              dev_fraction=0.0)
    assert len(train2) + len(test2) == 121


def test_output_is_deterministic(tmp_path):
    src = [{"name": "arith", "format": "arithmetic", "count": 30}]
    _run(tmp_path / "1", src, seed=5)
    _run(tmp_path / "2", src, seed=5)
    for name in ("preferences.jsonl", "preferences_test.jsonl"):
        assert (tmp_path / "1/out" / name).read_bytes() == (tmp_path / "2/out" / name).read_bytes()


def test_bad_config_is_one_line(tmp_path):
    with pytest.raises(SproutError, match=r"sources\[0\] \(x\): unknown format 'csv'"):
        _run(tmp_path, [{"name": "x", "format": "csv", "path": "/x"}])
    with pytest.raises(SproutError, match="levels"):
        _run(tmp_path, [{"name": "x", "format": "arithmetic", "count": 3, "levels": [9]}])
    with pytest.raises(SproutError, match="source file not found"):
        _run(tmp_path, [{"name": "x", "format": "jsonl", "path": str(tmp_path / "missing.jsonl")}])


# ---- the script --------------------------------------------------------------------------

def _script(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts/prepare_preference_data.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_script_end_to_end(tmp_path):
    mirror = tmp_path / "mirror"
    (mirror / "prefs").mkdir(parents=True)
    _jsonl(mirror / "prefs/hh.jsonl.gz", [
        {"chosen": _hh(("Human", f"q{i}"), ("Assistant", "kind")), "rejected": _hh(("Human", f"q{i}"), ("Assistant", "rude"))}
        for i in range(20)], gz=True)
    config = tmp_path / "prefs.yaml"
    config.write_text("test_fraction: 0.2\nsources:\n"
                      "  - {name: hh, format: hh_rlhf, path: '${SPROUT_MIRROR}/prefs/hh.jsonl.gz', hub: Anthropic/hh-rlhf}\n"
                      "  - {name: arith, format: arithmetic, count: 40}\n")
    out = tmp_path / "out"
    proc = _script("--config", str(config), "--mirror", str(mirror), "--out", str(out),
                   "--max-examples", "10", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"]["hh"]["read"] == 10 and manifest["sources"]["arith"]["read"] == 40
    assert manifest["config"]["seed"] == 1 and "--max-examples" in manifest["command"]
    files = ("preferences.jsonl", "preferences_dev.jsonl", "preferences_test.jsonl")
    total = sum(verify_preferences(out / f)["valid"] for f in files)
    assert total == 50 == sum(manifest["files"][split]["records"] for split in ("train", "dev", "test"))

    _jsonl(mirror / "prefs/hh.jsonl.gz", [{"chosen": "x"}], gz=True)
    proc = _script("--config", str(config), "--mirror", str(mirror), "--out", str(tmp_path / "out2"))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "hh.jsonl.gz:1: missing field 'rejected'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_pairs_the_chat_template_refuses_are_counted(tmp_path):
    path = _jsonl(tmp_path / "mine.jsonl", [{"prompt": "ok", "chosen": "a", "rejected": "b"},
                                           {"prompt": "say <|user|> please", "chosen": "a", "rejected": "b"},
                                           {"prompt": "q", "chosen": "a <|endoftext|>", "rejected": "b"},
                                           {"prompt": "   ", "chosen": "a", "rejected": "b"}])
    manifest, train, test = _run(tmp_path, [{"name": "mine", "format": "jsonl", "path": str(path)}])
    assert len(train) + len(test) == 1
    assert manifest["dropped"] == {"reserved_marker": 2, "empty_content": 1}
