"""Run folders: a fresh run never overwrites another silently, --overwrite deletes only the run's
files, `--out DIR --resume` continues with the run's own config and length, a finished run has
nothing to do, and SIGTERM stops after a step with a checkpoint that resumes bit for bit."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from proc import run_here
from test_train import V, losses, tiny_cfg, write_data

from sprout.config import dump_yaml
from sprout.errors import SproutError
from sprout.stages.pretrain import PretrainConfig, run_pretrain
from sprout.engine.cli import RUN_LOCK, check_fresh_run, clear_run, parse_run_config, run_files, run_parser

ROOT = Path(__file__).resolve().parents[1]

# tiny_cfg's settings as command-line flags (scripts/pretrain.py)
FLAGS = {"model.vocab_size": V, "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
         "model.max_seq_len": 64, "data.seq_len_start": 16, "data.seq_warmup_frac": 0.25,
         "data.eval_tokens": 2048, "batch.global_tokens": 2048, "batch.micro_tokens": 1024,
         "optim.warmup_steps": 2, "optim.lr": 3e-3, "train.log_every": 1, "train.eval_every": 8,
         "train.ckpt_every": 8, "train.progress": "false", "train.peak_tflops": -1}


def flags(**changes) -> list[str]:
    merged = {**FLAGS, **{k.replace("__", "."): v for k, v in changes.items()}}
    return [str(a) for k, v in merged.items() for a in (f"--{k}", v)]


def pretrain(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts" / "pretrain.py"), *args]
    return run_here(cmd, cwd=ROOT)  # one torch thread: the suite's (tests/conftest.py)


def tree_hash(folder: Path) -> str:
    """sha256 over every path, file content and mtime under `folder`."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
            h.update(str(p.stat().st_mtime_ns).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


def small_run(data: Path, out: Path, **kw) -> Path:
    """A 4-step run (checkpoints at 2 and 4) with config.yaml, metrics, report, plot."""
    run_pretrain(tiny_cfg(data, out, **{"max_steps": 4, "eval_every": 2, "ckpt_every": 2, **kw}))
    return out


def parse(monkeypatch, *argv: str) -> PretrainConfig:
    monkeypatch.setattr(sys, "argv", ["scripts/pretrain.py", *argv])
    return parse_run_config(run_parser("doc", "configs/*/pretrain.yaml"), PretrainConfig)[1]


# ---- no silent overwrite ----------------------------------------------------------------------
def test_fresh_run_into_a_run_folder_is_refused_and_overwrite_clears_only_the_run(data, tmp_path):
    out = small_run(data, tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "plot.png").write_bytes(b"x")
    before = tree_hash(out)
    proc = pretrain("--data", str(data), "--out", str(out), *flags(train__max_steps=2))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"error: {out} holds a run at step 4; pass --resume to continue it "
                           f"or --overwrite to start again\n")
    assert tree_hash(out) == before  # nothing touched

    proc = pretrain("--data", str(data), "--out", str(out), "--overwrite", *flags(train__max_steps=2))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000002"]
    assert sorted(losses(out)) == [1, 2]
    assert (out / "notes.txt").read_text() == "mine" and (out / "mine" / "plot.png").read_bytes() == b"x"


def test_overwrite_refused_by_the_inputs_leaves_the_old_run_whole(data, tmp_path):
    """--overwrite deletes the old run only once the new run's inputs are checked."""
    out = small_run(data, tmp_path / "run")
    (out / RUN_LOCK).write_text("12345\n")  # the pid of the trainer that held it last
    before = tree_hash(out)
    proc = pretrain("--data", str(tmp_path / "missing"), "--out", str(out), "--overwrite", *flags(train__max_steps=2))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "missing" in proc.stderr and "deleted" not in proc.stdout
    assert tree_hash(out) == before  # the lock file too: the folder is taken only once the inputs are checked


def test_clear_run_deletes_the_run_files_and_its_tensorboard_folder_only(tmp_path):
    out = tmp_path / "run"
    for name in ("checkpoints/step_00000002", "tokenizer", "sprout/events", "mine"):
        (out / name).mkdir(parents=True)
    for name in ("metrics.jsonl", "report.md", "loss.png", "notes.txt"):
        (out / name).write_text("x")
    (out / "config.yaml").write_text(dump_yaml({"train": {"trackers": ["tensorboard"]}}))
    with pytest.raises(SproutError, match=r"holds a run at step 2; pass --resume to continue it or --overwrite"):
        check_fresh_run(out)
    clear_run(out)
    assert sorted(p.name for p in out.iterdir()) == ["mine", "notes.txt"]
    check_fresh_run(out)  # nothing of a run left
    (out / "sprout").mkdir()  # a folder of that name without a run's config naming tensorboard is not the run's
    assert run_files(out) == []


def test_files_of_a_run_without_a_checkpoint_are_refused_too(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SproutError, match=r"holds the files of a run without a checkpoint \(metrics.jsonl\); "
                                          r"pass --overwrite to start again"):
        check_fresh_run(tmp_path)


# ---- resume with the run's own config -----------------------------------------------------------
def test_resume_from_out_alone_continues_with_the_runs_config_and_length(data, tmp_path):
    ref = small_run(data, tmp_path / "ref")
    out = small_run(data, tmp_path / "run")
    step4 = out / "checkpoints" / "step_00000004"
    for f in step4.iterdir():
        f.unlink()
    step4.rmdir()
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    proc = pretrain("--out", str(out), "--resume")  # no --config, no --data: the run's config.yaml
    assert proc.returncode == 0, proc.stderr
    assert "->" not in proc.stdout and "| 4 steps;" in proc.stdout  # kept its length, not the default's
    assert losses(out) == losses(ref)  # steps 3, 4 bit for bit

    proc = pretrain("--out", str(out), "--resume")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == f"nothing to do: {out} is complete at step 4; pass --train.max_steps N to train longer\n"


def test_a_length_change_is_printed_and_only_comes_from_the_command_line(data, tmp_path, monkeypatch, capsys):
    out = small_run(data, tmp_path / "run")
    capsys.readouterr()
    cfg = parse(monkeypatch, "--out", str(out), "--resume", "--train.max_steps", "6")
    assert cfg.train.max_steps == 6 and capsys.readouterr().out == \
        "train.max_steps 4 -> 6 (from the command line)\n"
    assert cfg.data.dir == str(data) and cfg.model.d_model == 64 and cfg.optim.lr == 3e-3  # the run's config
    saved = yaml.safe_load((out / "config.yaml").read_text())
    saved["train"]["max_steps"] = 50
    config = tmp_path / "longer.yaml"  # a config that differs only in its length keeps the run's
    config.write_text(dump_yaml(saved))
    (out / "checkpoints" / "latest").write_text("step_00000002\n")  # as if stopped at step 2
    cfg = parse(monkeypatch, "--config", str(config), "--out", str(out), "--resume", "--train.log_every", "2")
    assert cfg.train.max_steps == 4 and cfg.train.log_every == 2
    assert "train.max_steps 50 ignored: the run keeps its length of 4 steps" in capsys.readouterr().out
    (out / "checkpoints" / "latest").write_text("step_00000004\n")
    with pytest.raises(SystemExit) as exc:
        parse(monkeypatch, "--out", str(out), "--resume")
    assert exc.value.code == 0 and capsys.readouterr().out.startswith(f"nothing to do: {out} is complete at step 4")
    with pytest.raises(SproutError, match="--resume continues the run in --out and --overwrite deletes it"):
        parse(monkeypatch, "--out", str(out), "--resume", "--overwrite")


def test_resume_with_a_config_that_changes_a_bound_field_names_it(data, tmp_path):
    out = small_run(data, tmp_path / "run")
    cfg = tiny_cfg(data, out, max_steps=6, eval_every=2, ckpt_every=2)
    cfg.optim.lr = 1e-3
    with pytest.raises(SproutError, match=r"different config.*optim\.lr 0\.003 != 0\.001"):
        run_pretrain(cfg, resume="latest")


# ---- interrupts ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_that_resumes_bit_for_bit(data, tmp_path):
    ref = tmp_path / "ref"
    run_pretrain(tiny_cfg(data, ref, max_steps=40, ckpt_every=100, peak_tflops=-1))
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--data", str(data), "--out", str(out),
           *flags(train__max_steps=40, train__ckpt_every=100)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line.startswith("step 1/40"):
            proc.send_signal(signal.SIGTERM)
            break
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM: stopping after this step with a checkpoint" in stderr and "Traceback" not in stderr
    stopped = max(losses(out))
    assert 1 <= stopped < 40
    ckpt = out / "checkpoints" / f"step_{stopped:08d}"
    assert f"stopped by SIGTERM at step {stopped} of 40; checkpoint {ckpt}" in stdout
    command = stdout.split("resume with:\n  ")[1].splitlines()[0]
    assert command == f"python {ROOT / 'scripts' / 'pretrain.py'} --out {out} --resume"
    assert (out / "report.md").is_file() and (out / "loss.png").is_file()
    proc = pretrain("--out", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert losses(out) == losses(ref)  # every step, exact float equality


# ---- --help --------------------------------------------------------------------------------------
def test_help_lists_every_field_with_type_default_choices_and_meaning():
    proc = pretrain("--help")
    assert proc.returncode == 0
    text = proc.stdout
    assert "--overwrite" in text and "--resume" in text
    rows = {" ".join(row.split()) for row in text.splitlines()}  # columns aligned to the longest name
    for line in ("--optim.schedule {cosine, wsd, constant} = cosine",
                 "--train.mixed_precision {auto, bf16, no} = auto",
                 "--train.gradient_checkpointing bool = false",
                 "--data.sampler {sequential, random} = sequential",
                 "--train.max_steps int in [1, inf) | {auto} | null = null",
                 "--batch.global_tokens int in [1, inf) = 524288",
                 "--optim.beta2 float in [0, 1) = 0.95",
                 "--model.n_kv_heads int in [1, inf) | null = null",
                 "--train.trackers list of {tensorboard, wandb} = []"):
        assert line in rows, line
    assert "tokens per parameter for that budget" in text  # a field's meaning, from its comment


@pytest.mark.parametrize("script", ["prepare_pretrain_data", "prepare_sft_data", "prepare_preference_data",
                                    "prepare_rl_prompts", "train_tokenizer", "train_sft"])
def test_every_script_lists_its_config_fields(script):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "config fields (" in proc.stdout, proc.stderr


# ---- bad values at load, through the script --------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--train.max_steps", "0"], "command line: --train.max_steps: got 0; expected an integer in [1, inf), auto or null"),
    (["--batch.micro_tokens", "0"], "command line: --batch.micro_tokens: got 0; expected an integer in [1, inf)"),
    (["--optim.beta2", "1.5"], "command line: --optim.beta2: got 1.5; expected a number in [0, 1)"),
    (["--optim.min_lr_ratio", "2"], "command line: --optim.min_lr_ratio: got 2; expected a number in [0, 1]"),
    (["--optim.eps", "0"], "command line: --optim.eps: got 0; expected a number in (0, inf)"),
    (["--model.init_std", "-1"], "command line: --model.init_std: got -1; expected a number in (0, inf)"),
    (["--optim.lr", "nan"], "command line: --optim.lr: got 'nan'; expected a number in (0, inf)"),
    (["--train.max-stepz", "3"], "command line: unknown option --train.max_stepz (did you mean --train.max_steps?)"),
])
def test_bad_values_are_refused_in_one_line(data, tmp_path, args, message):
    proc = pretrain("--data", str(data), "--out", str(tmp_path / "x"), *flags(), *args)
    assert proc.returncode == 2 and proc.stderr == f"error: {message}\n"
    assert not (tmp_path / "x").exists()


def test_a_run_whose_config_lacks_a_field_is_refused_on_resume(tmp_path, monkeypatch):
    """A config.yaml without one of the config's fields was written by an earlier version of
    sprout: --resume refuses it in one line naming the file and the field."""
    from sprout.config import config_to_dict, from_dict
    from sprout.formats.checkpoint_meta import meta_digest
    from sprout.stages.configs import GRPOConfig

    fresh = config_to_dict(from_dict(GRPOConfig, {"grpo": {"beta": 0.1}, "train": {"max_steps": 4}}))
    old = {**fresh, "grpo": {k: v for k, v in fresh["grpo"].items() if k != "use_bias_correction_kl"}}
    out = tmp_path / "grpo"
    ckpt = out / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    meta = {"format": "sprout-checkpoint-v1", "architecture": "lm", "stage": "grpo", "step": 2}
    (ckpt / "meta.json").write_text(json.dumps({**meta, "meta_sha256": meta_digest(meta)}))
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    (out / "config.yaml").write_text(dump_yaml(old))
    monkeypatch.setattr(sys, "argv", ["scripts/train_grpo.py", "--out", str(out), "--resume"])
    with pytest.raises(SproutError) as err:
        parse_run_config(run_parser("doc", "configs/*/grpo.yaml"), GRPOConfig)
    assert str(err.value) == (f"{out / 'config.yaml'}: no grpo.use_bias_correction_kl (written by an earlier "
                              f"version of sprout); train the run again (--overwrite)")
    (out / "config.yaml").write_text(dump_yaml(fresh))
    assert parse_run_config(run_parser("doc", "configs/*/grpo.yaml"), GRPOConfig)[1].grpo.use_bias_correction_kl
