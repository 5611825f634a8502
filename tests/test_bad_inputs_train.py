"""Every tampered or bad input to a trainer ends in one line naming the file, field or path, and
a trainer is safe under a killed save and a full disk.

Each case runs the real script (in the test's process, `proc.run_here`; in a subprocess under a
file size limit) and checks: the exit code, exactly one `error: ...` line on stderr naming what
is wrong, no traceback, and, for refusals, the output folder byte for byte as it was. A full
disk is a file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored so the write fails with EFBIG),
so no real disk is filled. Checkpoint rotation and the
removal of a killed save's temporaries are checked on `save_rotating` itself.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from data_fixtures import make_docs, train_tiny_sp
from proc import one_error, run_here, tree
from sprout.atomic import sha256_file, write_json_atomic
from sprout.checkpoint import read_meta, save_checkpoint, save_rotating
from sprout.errors import SproutError
from sprout.formats.shards import write_shard
from sprout.model.transformer import ModelConfig, Transformer
from sprout.prep.pretrain import PrepConfig, prepare
from sprout.prep.sft_data import SFTDataConfig
from sprout.prep.sft_data import prepare as prepare_sft

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
TINY = ["--model.vocab_size", "448", "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2",
        "--model.max_seq_len", "32", "--data.seq_len_start", "32", "--data.eval_tokens", "256",
        "--batch.global_tokens", "256", "--batch.micro_tokens", "256", "--train.max_steps", "2",
        "--train.eval_every", "0", "--train.ckpt_every", "0", "--train.progress", "false",
        "--train.peak_tflops", "-1"]


def run(script: str, *args, limit: int | None = None, timeout: float = 180):
    """Run scripts/<script> with `args`; `limit` caps the size of any file it writes (a subprocess)."""

    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd, env = [sys.executable, str(SCRIPTS / script), *map(str, args)], {**os.environ, "SPROUT_MIRROR": ""}
    if limit is None:
        return run_here(cmd, cwd=ROOT, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=cap, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tiny_sp(tmp_path_factory.mktemp("sp"))


def prep(tok, out: Path, seed: int = 0, fmt: str = "bin") -> Path:
    src = out.parent / f"{out.name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(300, seed=seed)))
    cfg = PrepConfig(name="t", sources=[str(src)], tokenizer=tok.spec, out=str(out), workers=1, val_frac=0.1,
                     shard_tokens=8000, format=fmt, seed=seed)
    prepare(cfg, tokenizer=tok, progress=False, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def built(tok, tmp_path_factory):
    """Two pretraining folders from different prep runs (bin + HDF5), to copy and tamper with."""
    root = tmp_path_factory.mktemp("built")
    return prep(tok, root / "a", fmt="both"), prep(tok, root / "b", seed=1)


@pytest.fixture()
def data(built, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(built[0], out)
    return out


def manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def pretrain(data: Path, out: Path, *extra, limit=None):
    return run("pretrain.py", "--data", data, "--out", out, *TINY, *extra, limit=limit)


# ---------------------------------------------------------------- 1. pretraining data


def wrong_sha(d: Path) -> tuple[Path, tuple]:
    shard = d / manifest(d)["shards"]["train"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[2000] ^= 0x01  # still a valid id, same size: only the hash tells
    shard.write_bytes(bytes(raw))
    return d, (shard.name, "sha256", "does not match")


def id_over_vocab(d: Path) -> tuple[Path, tuple]:
    m = manifest(d)
    entry = m["shards"]["train"][1]
    tokens = np.fromfile(d / entry["file"], dtype="<u2", offset=1024)
    tokens[5] = 1000  # >= the tokenizer's 400 and the model's 448
    entry["sha256"] = write_shard(d / entry["file"], tokens, np.uint16)
    entry["max_token_id"] = 1000  # a manifest rewritten to match: the vocabulary check still refuses
    write_json_atomic(d / "manifest.json", m)
    return d, (entry["file"], "token id 1,000", "vocab size 400")


def id_over_vocab_manifest_unchanged(d: Path) -> tuple[Path, tuple]:
    m = manifest(d)
    entry = m["shards"]["val"][0]
    tokens = np.fromfile(d / entry["file"], dtype="<u2", offset=1024)
    tokens[5] = 1000
    entry["sha256"] = write_shard(d / entry["file"], tokens, np.uint16)  # only the sha256 rewritten
    write_json_atomic(d / "manifest.json", m)
    return d, (entry["file"], "largest token id is 1,000", "max_token_id")


def missing_shard(d: Path) -> tuple[Path, tuple]:
    shard = d / manifest(d)["shards"]["train"][-1]["file"]
    shard.unlink()
    return d, (shard.name, "is missing")


def no_manifest(d: Path) -> tuple[Path, tuple]:
    (d / "manifest.json").unlink()
    return d, ("manifest.json", "no manifest")


def other_runs_manifest(d: Path, other: Path) -> tuple[Path, tuple]:
    shutil.copy(other / "manifest.json", d / "manifest.json")
    return d, (str(d / "t_"), "another prep")


def stale_shard(d: Path) -> tuple[Path, tuple]:
    write_shard(d / "t_train_000099.bin", np.arange(50), np.uint16)
    return d, ("t_train_000099.bin", "not listed")


def tampered_h5(d: Path) -> tuple[Path, tuple]:
    with h5py.File(d / "t_train.h5", "r+") as f:
        f["tokens"][3] = (int(f["tokens"][3]) + 1) % 400
    return d / "t_train.h5", ("t_train.h5", "tokens_sha256")


CASES = {"wrong_sha": wrong_sha, "id_over_vocab": id_over_vocab,
         "id_over_vocab_manifest_unchanged": id_over_vocab_manifest_unchanged, "missing_shard": missing_shard,
         "no_manifest": no_manifest, "other_runs_manifest": other_runs_manifest, "stale_shard": stale_shard,
         "tampered_h5": tampered_h5}


@pytest.mark.parametrize("case", CASES)
def test_tampered_pretraining_data_is_refused(case, built, data, tmp_path):
    fn = CASES[case]
    target, needles = fn(data, built[1]) if case == "other_runs_manifest" else fn(data)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    one_error(pretrain(target, out), *needles)
    assert tree(out) == before


@pytest.mark.parametrize("given", ["manifest.json", "shard"])
def test_any_file_of_the_prep_folder_is_read_as_the_folder(given, data, tmp_path):
    """--data given a file of the prep's folder (not "shard directory does not exist"): the data is
    checked, and the check that fails here is the vocab, named at the folder's manifest."""
    path = data / (manifest(data)["shards"]["train"][0]["file"] if given == "shard" else given)
    proc = pretrain(path, tmp_path / "out", "--model.vocab_size", "1024")
    one_error(proc, f"{data / 'manifest.json'}: data vocab is")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_verified_data_trains_and_sizes_mode_skips_the_hashes(data, tmp_path):
    full = pretrain(data, tmp_path / "full")
    assert full.returncode == 0, full.stderr
    n = len(manifest(data)["shards"]["train"]) + len(manifest(data)["shards"]["val"])
    assert f"data: verified {n} shards (" in full.stdout
    wrong_sha(data)  # same size, other bytes: only the hash would tell
    sizes = pretrain(data, tmp_path / "sizes", "--data-verify", "sizes")
    assert sizes.returncode == 0, sizes.stderr
    assert "sha256 skipped (data.verify sizes)" in sizes.stdout
    one_error(pretrain(data, tmp_path / "bad", "--data.verify", "quick"), "data.verify", "'quick'")


# ---------------------------------------------------------------- 2. SFT pairs


@pytest.fixture(scope="module")
def sft_runs(tok, tmp_path_factory):
    """Two SFT preps of different data (two prep runs), and a tiny base checkpoint."""
    root = tmp_path_factory.mktemp("sft")
    for name, seed in (("a", 0), ("b", 1)):
        rows = [{"messages": [{"role": "user", "content": f"Question {i}: tell me a story."},
                              {"role": "assistant", "content": d}]}
                for i, d in enumerate(make_docs(120, seed=seed, min_words=3, max_words=8))]
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = SFTDataConfig(tokenizer=tok.spec, out=str(root / name / "sft.h5"), seq_len=32, val_fraction=0.2,
                            seed=seed, sources=[{"name": "chat", "format": "chat", "path": str(src)}])
        prepare_sft(cfg, tok, log=lambda *a: None)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=448, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    base = save_checkpoint(root / "base", model, meta={"model_config": model.config, "tokenizer": tok.spec,
                                                       "stage": "pretrain", "step": 1})
    return root, base


def sft(data: Path, base: Path, out: Path, *extra):
    return run("train_sft.py", "--data", data, "--init", base, "--out", out, "--batch.global_tokens", "64",
               "--batch.micro_tokens", "64", "--train.max_steps", "1", "--train.progress", "false",
               "--train.peak_tflops", "-1", *extra)


def test_sft_train_and_val_from_different_prep_runs_are_refused(sft_runs, tmp_path):
    root, base = sft_runs
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(root / "a" / "sft.h5", mixed / "sft.h5")
    shutil.copy(root / "b" / "sft_val.h5", mixed / "sft_val.h5")  # a killed prep renamed only one of the pair
    out = tmp_path / "run"
    out.mkdir()
    before = tree(tmp_path)
    one_error(sft(mixed / "sft.h5", base, out), str(mixed / "sft_val.h5"), "prep_run_id", "different prep runs")
    assert tree(tmp_path) == before


@pytest.mark.slow
def test_an_edited_loss_mask_is_refused(sft_runs, tmp_path):
    root, base = sft_runs
    d = tmp_path / "d"
    shutil.copytree(root / "a", d)
    with h5py.File(d / "sft.h5", "r+") as f:
        f["loss_mask"][0, :] = 1  # train on the prompt too: the recorded sha256 no longer matches
    out = tmp_path / "run"
    before = tree(tmp_path)
    one_error(sft(d / "sft.h5", base, out), str(d / "sft.h5"), "loss_mask", "sha256")
    assert tree(tmp_path) == before
    ok = sft(root / "a" / "sft.h5", base, tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    assert "data: verified 2 SFT files" in ok.stdout


def test_a_reward_model_as_sft_init_says_what_it_is(sft_runs, tmp_path):
    from sprout.model.heads import RewardModel

    root, base = sft_runs
    model = RewardModel(ModelConfig(vocab_size=448, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    reward = save_checkpoint(tmp_path / "reward", model, meta={"model_config": model.config, "stage": "reward",
                                                              "step": 1})
    out = tmp_path / "run"
    one_error(sft(root / "a", reward, out), f"{reward / 'meta.json'}: a reward model checkpoint (architecture reward)",
              "sft needs an lm checkpoint")
    assert not out.exists()


def test_resuming_another_stages_run_names_that_stage(sft_runs, tmp_path):
    """`train_sft.py --out RUN --resume` on a pretraining run: the stage and its script are named
    (not the config's keys), and the run is left as it was."""
    root, base = sft_runs
    run_dir = tmp_path / "pretrain_run"
    model = Transformer(ModelConfig(vocab_size=448, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    save_rotating(run_dir / "checkpoints", 1, model, meta={"model_config": model.config, "stage": "pretrain",
                                                           "config": {"model": {"d_model": 32}}})
    (run_dir / "config.yaml").write_text("model:\n  d_model: 32\n")
    before = tree(run_dir)
    proc = run("train_sft.py", "--out", run_dir, "--resume")
    one_error(proc, "meta.json: a checkpoint of a pretrain run, which the sft trainer cannot resume",
              "resume it with scripts/pretrain.py")
    assert tree(run_dir) == before


def test_an_rl_run_without_held_out_prompts_is_refused_naming_the_file_before_the_run_folder(sp, tmp_path):
    from grpo_fixtures import write_prompt_files
    from preference_train_fixtures import write_lm

    prompts = write_prompt_files(tmp_path / "prompts").parent
    (prompts / "prompts_dev.jsonl").write_text("")
    init = write_lm(tmp_path / "lm", sp)
    out = tmp_path / "run"
    proc = run("train_grpo.py", "--data", prompts, "--init", init, "--out", out, "--batch.global_prompts", "2",
               "--batch.num_generations", "2", "--batch.micro_completions", "2", "--data.max_prompt_length", "24",
               "--rollout.max_completion_length", "8", "--data.sources", "null", "--train.max_steps", "1")
    one_error(proc, f"{prompts / 'prompts_dev.jsonl'}: no held-out prompts to evaluate (0 read")
    assert not out.exists()


def test_preference_files_are_checked_against_their_manifest(tmp_path):
    from sprout.formats.verify_inputs import verify_jsonl_data

    train, test = tmp_path / "preferences.jsonl", tmp_path / "preferences_test.jsonl"
    train.write_text('{"id": "a"}\n')
    test.write_text('{"id": "b"}\n')
    files = {"train": {"path": train.name, "records": 1, "sha256": sha256_file(train)},
             "test": {"path": test.name, "records": 1, "sha256": sha256_file(test)}}
    write_json_atomic(tmp_path / "manifest.json", {"files": files})
    assert verify_jsonl_data(train, test).files == 2
    test.write_text('{"id": "c"}\n')
    with pytest.raises(SproutError, match=f"{test}: sha256 does not match"):
        verify_jsonl_data(train, test)
    assert verify_jsonl_data(train, test, mode="sizes").hashed is False


# ---------------------------------------------------------------- 3 and 5. checkpoint rotation, killed saves


def tiny_model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=16))


def test_rotation_keeps_to_the_current_runs_checkpoints(tmp_path):
    root, model = tmp_path / "checkpoints", tiny_model()
    for step in (100, 200):  # an old run in the same folder, at later steps
        save_rotating(root, step, model, keep=1, meta={"model_config": model.config, "run_id": "old"})
    new = save_rotating(root, 8, model, keep=1, meta={"model_config": model.config, "run_id": "new"})
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000008", "step_00000200"]
    assert (root / "latest").read_text().strip() == new.name
    save_rotating(root, 16, model, keep=1, meta={"model_config": model.config, "run_id": "new"})
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000016", "step_00000200"]


def test_a_killed_saves_temporaries_are_removed_by_the_next_save(tmp_path):
    root, model = tmp_path / "checkpoints", tiny_model()
    for name in (".tmp-step_00000004.k3j2h1", ".tmp-old-step_00000004"):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"half")
    (root / ".tmp-notes.txt.abc").write_text("not a checkpoint's")
    save_rotating(root, 8, model, meta={"model_config": model.config, "run_id": "r"})
    assert sorted(p.name for p in root.iterdir()) == [".tmp-notes.txt.abc", "latest", "step_00000008"]


# ---------------------------------------------------------------- 4. a checkpoint without its hashes


def test_a_checkpoint_without_its_hashes_is_refused(sft_runs, tmp_path):
    root, base = sft_runs
    ck = tmp_path / "ck"
    shutil.copytree(base, ck)
    meta = json.loads((ck / "meta.json").read_text())
    del meta["files"]
    (ck / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "run"
    before = tree(tmp_path)
    one_error(sft(root / "a" / "sft.h5", ck, out), str(ck / "meta.json"), "no sha256")
    assert tree(tmp_path) == before
    with pytest.raises(SproutError, match="no sha256"):
        read_meta(ck)


# ---------------------------------------------------------------- 6. a full disk


@pytest.mark.slow
def test_a_full_disk_stops_the_checkpoint_naming_it_and_leaves_nothing_partial(data, tmp_path):
    ok = pretrain(data, tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    weights = next((tmp_path / "ok" / "checkpoints").glob("step_*")) / "model.safetensors"
    out = tmp_path / "out"
    proc = pretrain(data, out, limit=weights.stat().st_size // 2)
    one_error(proc, str(out / "checkpoints" / "step_00000002"), "File too large")
    left = tree(out / "checkpoints")
    assert not [n for n in left if "step_" in n or n == "latest"], left  # no partial step dir, no pointer


REPORT_WRITER = """
import sys
from sprout.errors import run_main
from sprout.engine.metrics import plot_loss_curve
from sprout.engine.report import write_report
out = sys.argv[2]
def main():
    if sys.argv[1] == "png":
        plot_loss_curve(out + "/metrics.jsonl", out + "/loss.png")
    else:
        write_report(out, stage="pretrain", meta={}, num_params=1, world_size=1, precision="no")
run_main(main)
"""

LOGGER = """
import sys
from types import SimpleNamespace
from sprout.errors import run_main
from sprout.engine.metrics import MetricsLogger
def main():
    logger = MetricsLogger(sys.argv[1], SimpleNamespace(is_main_process=True))
    try:
        for step in range(1000):
            logger.log({"step": step, "loss": 1.0, "note": "x" * 100})
    finally:
        logger.close()
run_main(main)
"""


@pytest.mark.parametrize("what", ["png", "report", "metrics"])
def test_a_full_disk_stops_reports_naming_the_file(tmp_path, what):
    out = tmp_path / "run"
    out.mkdir()
    lines = [json.dumps({"step": s, "loss": 5.0 - s / 100, "tokens": s, "tokens_per_s": 1.0}) for s in range(200)]
    (out / "metrics.jsonl").write_text("\n".join(lines + [json.dumps({"step": 200, "tokens": 1, "val_loss": 3.0})]) + "\n")
    before = tree(out)
    code, args, name = (LOGGER, [out], "metrics.jsonl") if what == "metrics" else \
        (REPORT_WRITER, [what, out], "loss.png" if what == "png" else "report.md")

    def cap():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = 300 if what == "report" else 2000
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          preexec_fn=cap, timeout=120)
    one_error(proc, str(out / name), "File too large")
    if what != "metrics":
        assert tree(out) == before  # the old files as they were, and no temporary
    else:
        assert not [n for n in tree(out) if ".tmp-" in n]


# ---------------------------------------------------------------- 7. an output folder that cannot be written


@pytest.mark.parametrize("script", ["pretrain.py", "train_sft.py"])
def test_an_output_folder_under_a_file_is_refused_naming_it(script, data, sft_runs, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    before = tree(tmp_path)
    if script == "pretrain.py":
        proc = pretrain(data, blocker / "run")
    else:
        root, base = sft_runs
        proc = sft(root / "a" / "sft.h5", base, blocker / "run")
    one_error(proc, str(blocker), "not a folder")
    assert tree(tmp_path) == before
