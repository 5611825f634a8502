"""What a trainer's `--data` takes (`sprout.formats.data_paths`): the folder its prep wrote or
any file of it, with the held-out file found beside the train file; anything else is refused
in one line naming the path and what to pass. Through the scripts: each trainer gets past
its data with the prep's folder, names a missing held-out file, and says so in --help.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from proc import one_error, run_here
from sprout.errors import SproutError
from sprout.formats.data_paths import (PREFERENCE_FILES, PROMPT_FILES, SFT_FILES, resolve_data,
                                       token_data_path)

ROOT = Path(__file__).resolve().parents[1]


def touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("x")
    return folder


@pytest.mark.parametrize("files,train,held_out", [
    (PREFERENCE_FILES, "preferences.jsonl", "preferences_dev.jsonl"),
    (PROMPT_FILES, "prompts.jsonl", "prompts_dev.jsonl"),
    (SFT_FILES, "sft.h5", "sft_val.h5"),
])
def test_the_folder_or_any_file_of_it_gives_the_train_and_held_out_files(tmp_path, files, train, held_out):
    sealed = [train.replace(files.suffix, f"{files.sealed}{files.suffix}")] if files.sealed else []
    folder = touch(tmp_path / "prep", train, held_out, "manifest.json", *sealed)
    want = (folder / train, folder / held_out)  # the stages evaluate on dev; the test file is never read
    for given in (folder, folder / train, folder / held_out, folder / "manifest.json", *(folder / s for s in sealed)):
        assert resolve_data(given, files) == want, given
    other = touch(tmp_path / "other", f"mine{files.suffix}")
    assert resolve_data(folder, files, val_path=other / f"mine{files.suffix}") == (folder / train,
                                                                                     other / f"mine{files.suffix}")


@pytest.mark.parametrize("files,train", [(PREFERENCE_FILES, "preferences.jsonl"), (PROMPT_FILES, "prompts.jsonl")])
def test_data_val_path_naming_the_sealed_test_file_is_refused(tmp_path, files, train):
    test_file = train.replace(".jsonl", "_test.jsonl")
    folder = touch(tmp_path / "prep", train, train.replace(".jsonl", "_dev.jsonl"), test_file)
    copy = touch(tmp_path / "copy", test_file) / test_file  # by its name, wherever it lies
    other = touch(tmp_path / "other", "mine.jsonl", "mine_test.jsonl") / "mine_test.jsonl"  # another prep's
    for val_path in (folder / test_file, copy, other):
        with pytest.raises(SproutError) as err:
            resolve_data(folder, files, val_path=val_path)
        assert str(err.value) == (f"data.val_path {val_path}: the sealed test file, which no stage evaluates on; "
                                  f"leave data.val_path unset for {train.replace('.jsonl', '_dev.jsonl')}")


def test_a_renamed_pair_is_found_by_its_name(tmp_path):
    folder = touch(tmp_path / "p", "mine.jsonl", "mine_dev.jsonl", "mine_test.jsonl")
    assert resolve_data(folder, PROMPT_FILES) == (folder / "mine.jsonl", folder / "mine_dev.jsonl")
    assert resolve_data(folder / "mine_dev.jsonl", PROMPT_FILES) == (folder / "mine.jsonl", folder / "mine_dev.jsonl")


@pytest.mark.parametrize("layout,given,message", [
    ((), "missing", "missing: not found; pass the folder scripts/prepare_rl_prompts.py wrote, or its train file"),
    (("notes.txt",), ".", "a folder without RL prompts (no prompts.jsonl train file); pass the folder"),
    (("a.jsonl", "b.jsonl"), ".", "a folder with several train files (a.jsonl, b.jsonl); pass the one"),
    (("prompts.jsonl", "prompts_test.jsonl"), ".", "prompts_dev.jsonl: held-out RL prompts file not found (beside prompts.jsonl; "
                              "scripts/prepare_rl_prompts.py writes it, or set data.val_path)"),
    (("sft.h5",), "sft.h5", "sft.h5: not a file of RL prompts (a .jsonl file); pass the folder"),
])
def test_what_is_not_a_prep_folder_is_refused_naming_it(tmp_path, layout, given, message):
    folder = touch(tmp_path / "p", *layout)
    with pytest.raises(SproutError) as err:
        resolve_data(folder / given, PROMPT_FILES)
    assert message in str(err.value)
    assert str(folder) in str(err.value)


def test_pretraining_data_is_the_shard_folder_or_the_train_h5(tmp_path):
    shards = touch(tmp_path / "bin", "manifest.json", "t_train_000000.bin", "t_val_000000.bin")
    for given in (shards, shards / "manifest.json", shards / "t_val_000000.bin"):
        assert token_data_path(given) == shards
    h5 = touch(tmp_path / "h5", "manifest.json", "t_train.h5", "t_val.h5")
    for given in (h5, h5 / "manifest.json", h5 / "t_train.h5", h5 / "t_val.h5"):
        assert token_data_path(given) == h5 / "t_train.h5", given
    both = touch(tmp_path / "both", "manifest.json", "t_train_000000.bin", "t_train.h5", "t_val.h5")
    assert token_data_path(both) == both and token_data_path(both / "t_val.h5") == both / "t_train.h5"
    with pytest.raises(SproutError, match="nope: not found; pass the folder scripts/prepare_pretrain_data.py wrote"):
        token_data_path(tmp_path / "nope")
    with pytest.raises(SproutError, match="a folder without pretraining data"):
        token_data_path(touch(tmp_path / "empty"))


# ---- through the scripts ----------------------------------------------------------------------

TRAINERS = {  # script: (the prep's files, the flags besides --data, --init and --out)
    "train_sft.py": (("sft.h5", "sft_val.h5"), ()),
    "train_reward.py": (("preferences.jsonl", "preferences_dev.jsonl"), ()),
    "train_dpo.py": (("preferences.jsonl", "preferences_dev.jsonl"), ()),
    "train_ppo.py": (("prompts.jsonl", "prompts_dev.jsonl"), ()),
    "train_grpo.py": (("prompts.jsonl", "prompts_dev.jsonl"), ()),
}


def run(script: str, *args) -> subprocess.CompletedProcess:
    return run_here([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], cwd=ROOT,
                    env={**os.environ, "SPROUT_MIRROR": ""})


@pytest.mark.parametrize("script", sorted(TRAINERS))
def test_each_trainer_takes_the_prep_folder_and_names_a_missing_held_out_file(script, tmp_path):
    (train, held_out), extra = TRAINERS[script]
    folder = touch(tmp_path / "prep", train)
    out = tmp_path / "out"
    line = one_error(run(script, "--data", folder, "--init", tmp_path / "no_model", "--out", out, *extra))
    assert f"{folder / held_out}: held-out" in line and "not found" in line, line
    assert not out.exists()

    touch(folder, held_out)  # the data is found: the next input checked is the missing model
    line = one_error(run(script, "--data", folder, "--init", tmp_path / "no_model", "--out", out, *extra))
    assert "no_model" in line and str(folder) not in line, line
    assert not out.exists()


@pytest.mark.parametrize("script", ["pretrain.py", *sorted(TRAINERS)])
def test_each_trainers_help_says_data_takes_the_prep_folder(script):
    proc = run(script, "--help")
    assert proc.returncode == 0, proc.stderr
    flat = " ".join(proc.stdout.split())
    assert "--data DIR|FILE" in flat and "wrote, or" in flat and "file of it" in flat, flat
