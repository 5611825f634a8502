"""The dev and test splits of the evaluation tasks: arithmetic's three splits (the test set as
before), GSM8K's dev slice, the preps leaving held-out problems out of train data and recording it,
and the trainers refusing a train file that holds one or lacks the record."""

import gzip
import json
import sys
from pathlib import Path

import h5py
import pytest

from proc import one_error, run_here
from sprout.errors import SproutError
from sprout.prep import arithmetic
from sprout.prep.held_out import (SETS, arithmetic_set, check_record, check_train_jsonl, gsm8k_split,
                                  messages_held_out_set, slice_digest)
from sprout.prep.keys import is_val, text_key

ROOT = Path(__file__).resolve().parents[1]


def _question(split: str, level: int = 2) -> str:
    return next(arithmetic.generate(1, [level], seed=0, split=split)).question


def _user(text: str) -> list:
    return [{"role": "user", "content": text}]


def _jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _gsm8k_rows(n: int, prefix: str = "How many apples") -> list[dict]:
    return [{"question": f"{prefix} number {i}?", "answer": f"Count them.\n#### {i}"} for i in range(n)]


def _gsm8k_dev(n: int, prefix: str = "How many apples") -> set[str]:
    return {r["question"] for r in _gsm8k_rows(n, prefix) if gsm8k_split(r["question"]) == "dev"}


# ---- the rules -----------------------------------------------------------------------------

def test_arithmetic_test_set_is_unchanged_and_dev_comes_from_train():
    everything = [p.question for p in arithmetic.generate(5000, seed=0, split="all")]
    for q in everything:  # the test rule is the one test problems always had
        assert (arithmetic.question_split(q) == "test") == is_val(text_key(q), arithmetic.TEST_FRACTION)
    dev = [p.question for p in arithmetic.generate(300, seed=0, split="dev")]
    assert len(set(dev)) == 300 and all(is_val(text_key("dev:" + q), arithmetic.DEV_FRACTION) for q in dev)
    train = {p.question for p in arithmetic.generate(3000, seed=0, split="train")}
    test = {p.question for p in arithmetic.generate(300, seed=0, split="test")}
    assert not train & set(dev) and not train & test and not test & set(dev)
    share = sum(arithmetic.question_split(q) == "dev" for q in everything) / len(everything)
    assert 0.05 < share < 0.15  # DEV_FRACTION of the 90 % that are not test


def test_held_out_sets_of_questions():
    assert arithmetic_set(_question("dev")) == "arithmetic_dev"
    assert arithmetic_set(_question("test")) == "arithmetic_test"
    assert arithmetic_set(_question("train")) is None and arithmetic_set("What is twice 3?") is None
    # an appended instruction (RL prompts) does not hide the question; any user turn counts
    assert messages_held_out_set(_user(_question("test") + "\n\nThink step by step.")) == "arithmetic_test"
    assert messages_held_out_set([*_user("hi"), {"role": "assistant", "content": "hello"},
                                  *_user(_question("dev"))]) == "arithmetic_dev"
    dev = sorted(_gsm8k_dev(200))
    assert dev and messages_held_out_set(_user(dev[0]), "train") == "gsm8k_dev"
    assert messages_held_out_set(_user(dev[0])) is None  # not a GSM8K record: the slice is GSM8K's
    assert messages_held_out_set(_user("anything"), "test") == "gsm8k_test"
    assert 2 <= len(dev) <= 20  # about 5 % of 200


# ---- the preps -----------------------------------------------------------------------------

def test_sft_prep_leaves_held_out_problems_out_and_records_it(r50k, tmp_path):
    from sprout.formats.packed_sft import SFTFile
    from sprout.prep.sft_data import SFTDataConfig, prepare

    gsm8k = _jsonl(tmp_path / "gsm8k.jsonl", _gsm8k_rows(200))
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": [*_user(q), {"role": "assistant", "content": "ok"}]}
                                            for q in (_question("dev"), _question("test"), _question("train"))])
    out = tmp_path / "sft" / "sft.h5"
    result = prepare(SFTDataConfig(tokenizer=r50k.spec, out=str(out), seq_len=128, val_fraction=0.0, sources=[
        {"name": "gsm8k", "format": "gsm8k", "path": str(gsm8k)}, {"name": "chat", "format": "chat", "path": str(chat)},
        {"name": "arith", "format": "arithmetic", "count": 50, "levels": [2]}]), r50k, log=lambda *_: None)
    n_dev = len(_gsm8k_dev(200))
    assert result["sources"]["gsm8k"]["dropped_held_out"] == n_dev
    assert result["sources"]["chat"]["dropped_held_out"] == 2 and result["sources"]["chat"]["train"] == 1
    assert "dropped_held_out" not in result["sources"]["arith"]  # the generator's train split only
    with SFTFile(out) as f:
        record = f.attrs["held_out"]
    assert record["sets"] == list(SETS)
    assert record["dropped"] == {"arithmetic_dev": 1, "arithmetic_test": 1, "gsm8k_dev": n_dev, "gsm8k_test": 0}
    assert record["gsm8k_dev_slice"] == slice_digest(_gsm8k_dev(200)) and record["gsm8k_dev_slice"]["questions"] == n_dev
    with pytest.raises(SproutError, match=r"^sources\[0\]\.split \(g\) of the config: 'test', but SFT reads GSM8K's train split only"):
        prepare(SFTDataConfig(tokenizer=r50k.spec, out=str(tmp_path / "x" / "sft.h5"), sources=[
            {"name": "g", "format": "gsm8k", "hub": "openai/gsm8k", "split": "test"}]), r50k, log=lambda *_: None)


def test_rl_prompt_prep_writes_dev_and_keeps_train_free_of_held_out_problems(tmp_path):
    from sprout.formats.prompts import read_prompts
    from sprout.prep.rl_prompts import PromptDataConfig, prepare

    gsm8k = _jsonl(tmp_path / "train.jsonl", _gsm8k_rows(200))
    mine = _jsonl(tmp_path / "mine.jsonl", [{"prompt": _question("test"), "gold": "1"}])
    out = tmp_path / "rl"
    manifest = prepare(PromptDataConfig(out=str(out), dev_fraction=0.0, test_fraction=0.0, sources=[
        {"name": "gsm8k", "format": "gsm8k", "path": str(gsm8k), "split": "train", "own_split": True},
        {"name": "gsm8k_dev", "format": "gsm8k", "path": str(gsm8k), "split": "dev", "own_split": True},
        {"name": "arith_dev", "format": "arithmetic", "count": 20, "split": "dev", "own_split": True},
        {"name": "mine", "format": "jsonl", "path": str(mine)}]), log=lambda *_: None, warn=lambda *_: None)
    train, dev = list(read_prompts(out / "prompts.jsonl")), list(read_prompts(out / "prompts_dev.jsonl"))
    dev_questions = _gsm8k_dev(200)
    assert {r["prompt"][0]["content"] for r in dev if r["source"] == "gsm8k_dev"} == dev_questions
    assert sum(r["source"] == "arith_dev" for r in dev) == 20
    assert len(train) == 200 - len(dev_questions) and not {r["prompt"][0]["content"] for r in train} & dev_questions
    assert manifest["held_out"]["gsm8k_dev_slice"] == slice_digest(dev_questions)  # read twice, kept once
    assert manifest["held_out"]["dropped"] == {"arithmetic_dev": 0, "arithmetic_test": 1,
                                               "gsm8k_dev": len(dev_questions), "gsm8k_test": 0}
    assert manifest["files"]["dev"]["path"] == "prompts_dev.jsonl" and manifest["sources"]["gsm8k_dev"]["split"] == "dev"
    check_train_jsonl(out / "prompts.jsonl", read_prompts(out / "prompts.jsonl"))  # what the prep wrote passes


def test_gsm8k_dev_questions_in_any_rl_source_are_held_out_by_the_prep_and_the_trainers_check(tmp_path):
    """GSM8K's dev slice is held out of an RL train file whichever source holds it: the prep drops
    a local JSONL prompt that is a dev question (its instruction appended or not), and the trainers'
    check (`check_train_jsonl`) refuses one added by hand, reading the slice from the GSM8K file the
    prep's config names; with that file gone the prep's record is trusted, and it says so."""
    from sprout.formats.prompts import read_prompts
    from sprout.prep.rl_prompts import PromptDataConfig, prepare

    gsm8k = _jsonl(tmp_path / "gsm8k" / "train.jsonl", _gsm8k_rows(200))
    dev = sorted(_gsm8k_dev(200))
    instruction = "Show your work."
    mine = _jsonl(tmp_path / "mine.jsonl", [{"prompt": dev[0], "gold": "1"},
                                            {"prompt": f"{dev[1]}\n\n{instruction}", "gold": "2"},
                                            {"prompt": "How many pears are there?", "gold": "3"}])
    out = tmp_path / "rl"
    manifest = prepare(PromptDataConfig(out=str(out), dev_fraction=0.0, test_fraction=0.0, instruction=instruction,
                                        sources=[{"name": "gsm8k", "format": "gsm8k", "path": str(gsm8k)},
                                                 {"name": "mine", "format": "jsonl", "path": str(mine)}]),
                       log=lambda *_: None, warn=lambda *_: None)
    train = list(read_prompts(out / "prompts.jsonl"))
    assert [r["prompt"][0]["content"] for r in train if r["source"] == "mine"] == ["How many pears are there?"]
    assert manifest["sources"]["mine"]["dropped_held_out"] == 2
    assert manifest["held_out"]["dropped"]["gsm8k_dev"] == len(dev) + 2  # gsm8k's own and mine's
    note = check_train_jsonl(out / "prompts.jsonl", train)
    assert note.endswith(f"{len(dev)} questions of GSM8K's dev slice, from {gsm8k})")
    leak = {"id": "mine-leak", "source": "mine", "prompt": _user(f"{dev[2]}\n\n{instruction}"), "gold": "4",
            "level": None}
    with pytest.raises(SproutError) as err:
        check_train_jsonl(out / "prompts.jsonl", [*train, leak])
    assert str(err.value).startswith(f"{out / 'prompts.jsonl'}: record 'mine-leak' is a held-out problem (gsm8k_dev)")
    gsm8k.unlink()
    note = check_train_jsonl(out / "prompts.jsonl", [*train, leak])
    assert "GSM8K's train file not readable here (" in note and note.endswith(", the prep's record trusted)")


def test_the_trainers_read_gsm8k_s_dev_slice_from_the_prep_s_files_only(tmp_path):
    """`prep_dev_slice`: a `dev` source reads the train file's slice; a source the prep read from
    the hub is not read again (the others' files are, and the slice is then not whole), and with
    no file the record is trusted; a config without GSM8K, or none at all, says so; keys it does
    not need are passed over; `max_examples` reads the first rows of each source, as SFT's prep."""
    from sprout.prep.held_out import gsm8k_split, prep_dev_slice

    rows = _gsm8k_rows(200)
    gsm8k = _jsonl(tmp_path / "train.jsonl", rows)
    dev = _gsm8k_dev(200)
    on_file = {"name": "gsm8k_dev", "format": "gsm8k", "path": str(gsm8k), "split": "dev", "own_split": True}
    hub = {"name": "gsm8k_hub", "format": "gsm8k", "hub": "openai/gsm8k", "hub_config": "main"}
    assert prep_dev_slice({"sources": [on_file]}) == (dev, f"{len(dev)} questions of GSM8K's dev slice, from {gsm8k}",
                                                      True)
    questions, note, whole = prep_dev_slice({"sources": [on_file, hub]})
    assert questions == dev and note.endswith("; gsm8k_hub read from the hub, not read again") and not whole
    assert prep_dev_slice({"sources": [hub]}) == (None, "GSM8K read from the hub by the prep, not read again, "
                                                        "the prep's record trusted", False)
    test_only = {**on_file, "split": "test"}
    assert prep_dev_slice({"sources": [test_only]}).note == "the prep's config names no GSM8K train-split source"
    assert prep_dev_slice({}) == (None, "no prep config recorded, the prep's record trusted", False)
    assert prep_dev_slice({"sources": [{**on_file, "an_earlier_key": 1}]}).questions == dev  # what it needs, read
    first = {r["question"].strip() for r in rows[:50]} & dev
    assert 0 < len(first) < len(dev) and all(gsm8k_split(q) == "dev" for q in first)
    assert prep_dev_slice({"sources": [on_file]}, max_examples=50).questions == first


def test_preference_prep_leaves_held_out_problems_out(tmp_path):
    from sprout.prep.preference_data import PreferenceDataConfig, prepare

    rows = [{"prompt": q, "chosen": "<answer>1</answer>", "rejected": "no"}
            for q in (_question("dev"), _question("test"), _question("train"))]
    manifest = prepare(PreferenceDataConfig(out=str(tmp_path / "p"), test_fraction=0.0, dev_fraction=0.0, sources=[
        {"name": "mine", "format": "jsonl", "path": str(_jsonl(tmp_path / "mine.jsonl", rows))}]), log=lambda *_: None)
    assert manifest["sources"]["mine"]["dropped_held_out"] == 2 and manifest["files"]["train"]["records"] == 1
    assert manifest["held_out"]["dropped"]["arithmetic_dev"] == manifest["held_out"]["dropped"]["arithmetic_test"] == 1


# ---- the refusals --------------------------------------------------------------------------

def test_a_prepared_file_without_the_record_is_refused(tmp_path):
    path = _jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "source": "s", "prompt": _user("hi"), "gold": "1",
                                                "level": None}])
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {}, "sources": {}}))
    with pytest.raises(SproutError, match=r"manifest.json: no held_out record \(that the prep excluded the held-out problems"):
        check_train_jsonl(path, [json.loads(path.read_text())])
    with pytest.raises(SproutError, match="sft.h5: no held_out record"):
        check_record(None, "sft.h5")


def test_a_gsm8k_dev_question_in_a_prepared_train_file_is_refused(tmp_path):
    question = sorted(_gsm8k_dev(200))[0]
    record = {"id": "gsm8k-1", "source": "gsm8k", "prompt": _user(f"{question}\n\nShow your work."), "gold": "1"}
    path = _jsonl(tmp_path / "prompts.jsonl", [record])
    (tmp_path / "manifest.json").write_text(json.dumps({
        "held_out": {"sets": list(SETS)}, "sources": {"gsm8k": {"format": "gsm8k"}},
        "instruction": "Show your work."}))
    with pytest.raises(SproutError) as err:
        check_train_jsonl(path, [record])
    assert str(err.value).startswith(f"{path}: record 'gsm8k-1' is a held-out problem (gsm8k_dev)")


def test_a_gsm8k_test_question_in_a_prepared_train_file_is_refused(tmp_path):
    record = {"id": "gsm8k_test-1", "source": "gsm8k_test", "prompt": _user("How many pears number 3?"), "gold": "3"}
    path = _jsonl(tmp_path / "prompts.jsonl", [record])
    (tmp_path / "manifest.json").write_text(json.dumps({
        "held_out": {"sets": list(SETS)}, "instruction": None,
        "sources": {"gsm8k_test": {"format": "gsm8k", "split": "test", "own_split": None}}}))
    with pytest.raises(SproutError) as err:
        check_train_jsonl(path, [record])
    assert str(err.value).startswith(f"{path}: record 'gsm8k_test-1' is a held-out problem (gsm8k_test)")


def _run(script: str, *args):
    return run_here([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], cwd=ROOT)


def test_an_rl_trainer_refuses_a_train_file_holding_a_test_problem(sp, tmp_path):
    from grpo_fixtures import write_prompt_files
    from preference_train_fixtures import write_lm

    data = write_prompt_files(tmp_path / "prompts")
    with data.open("a") as f:
        f.write(json.dumps({"id": "leak", "source": "arithmetic", "prompt": _user(_question("test", 1)),
                            "gold": "0", "level": 1}) + "\n")
    init, out = write_lm(tmp_path / "lm", sp), tmp_path / "run"
    proc = _run("train_grpo.py", "--data", data, "--init", init, "--out", out, "--batch.global_prompts", "2",
                "--batch.num_generations", "2", "--batch.micro_completions", "2", "--data.max_prompt_length", "24",
                "--rollout.max_completion_length", "8", "--data.sources", "null", "--train.max_steps", "1")
    one_error(proc, f"{data}: record 'leak' is a held-out problem (arithmetic_test)")
    assert not out.exists()


def test_an_rl_trainer_refuses_a_train_file_sharing_a_prompt_with_the_sealed_test_file(sp, tmp_path):
    from grpo_fixtures import write_prompt_files
    from preference_train_fixtures import write_lm

    data = write_prompt_files(tmp_path / "prompts")
    trained = json.loads(data.read_text().splitlines()[3])
    with (data.parent / "prompts_test.jsonl").open("a") as f:
        f.write(json.dumps({**trained, "id": "sealed-copy"}) + "\n")
    init, out = write_lm(tmp_path / "lm", sp), tmp_path / "run"
    proc = _run("train_grpo.py", "--data", data, "--init", init, "--out", out, "--batch.global_prompts", "2",
                "--batch.num_generations", "2", "--batch.micro_completions", "2", "--data.max_prompt_length", "24",
                "--rollout.max_completion_length", "8", "--data.sources", "null", "--train.max_steps", "1")
    line = one_error(proc, f"{data.parent / 'prompts_test.jsonl'}: 1 held-out prompt(s) also in the train file "
                           f"{data} (first: 'sealed-copy', the prompt of train id {trained['id']!r})")
    assert line.endswith("prepare the prompts again") and not out.exists()


def test_a_preference_trainer_refuses_a_train_file_holding_a_dev_problem(sp, tmp_path):
    from preference_train_fixtures import cli_flags, write_lm, write_pairs

    data = write_pairs(tmp_path / "prefs")
    with data.open("a") as f:
        f.write(json.dumps({"id": "leak", "source": "synthetic", "prompt": _user(_question("dev", 1)),
                            "chosen": [{"role": "assistant", "content": "a"}],
                            "rejected": [{"role": "assistant", "content": "b"}]}) + "\n")
    init, out = write_lm(tmp_path / "lm", sp), tmp_path / "run"
    proc = _run("train_reward.py", *cli_flags(data, init, out))
    one_error(proc, f"{data}: record 'leak' is a held-out problem (arithmetic_dev)")
    assert not out.exists()


def test_the_sft_trainer_refuses_a_file_without_the_record(sp, tmp_path):
    from preference_train_fixtures import write_lm
    from sprout.prep.sft_data import SFTDataConfig, prepare

    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": [*_user(f"Tell me story {i}."),
                                                         {"role": "assistant", "content": "Once upon a time."}]}
                                           for i in range(40)])
    data = tmp_path / "sft" / "sft.h5"
    prepare(SFTDataConfig(tokenizer=sp.spec, out=str(data), seq_len=32, val_fraction=0.2,
                          sources=[{"name": "chat", "format": "chat", "path": str(src)}]), sp, log=lambda *_: None)
    with h5py.File(data, "a") as f:
        del f.attrs["held_out"]
    init, out = write_lm(tmp_path / "lm", sp), tmp_path / "run"
    proc = _run("train_sft.py", "--data", data, "--init", init, "--out", out, "--batch.global_tokens", "64",
                "--batch.micro_tokens", "64", "--train.max_steps", "1", "--train.progress", "false",
                "--train.peak_tflops", "-1")
    one_error(proc, f"{data}: no held_out record (that the prep excluded the held-out problems")
    assert not out.exists()


def _sft_file(sp, path: Path, sources: list, seq_len: int) -> Path:
    from sprout.prep.sft_data import SFTDataConfig, prepare

    prepare(SFTDataConfig(tokenizer=sp.spec, out=str(path), seq_len=seq_len, val_fraction=0.2, sources=sources), sp,
            log=lambda *_: None)
    return path


def _train_sft(data: Path, init: Path, out: Path, seq_len: int):
    return _run("train_sft.py", "--data", data, "--init", init, "--out", out, "--batch.global_tokens", seq_len,
                "--batch.micro_tokens", seq_len, "--train.max_steps", "1", "--train.progress", "false",
                "--train.peak_tflops", "-1", "--sample_prompts", "[]")


def test_the_sft_trainer_refuses_a_file_holding_a_held_out_problem(sp, tmp_path, monkeypatch):
    """The trainer reads every packed conversation's user turns back: a prep that let an arithmetic
    test problem or a question of GSM8K's dev slice through (its record says it left them out) is
    refused naming the row and the set, before the run folder exists; what a prep wrote passes."""
    from preference_train_fixtures import write_lm
    from sprout.prep.held_out import HeldOut

    dev = sorted(_gsm8k_dev(200))
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": [*_user(q), {"role": "assistant", "content": "Ten."}]}
                                            for q in [f"Tell me story {i}." for i in range(30)]
                                            + [p.question for p in arithmetic.generate(8, seed=0, split="test")]
                                            + dev[:3]])  # GSM8K dev questions in another source
    gsm8k = tmp_path / "gsm8k" / "train.jsonl.gz"
    gsm8k.parent.mkdir()
    gsm8k.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in _gsm8k_rows(200)).encode()))
    sources = [{"name": "chat", "format": "chat", "path": str(chat)}, {"name": "g", "format": "gsm8k", "path": str(gsm8k)}]
    init = write_lm(tmp_path / "lm", sp)
    clean = _sft_file(sp, tmp_path / "clean" / "sft.h5", sources, 64)
    with h5py.File(clean) as f:  # the prep left out the dev slice's questions from the chat source too
        assert json.loads(f.attrs["held_out"])["dropped"]["gsm8k_dev"] == len(dev) + 3
    proc = _train_sft(clean, init, tmp_path / "run_clean", 64)
    assert proc.returncode == 0, proc.stderr
    assert "held-out problems: none in the " in proc.stdout
    assert f"{len(dev)} questions of GSM8K's dev slice, from {gsm8k}" in proc.stdout
    monkeypatch.setattr(HeldOut, "excluded", lambda self, messages, gsm8k_file_split=None: False)  # a prep that lets them in
    for name, found in (("chat", "arithmetic_test"), ("g", "gsm8k_dev")):  # chat: its dev questions too
        data = _sft_file(sp, tmp_path / name / "sft.h5", [s for s in sources if s["name"] == name], 64)
        with h5py.File(data) as f:
            assert json.loads(f.attrs["held_out"])["sets"] == list(SETS)  # the record says they were left out
        proc = _train_sft(data, init, tmp_path / f"run_{name}", 64)
        one_error(proc, f"{data}: row ", f"holds a held-out problem ({found}: '", "'); a train file must not hold")
        assert not (tmp_path / f"run_{name}").exists()
    gsm8k.unlink()  # GSM8K's dev slice cannot be read here: the record is trusted, and the run says so
    proc = _train_sft(tmp_path / "g" / "sft.h5", init, tmp_path / "run_trusted", 64)
    assert proc.returncode == 0, proc.stderr
    assert "GSM8K dev: GSM8K's train file not readable here (" in proc.stdout and "the prep's record trusted" in proc.stdout


# ---- evaluate.py --split -------------------------------------------------------------------

def test_task_prompts_of_each_split_are_the_preps(tmp_path):
    from sprout.evaluation.tasks import dev_slice_record, task_prompts
    from sprout.prep.rl_prompts import PromptDataConfig, prepare

    prepare(PromptDataConfig(out=str(tmp_path / "rl"), sources=[
        {"name": "arithmetic_dev", "format": "arithmetic", "count": 12, "split": "dev", "own_split": True}]),
        log=lambda *_: None, warn=lambda *_: None)
    prepared = [json.loads(line) for line in (tmp_path / "rl" / "prompts_dev.jsonl").read_text().splitlines()]
    ours = task_prompts("arith", max_examples=12, log=lambda *_: None)  # dev, the default
    assert sorted(ours, key=lambda r: r["id"]) == sorted(prepared, key=lambda r: r["id"])
    assert all(arithmetic_set(r["prompt"][0]["content"]) == "arithmetic_dev" for r in ours)
    _jsonl(tmp_path / "mirror" / "sft" / "gsm8k" / "train.jsonl", _gsm8k_rows(200))
    _jsonl(tmp_path / "mirror" / "sft" / "gsm8k" / "test.jsonl", _gsm8k_rows(5, "How many pears"))
    dev = task_prompts("gsm8k", "dev", mirror=str(tmp_path / "mirror"), log=lambda *_: None)
    assert {r["prompt"][0]["content"] for r in dev} == _gsm8k_dev(200) and {r["source"] for r in dev} == {"gsm8k_dev"}
    slice_record = dev_slice_record("gsm8k", "dev", dev)  # what the eval JSON records: the preps' digest
    assert slice_record == slice_digest(_gsm8k_dev(200)) != slice_digest(sorted(_gsm8k_dev(200))[1:])
    assert dev_slice_record("arith", "dev", ours) is None
    test = task_prompts("gsm8k", "test", mirror=str(tmp_path / "mirror"), log=lambda *_: None)
    assert len(test) == 5 and {r["source"] for r in test} == {"gsm8k_test"}
    with pytest.raises(SproutError, match="unknown split 'val'"):
        task_prompts("arith", "val")


def test_evaluate_records_the_split_in_the_json_and_its_name(sp, tmp_path):
    from preference_train_fixtures import write_lm

    init = write_lm(tmp_path / "run" / "checkpoints" / "step_00000080", sp)
    args = ["--task", "arith", "--max-examples", "2", "--n", "0", "--greedy", "--max-new-tokens", "2"]
    for split in (None, "test"):
        proc = _run("evaluate.py", init, *args, *(["--split", split] if split else []))
        assert proc.returncode == 0, proc.stderr[-2000:]
        name = f"arith_{split or 'dev'}_step80.json"
        result = json.loads((tmp_path / "run" / "eval" / name).read_text())
        assert result["split"] == (split or "dev") and result["task"] == "arith"
        assert {p["source"] for p in result["problems"]} == {f"arithmetic_{split or 'dev'}"}
        assert result["gsm8k_dev_slice"] is None
    _jsonl(tmp_path / "mirror" / "sft" / "gsm8k" / "train.jsonl", _gsm8k_rows(200))
    proc = _run("evaluate.py", init, *args[4:], "--task", "gsm8k", "--mirror", tmp_path / "mirror", "--out",
                tmp_path / "g.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "g.json").read_text())["gsm8k_dev_slice"] == slice_digest(sorted(_gsm8k_dev(200)))
    one_error(_run("evaluate.py", init, "--prompts", "x.jsonl", "--split", "test", "--n", "0", "--greedy"),
               "--split goes with --task")
