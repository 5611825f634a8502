"""What a prep script does with input that would otherwise pass in silence: an empty source
file is refused (exit 2, one line naming it, nothing written); a gold or a margin that cannot
be used is refused at its input line, in a short line; what dedup and the split leave out is
warned about on stderr with the counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proc import one_error
from sft_fixtures import tiny_sentencepiece

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env={**os.environ, "SPROUT_MIRROR": ""})


def warnings(proc) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prompt_rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"What is {i} plus 1?", "gold": str(i + 1)} for i in range(start, start + n)]


def rl_prep(out: Path, *sources: str) -> subprocess.CompletedProcess:
    return run("prepare_rl_prompts.py", "--out", out, "--sources", "[" + ", ".join(sources) + "]")


def jsonl_source(name: str, path: Path, extra: str = "") -> str:
    return f"{{name: {name}, format: jsonl, path: '{path}'{extra}}}"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.mark.parametrize("script", ["prepare_rl_prompts.py", "prepare_preference_data.py", "prepare_sft_data.py"])
@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_source_file_is_refused_naming_it_and_nothing_is_written(script, content, tok, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    out = tmp_path / "out"
    if script == "prepare_sft_data.py":
        proc = run(script, "--source", empty, "--format", "chat", "--tokenizer", tok.spec, "--out", out / "sft.h5")
    else:
        proc = run(script, "--out", out, "--sources", f"[{jsonl_source('mine', empty)}]")
    one_error(proc, str(empty), "holds no records", alone=True)
    assert not out.exists()


def test_a_5001_digit_gold_is_refused_in_a_short_line(tmp_path):
    digits = "7" * 5001
    as_string = write_jsonl(tmp_path / "string.jsonl", [{"prompt": "How big?", "gold": digits}, *prompt_rows(3)])
    proc = rl_prep(tmp_path / "a", jsonl_source("big", as_string))
    assert proc.returncode == 0, proc.stderr
    dropped = [line for line in proc.stdout.splitlines() if line.startswith("dropped (big/unparsable_gold)")]
    assert len(dropped) == 1 and f"{as_string}:1" in dropped[0], proc.stdout
    assert "5,001 characters" in dropped[0] and "longer than a number may be" in dropped[0] and len(dropped[0]) < 300
    assert digits not in proc.stdout + proc.stderr

    as_integer = write_jsonl(tmp_path / "integer.jsonl", [f'{{"prompt": "How big?", "gold": {digits}}}'])
    proc = rl_prep(tmp_path / "b", jsonl_source("big", as_integer))
    line = one_error(proc, f"{as_integer}:1", "5001 digits", alone=True)
    assert len(line) < 300 and not (tmp_path / "b").exists()


def test_a_prepared_prompt_file_with_a_5001_digit_gold_is_refused_in_a_short_line(tmp_path):
    from sprout.errors import SproutError
    from sprout.formats.prompts import read_prompts

    record = {"id": "a", "source": "s", "prompt": [{"role": "user", "content": "How big?"}], "gold": "7" * 5001,
              "level": None}
    path = write_jsonl(tmp_path / "prompts.jsonl", [record])
    with pytest.raises(SproutError) as err:
        list(read_prompts(path))
    assert f"{path}:1" in str(err.value) and "5,001 characters" in str(err.value) and len(str(err.value)) < 300


def test_one_prompt_with_two_golds_is_warned_about_with_the_count(tmp_path):
    rows = [*prompt_rows(10), {"prompt": "What is 3 plus 1?", "gold": "5"}, {"prompt": "what is 4 plus 1?", "gold": "9"}]
    src = write_jsonl(tmp_path / "mine.jsonl", rows)
    proc = rl_prep(tmp_path / "out", jsonl_source("mine", src))
    (line,) = [w for w in warnings(proc) if "different gold" in w]
    assert "source mine" in line and str(src) in line and "2 of 12 prompts" in line
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["sources"]["mine"]["duplicates_other_gold"] == 2


def test_an_own_test_file_emptied_by_training_duplicates_is_warned_about(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", prompt_rows(20))
    test = write_jsonl(tmp_path / "test.jsonl", prompt_rows(5))  # the first five training prompts again
    proc = rl_prep(tmp_path / "out", jsonl_source("mine", train, ", own_split: true"),
                   jsonl_source("mine_test", test, ", own_split: true, split: test"))
    found = warnings(proc)
    assert any("source mine_test" in w and "5 of its 5 test prompts are already in the train split" in w
               and "0 kept in test" in w for w in found), found
    assert any("prompts_test.jsonl: the test split is empty (0 of 20 prompts)" in w for w in found), found


def test_a_prep_that_writes_an_empty_split_warns_with_the_counts(tok, tmp_path):
    src = write_jsonl(tmp_path / "mine.jsonl", prompt_rows(3))
    proc = rl_prep(tmp_path / "rl", jsonl_source("mine", src))
    dev_line, test_line = warnings(proc)
    assert f"{tmp_path / 'rl' / 'prompts_dev.jsonl'}: the dev split is empty (0 of 3 prompts)" in dev_line
    assert f"{tmp_path / 'rl' / 'prompts_test.jsonl'}: the test split is empty (0 of 3 prompts)" in test_line

    chats = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}
        for i in range(3)])
    proc = run("prepare_sft_data.py", "--source", chats, "--format", "chat", "--tokenizer", tok.spec,
               "--out", tmp_path / "sft" / "sft.h5", "--seq-len", "64", "--val_fraction", "0")
    (line,) = warnings(proc)
    assert "sft_val.h5: the val split is empty (0 of 3 conversations)" in line


def test_a_nan_margin_is_refused_at_its_input_line(tmp_path):
    pair = {"prompt": "Pick one.", "chosen": "this", "rejected": "that"}
    src = write_jsonl(tmp_path / "pairs.jsonl", [json.dumps({**pair, "margin": 1.0}),
                                                  json.dumps({**pair, "prompt": "Again.", "margin": float("nan")})])
    proc = run("prepare_preference_data.py", "--out", tmp_path / "out", "--sources", f"[{jsonl_source('mine', src)}]")
    one_error(proc, f"{src}:2", "'margin' must be a finite number, got nan", alone=True)
    assert not (tmp_path / "out").exists()
