"""Inputs that would otherwise end in a traceback, an overflow or a silent exit, each met through
its script and ended in one `error:` line (exit 2) naming the option, field, file or function: a NaN or
infinite temperature or top-p in sample.py, chat.py and evaluate.py; a NaN or infinite
`rewards.reward_weights`; a reward function that raises, calls sys.exit or returns 1e308; a
held-out file that is the train file or a copy of it; held-out prompts that are train prompts but
for case and whitespace; another stage's prep folder given as `--data` (while a folder holding two
preps' files is read by each). A refusal at start leaves every folder byte for byte as it was; a
reward function's failure, met at the first step, leaves no checkpoint.

The functions below are reward functions the scripts are given as "test_bad_inputs_weak:<name>"."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_fixtures import make_docs
from preference_train_fixtures import base, cli_flags, marked_pairs, write_pairs  # noqa: F401 (base: a fixture)
from proc import one_error, run_here, tree
from test_bad_inputs_rl import TINY, lines, prepared, write_lines  # noqa: F401 (prepared: a fixture)

from sprout.errors import SproutError
from sprout.rl.verifiers import REWARD_LIMIT, WeightedReward, combine_rewards

ROOT = Path(__file__).resolve().parents[1]


# ---- reward functions the scripts name as "test_bad_inputs_weak:<name>" ----
def raises(completions, **_):
    raise ValueError("no answer tag in the completion")


def exits(completions, **_):
    sys.exit(0)


def huge(completions, **_):
    return [1e308] * len(completions)


def script(name: str, *args) -> subprocess.CompletedProcess:
    return run_here([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], cwd=ROOT,
                    env={**os.environ, "SPROUT_MIRROR": ""})


def rl(script_name: str, data: Path, init: Path, out: Path, *extra) -> subprocess.CompletedProcess:
    """An RL trainer on tiny sizes (`test_bad_inputs_rl.TINY`), one prompt per step."""
    flags = [f"--{section}.{k}={v}" for section, fields in TINY.items() for k, v in fields.items()
             if (section, k) not in (("batch", "global_prompts"), ("batch", "micro_completions"))]
    flags += ["--batch.global_prompts=1", "--batch.micro_completions=2"]
    if script_name == "train_ppo.py":
        flags.append("--ppo.num_ppo_epochs=1")
    return script(script_name, "--data", data, "--init", init, "--out", out, *flags, *extra)


# ---- sampling settings ----------------------------------------------------------------------------
@pytest.mark.parametrize("name, option, value", [
    ("sample.py", "--temperature", "nan"),
    ("sample.py", "--top-p", "nan"),
    ("sample.py", "--temperature", "inf"),
    ("chat.py", "--temperature", "nan"),
    ("chat.py", "--top-p", "nan"),
    ("evaluate.py", "--temperature", "nan"),
    ("evaluate.py", "--temperature", "inf"),
])
def test_a_nan_sampling_setting_is_refused_naming_the_option(name, option, value, base):
    args = {"sample.py": ["--prompt", "apple river", "--max-new-tokens", 4],
            "chat.py": ["--prompt", "Say apple.", "--max-new-tokens", 4],
            "evaluate.py": ["--task", "arith", "--n", 2, "--max-examples", 2, "--max-new-tokens", 4]}[name]
    run_folder = base.parent
    before = tree(run_folder)
    line = one_error(script(name, base, *args, option, value), f"{option}: got {value}", alone=True)
    assert "expected a finite number" in line or "expected a number in (0, 1]" in line, line
    assert tree(run_folder) == before  # evaluate.py writes nothing into eval/


# ---- reward weights and reward functions ----------------------------------------------------------
@pytest.mark.parametrize("weights", ["[.nan, 1.0]", "[1.0, .inf]"])
def test_a_non_finite_reward_weight_is_refused_at_start(weights, prepared, base, tmp_path):
    before = tree(tmp_path)
    one_error(rl("train_grpo.py", prepared, base, tmp_path / "out", "--rewards.reward_weights", weights),
              "rewards.reward_weights", "expected finite numbers", alone=True)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("script_name, reward, needles", [
    ("train_grpo.py", "raises", ("reward function 'raises' raised ValueError: no answer tag in the completion "
                                 "while scoring prompt '",)),
    ("train_ppo.py", "raises", ("reward function 'raises' raised ValueError",)),
    ("train_grpo.py", "exits", ("reward function 'exits' called sys.exit(0) while scoring prompt '",
                                "cannot end the run")),
    ("train_grpo.py", "huge", ("reward function 'huge' returned 1e+308 for completion 0 of prompt '",
                               f"expected a reward within ±{REWARD_LIMIT:g}")),
])
def test_a_failing_reward_function_stops_the_run_naming_it_and_the_prompt(script_name, reward, needles, prepared,
                                                                          base, tmp_path):
    out = tmp_path / "out"
    proc = rl(script_name, prepared, base, out, "--rewards.reward_funcs", f"[test_bad_inputs_weak:{reward}]")
    line = one_error(proc, *needles, f"({prepared / 'prompts.jsonl'})")  # exit 2, never the function's own status
    train_ids = {r["id"] for r in lines(prepared / "prompts.jsonl")}
    named = line.split("prompt '", 1)[1].split("'", 1)[0]
    assert named in train_ids, line
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_a_weighted_sum_beyond_the_limit_is_refused_naming_the_completion():
    rewards = [WeightedReward("one", lambda c, **_: [1.0] * len(c), 1e300)]
    with pytest.raises(SproutError) as err:
        combine_rewards(rewards, ["a"], completion_names=["completion 0 of prompt 'p'"])
    assert str(err.value) == ("the weighted sum of rewards for completion 0 of prompt 'p' is 1e+300, beyond ±1e+12; "
                              "lower rewards.reward_weights (one 1e+300)")
    fine = combine_rewards([WeightedReward("f", lambda c, **_: [REWARD_LIMIT, -REWARD_LIMIT])], ["a", "b"])
    assert fine.totals == [REWARD_LIMIT, -REWARD_LIMIT] and all(math.isfinite(t) for t in fine.totals)


# ---- held-out files ---------------------------------------------------------------------------------
@pytest.fixture()
def pairs(tmp_path) -> Path:
    """Hand-made preference files (no manifest): preferences.jsonl and preferences_dev.jsonl."""
    return write_pairs(tmp_path / "prefs", n_train=16, n_test=8)


@pytest.mark.parametrize("script_name", ["train_dpo.py", "train_reward.py"])
@pytest.mark.parametrize("how", ["same", "copy"])
def test_a_held_out_file_that_is_the_train_file_is_refused(script_name, how, pairs, base, tmp_path):
    val = pairs
    if how == "copy":
        val = tmp_path / "mine" / "held_out.jsonl"
        val.parent.mkdir()
        shutil.copy(pairs, val)
    before = tree(tmp_path)
    flags = cli_flags(pairs, base, tmp_path / "out", max_steps=1)
    line = one_error(script(script_name, *flags, "--data.val_path", val), f"data.val_path {val}: ",
                     f"the train file {pairs}" if how == "same" else f"the same pairs as the train file {pairs}",
                     alone=True)
    assert "measure nothing" in line
    assert tree(tmp_path) == before


def test_held_out_prompts_differing_only_in_case_and_whitespace_are_refused(prepared, base, tmp_path):
    d = tmp_path / "prompts"
    shutil.copytree(prepared, d)
    held_out = lines(d / "prompts_dev.jsonl")[:2]
    for r in held_out:  # the same questions, shouted and spaced out, under new ids
        r["id"] = "copy-" + r["id"]
        r["prompt"] = [{**m, "content": "  " + "   ".join(m["content"].upper().split()) + "\n"} for m in r["prompt"]]
    write_lines(d / "prompts.jsonl", lines(d / "prompts.jsonl") + held_out)
    before = tree(tmp_path)
    one_error(rl("train_grpo.py", d / "prompts.jsonl", base, tmp_path / "out", "--data-verify", "sizes"),
              str(d / "prompts_dev.jsonl"), "2 held-out prompt(s) also in the train file",
              "but for case and whitespace", alone=True)
    assert tree(tmp_path) == before


# ---- another stage's folder as --data ------------------------------------------------------------------
@pytest.fixture(scope="module")
def preps(sp, prepared, tmp_path_factory) -> dict[str, Path]:
    """The folders of every prep, each written by the prep itself: pretraining (.bin shards), SFT,
    preference pairs and RL prompts (`prepared`)."""
    from sprout.prep.preference_data import PreferenceDataConfig, prepare as prepare_pairs
    from sprout.prep.pretrain import PrepConfig, prepare as prepare_tokens
    from sprout.prep.sft_data import SFTDataConfig, prepare as prepare_sft

    root = tmp_path_factory.mktemp("preps")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(60)))
    prepare_tokens(PrepConfig(name="t", sources=[str(docs)], tokenizer=sp.spec, out=str(root / "pretrain"), workers=1,
                              val_frac=0.1, shard_tokens=8000), tokenizer=sp, progress=False, log=lambda s: None)
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: a story?"},
                                                      {"role": "assistant", "content": d}]}) + "\n"
                             for i, d in enumerate(make_docs(40, seed=1, min_words=3, max_words=8))))
    sft = SFTDataConfig(tokenizer=sp.spec, out=str(root / "sft" / "sft.h5"), seq_len=32, val_fraction=0.2,
                        sources=[{"name": "chat", "format": "chat", "path": str(chats)}])
    prepare_sft(sft, sp, log=lambda *a: None)
    raw = root / "pairs.jsonl"
    raw.write_text("".join(json.dumps({"prompt": p["prompt"][0]["content"], "chosen": p["chosen"][0]["content"],
                                       "rejected": p["rejected"][0]["content"]}) + "\n" for p in marked_pairs(60, 0)))
    pairs_cfg = PreferenceDataConfig(out=str(root / "prefs"), test_fraction=0.2, dev_fraction=0.2,
                                     sources=[{"name": "m", "format": "jsonl", "path": str(raw)}])
    prepare_pairs(pairs_cfg, log=lambda *a: None)
    return {"pretrain": root / "pretrain", "sft": root / "sft", "prefs": root / "prefs", "prompts": prepared}


@pytest.mark.parametrize("script_name, given, stage, prep", [
    ("train_dpo.py", "sft", "SFT data (packed SFT rows", "scripts/prepare_sft_data.py"),
    ("train_reward.py", "prompts/prompts.jsonl", "GRPO and PPO data (RL prompts", "scripts/prepare_rl_prompts.py"),
    ("train_grpo.py", "prefs", "reward model and DPO data (preference pairs", "scripts/prepare_preference_data.py"),
    ("train_sft.py", "pretrain", "pretraining data (tokenised documents", "scripts/prepare_pretrain_data.py"),
    ("pretrain.py", "prompts", "GRPO and PPO data (RL prompts", "scripts/prepare_rl_prompts.py"),
    ("pretrain.py", "sft/sft.h5", "SFT data (packed SFT rows", "scripts/prepare_sft_data.py"),
])
def test_another_stages_folder_is_refused_naming_its_stage(script_name, given, stage, prep, preps, base, tmp_path):
    folder, _, name = given.partition("/")
    data = preps[folder] / name if name else preps[folder]
    extra = [] if script_name == "pretrain.py" else ["--init", base]
    before = tree(tmp_path)
    line = one_error(script(script_name, "--data", data, "--out", tmp_path / "out", *extra), f"{data}: {stage}",
                     f"that {prep} wrote", alone=True)
    assert "missing" not in line, line
    assert tree(tmp_path) == before


def test_a_folder_holding_two_preps_is_read_by_each_stage(preps, tmp_path):
    """Only what another prep wrote is refused: SFT's files beside an RL prompt prep's are each
    found by their own stage."""
    from sprout.formats.data_paths import PROMPT_FILES, SFT_FILES, resolve_data

    both = tmp_path / "both"
    shutil.copytree(preps["prompts"], both)
    for name in ("sft.h5", "sft_val.h5"):
        shutil.copy(preps["sft"] / name, both / name)
    assert resolve_data(both, SFT_FILES) == (both / "sft.h5", both / "sft_val.h5")
    assert resolve_data(both / "sft.h5", SFT_FILES) == (both / "sft.h5", both / "sft_val.h5")
    assert resolve_data(both, PROMPT_FILES) == (both / "prompts.jsonl", both / "prompts_dev.jsonl")
    with pytest.raises(SproutError, match="SFT data"):
        resolve_data(both / "sft.h5", PROMPT_FILES)
