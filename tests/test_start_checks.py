"""What a first run on one's own small files meets, through the scripts: the checks that run
before the run folder is touched (a val split too small for one window; resumed data of
another tokenizer), model.vocab_size taken from the data, a changed --data on resume said
plainly, a failed resume that leaves the run's config.yaml as it was, TRL's option names
answered with sprout's, and --report-only on a folder with nothing to report.

Each refusal: exit 2, one `error:` line naming what is wrong, the run folder byte for byte as
it was (`tree`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from data_fixtures import make_docs, train_tiny_sp
from test_bad_inputs_train import TINY, one_error, run, tree

from sprout.prep.pretrain import PrepConfig, prepare
from sprout.prep.tokenizer_train import train_sentencepiece
from sprout.tokenizer import load_tokenizer

_at = TINY.index("--model.vocab_size")
NO_VOCAB = TINY[:_at] + TINY[_at + 2 :]  # model.vocab_size left to the data


def prep(tok, out: Path, docs: list[str], **values) -> Path:
    src = out.parent / f"{out.name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = PrepConfig(name="t", sources=[str(src)], tokenizer=tok.spec, out=str(out), workers=1,
                     shard_tokens=8000, **{"val_frac": 0.1, **values})
    prepare(cfg, tokenizer=tok, progress=False, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_sp(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def other_tok(tmp_path_factory):
    """A tokenizer of the same vocabulary size as `tok`, trained on other text: another fingerprint."""
    texts = make_docs(1500, seed=7, prefix="Other ") + ["Zebra quartz jumps over vexed wolves."] * 50
    return load_tokenizer(f"sentencepiece:{train_sentencepiece(iter(texts), tmp_path_factory.mktemp('sp2') / 'o', 400)}")


@pytest.fixture(scope="module")
def datasets(tok, other_tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {"a": prep(tok, root / "a", make_docs(300)), "b": prep(tok, root / "b", make_docs(300, seed=1)),
            "other_tok": prep(other_tok, root / "other_tok", make_docs(300, seed=2))}


@pytest.fixture(scope="module")
def base_run(datasets, tmp_path_factory):
    """A 2-step pretraining run on `a`, model.vocab_size left to the data."""
    out = tmp_path_factory.mktemp("runs") / "base"
    proc = run("pretrain.py", "--data", datasets["a"], "--out", out, *NO_VOCAB)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_vocab_size_defaults_to_the_data_rounded_up(base_run, tok):
    out, proc = base_run
    assert tok.vocab_size == 400
    assert "model.vocab_size 448 (the data's vocabulary 400, rounded up to a multiple of 64)" in proc.stdout
    assert "vocab_size: 448" in (out / "config.yaml").read_text()


def test_a_val_split_too_small_for_one_window_is_refused_before_the_run_folder(tok, tmp_path):
    data = prep(tok, tmp_path / "short_val", make_docs(60, max_words=60), val_docs=1)
    out = tmp_path / "run"
    out.mkdir()
    before = tree(out)
    wide = ["--model.max_seq_len", "256", "--data.seq_len", "256", "--data.eval_tokens", "4096"]
    line = one_error(run("pretrain.py", "--data", data, "--out", out, *TINY, *wide), str(data / "manifest.json"),
                     "one eval window needs 257", "the val split is too small")
    assert tree(out) == before, line  # no config.yaml, metrics.jsonl or tokenizer/
    one_error(run("pretrain.py", "--data", data, "--out", out, *TINY, "--data.eval_tokens", "16"),
              "data.eval_tokens is too small")
    assert tree(out) == before


def test_resume_on_data_of_another_tokenizer_is_refused_naming_both(base_run, datasets, tok, other_tok):
    out, _ = base_run
    before = tree(out)
    line = one_error(run("pretrain.py", "--out", out, "--resume", "--data", datasets["other_tok"],
                         "--train.max_steps", "4"),
                     str(datasets["other_tok"] / "manifest.json"), other_tok.fingerprint()[:12],
                     tok.fingerprint()[:12], str(datasets["a"]))
    assert tree(out) == before, line


def test_a_failed_resume_leaves_the_runs_config_yaml(base_run, tmp_path):
    out, _ = base_run
    run_copy = shutil.copytree(out, tmp_path / "run")
    config = (run_copy / "config.yaml").read_bytes()
    weights = next((run_copy / "checkpoints").glob("step_*")) / "model.safetensors"
    # train.max_steps 4 is written to config.yaml before training; the full disk then stops the save
    proc = run("pretrain.py", "--out", run_copy, "--resume", "--train.max_steps", "4",
               limit=weights.stat().st_size // 2)
    one_error(proc, "File too large")
    assert (run_copy / "config.yaml").read_bytes() == config


def test_resume_on_other_data_of_the_same_tokenizer_says_so(base_run, datasets, tmp_path):
    out, _ = base_run
    run_copy = shutil.copytree(out, tmp_path / "run")
    proc = run("pretrain.py", "--out", run_copy, "--resume", "--data", datasets["b"], "--train.max_steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert f"data.dir was {datasets['a']}, now {datasets['b']} (same tokenizer)" in proc.stderr


@pytest.mark.parametrize("script, option, needle", [
    ("pretrain.py", "--learning_rate", "(TRL's learning_rate: did you mean --optim.lr?)"),
    ("pretrain.py", "--per_device_train_batch_size", "did you mean --batch.micro_tokens?"),
    ("train_sft.py", "--num_train_epochs", "did you mean --data.epochs?"),
    ("train_sft.py", "--max_length", "prepare_sft_data.py --seq-len"),
    ("train_grpo.py", "--max_prompt_length", "did you mean --data.max_prompt_length?"),
    ("train_dpo.py", "--beta", "did you mean --dpo.beta?"),
    ("train_dpo.py", "--gradient_accumulation_steps", "batch.global_pairs"),
])
def test_a_trl_option_name_gets_sprouts(script, option, needle, tmp_path):
    line = one_error(run(script, "--out", tmp_path / "out", option, "1"), f"unknown option {option}", needle)
    assert not (tmp_path / "out").exists(), line


def test_report_only_on_an_empty_folder_says_there_is_nothing_to_report(tmp_path):
    line = one_error(run("run_pipeline.py", "--preset", "demo", "--out", tmp_path, "--report-only"),
                     str(tmp_path), "nothing to report")
    assert list(tmp_path.iterdir()) == [], line
