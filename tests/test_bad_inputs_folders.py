"""A run folder is never written through a symbolic link, a signal during a run's setup or its
end-of-run samples ends it cleanly, and what sprout writes follows the user's umask.

Each refusal runs the real script (`proc.run_here`, or a subprocess where a signal is sent) and
checks the exit status, the one `error:` line naming the link, the file the link points to
unchanged and the run folder entry for entry as it was (links by their target, files by their
bytes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from proc import free_port, one_error, run_here, run_until, tree
from test_run_folders import flags
from test_train import write_data

from sprout.atomic import atomic_path, atomic_write, open_append
from sprout.locks import hold_lock
from sprout.checkpoint import save_checkpoint
from sprout.engine import cli as run_cli
from sprout.engine.callbacks import StopSignals
from sprout.engine.cli import RUN_LOCK, check_fresh_run, clear_deferred, run_lock, setup_finished
from sprout.engine.metrics import read_metrics
from sprout.errors import SproutError
from sprout.model.transformer import ModelConfig, Transformer
from sprout.prep.sft_data import SFTDataConfig
from sprout.prep.sft_data import prepare as prepare_sft

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


def pretrain(*args, **kw) -> subprocess.CompletedProcess:
    return run_here([sys.executable, str(SCRIPTS / "pretrain.py"), *map(str, args)], cwd=ROOT, **kw)


def tiny_run(data: Path, out: Path) -> Path:
    """A finished 2-step pretraining run in `out` (config.yaml, metrics, report, checkpoints)."""
    proc = pretrain("--data", data, "--out", out, *flags(train__max_steps=2, train__eval_every=2, train__ckpt_every=2))
    assert proc.returncode == 0, proc.stderr
    return out


# ---- no write through a link -------------------------------------------------------------------
LINKED = {  # what the link in the run folder is called -> a file (or a folder) outside the run
    RUN_LOCK: "file", "config.yaml": "file", "metrics.jsonl": "file", "report.md": "file", "loss.png": "file",
    "checkpoints": "folder", "tokenizer": "folder", "sprout": "folder", "tokenizer/tiny.model": "file",
}


@pytest.mark.parametrize("name", LINKED)
def test_a_link_where_the_trainer_writes_is_refused_and_nothing_is_written(name, data, tmp_path):
    outside = tmp_path / "outside"
    if LINKED[name] == "file":
        outside.write_text("precious\n")
    else:
        outside.mkdir()
        (outside / "precious.txt").write_text("precious\n")
    out = tmp_path / "run"
    (out / name).parent.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / name).symlink_to(outside)
    before, outside_before = tree(out), tree(tmp_path)
    proc = pretrain("--data", data, "--out", out, *flags(train__max_steps=2))
    one_error(proc, f"{out / name}: is a symbolic link (to {outside})", alone=True)
    assert tree(out) == before and tree(tmp_path) == outside_before
    assert (outside.read_text() if outside.is_file() else (outside / "precious.txt").read_text()) == "precious\n"


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_a_link_in_a_finished_run_is_refused_on_resume_and_overwrite(flag, data, tmp_path):
    """The run's metrics.jsonl replaced by a link to a copy outside: --resume would rewrite it
    from its checkpoint, --overwrite delete it; both are refused before either."""
    out = tiny_run(data, tmp_path / "run")
    outside = tmp_path / "metrics_copy.jsonl"
    outside.write_bytes((out / "metrics.jsonl").read_bytes())
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(outside)
    before, copy = tree(out), outside.read_bytes()
    args = ["--out", out, "--resume", "--train.max_steps", "4"] if flag == "--resume" else \
        ["--data", data, "--out", out, "--overwrite", *flags(train__max_steps=2)]
    one_error(pretrain(*args), f"{out / 'metrics.jsonl'}: is a symbolic link", alone=True)
    assert tree(out) == before and outside.read_bytes() == copy


def test_the_lock_file_is_never_opened_through_a_link_nor_a_hard_link(tmp_path):
    """`hold_lock` itself (the run folder's check comes first in a trainer): a link put in place
    after that check is still refused (O_NOFOLLOW), and a hard link to a file elsewhere too."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / RUN_LOCK).symlink_to(outside)
    with pytest.raises(SproutError, match=rf"{tmp_path / 'a' / RUN_LOCK}: is a symbolic link \(to {outside}\)"):
        hold_lock(tmp_path / "a", RUN_LOCK, "trainer")
    (tmp_path / "b").mkdir()
    os.link(outside, tmp_path / "b" / RUN_LOCK)
    with pytest.raises(SproutError, match=rf"{tmp_path / 'b' / RUN_LOCK}: has 1 other hard link"):
        hold_lock(tmp_path / "b", RUN_LOCK, "trainer")
    assert outside.read_text() == "precious\n"


def test_an_appended_log_is_never_opened_through_a_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(SproutError, match="metrics.jsonl: is a symbolic link"):
        open_append(tmp_path / "metrics.jsonl", "trainer")
    assert outside.read_text() == "precious\n"
    with open_append(tmp_path / "own.jsonl") as f:
        f.write("a\n")
    with open_append(tmp_path / "own.jsonl") as f:
        f.write("b\n")
    assert (tmp_path / "own.jsonl").read_text() == "a\nb\n"


# ---- setup ends early: the run folder as it was ------------------------------------------------
def test_a_setup_that_fails_puts_back_what_it_wrote_and_what_overwrite_moved(data, tmp_path):
    """`run_lock` around a setup that deletes the old run (--overwrite), writes a config and a
    tokenizer copy, then fails: the old run comes back whole, the lock file too."""
    out = tiny_run(data, tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    check_fresh_run(out, overwrite=True, defer=True)
    with pytest.raises(SproutError, match="refused in setup"):
        with run_lock(out):
            clear_deferred(out)
            assert not (out / "checkpoints").exists()
            with atomic_write(out / "config.yaml", "w") as f:
                f.write("new: 1\n")
            (out / "tokenizer").mkdir()
            (out / "tokenizer" / "x.model").write_bytes(b"x")
            raise SproutError("refused in setup")
    assert tree(out) == before


def test_a_finished_setup_keeps_nothing_of_the_folder_it_recorded(data, tmp_path):
    """What the setup recorded to put the folder back (metrics.jsonl's bytes among it) is dropped
    at the first step, not kept for the rest of the run."""
    out = tiny_run(data, tmp_path / "run")
    with run_lock(out):
        setup = run_cli._setups[out.resolve()]
        assert setup.entries["metrics.jsonl"] is not None and setup.lock_before is not None
        setup_finished(out)
        assert (setup.entries, setup.temps, setup.lock_before) == ({}, set(), None)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fresh", "overwrite", "resume"])
def test_sigterm_during_setup_leaves_the_run_folder_as_it_was(how, data, tmp_path):
    """SIGTERM once the run has taken its folder, written its config.yaml (and, on a resume,
    cut metrics.jsonl back to its checkpoint), before its first step (the matmul peak is being
    measured): the folder is as it was, the lock file included, and the exit status 143."""
    out = tmp_path / "run"
    if how == "fresh":
        out.mkdir()
    else:
        tiny_run(data, out)
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    script = [sys.executable, SCRIPTS / "pretrain.py"]
    if how == "resume":
        cmd = [*script, "--out", out, "--resume", "--train.max_steps", "6", "--train.peak_tflops", "0"]
    else:
        cmd = [*script, "--data", data, "--out", out, *flags(train__max_steps=4, train__peak_tflops=0)]
        cmd += ["--overwrite"] if how == "overwrite" else []
    proc, _ = run_until(cmd, "pretrain: model")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "Traceback" not in proc.stderr and "deleted" not in proc.stdout
    assert f"stopped by SIGTERM before the first step; {out} is as it was before this run" in proc.stdout
    assert tree(out) == before


@pytest.fixture(scope="module")
def sft_setup(sp, tmp_path_factory):
    """An SFT prep and a tiny base checkpoint with the `sp` tokenizer."""
    root = tmp_path_factory.mktemp("sft")
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(80)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SFTDataConfig(tokenizer=sp.spec, out=str(root / "prep" / "sft.h5"), seq_len=32, val_fraction=0.2,
                        sources=[{"name": "chat", "format": "chat", "path": str(root / "chat.jsonl")}])
    prepare_sft(cfg, sp, log=lambda *a: None)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    base = save_checkpoint(root / "base", model, meta={"model_config": model.config, "tokenizer": sp.spec,
                                                       "stage": "pretrain", "step": 1})
    return root / "prep" / "sft.h5", base


def sft_command(sft_setup, out: Path, *launch, processes: int = 1) -> list:
    """train_sft.py for 2 steps with 3,000 sample prompts (a minute or more of answers on this
    model), after `launch` (e.g. accelerate launch and its options, for `processes`)."""
    data, base = sft_setup
    prompts = json.dumps([f"What is {i} plus {i}?" for i in range(3000)])
    return [*(launch or [sys.executable]), SCRIPTS / "train_sft.py", "--data", data, "--init", base, "--out", out,
            "--batch.global_tokens", 64 * processes, "--batch.micro_tokens", "64", "--train.max_steps", "2",
            "--train.progress", "false", "--train.peak_tflops", "-1", "--sample_prompts", prompts]


def check_stopped_samples(out: Path) -> None:
    """The run in `out` is complete, its report says SIGTERM stopped the samples, and resuming
    it has nothing to do (what a pipeline's rerun does with a stage stopped so)."""
    record = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "samples")
    assert record["stopped"] == "SIGTERM" and record["samples"] == []
    assert "None: SIGTERM stopped them at step 2." in (out / "report.md").read_text()
    assert (out / "checkpoints" / "step_00000002").is_dir()
    again = run_here([sys.executable, str(SCRIPTS / "train_sft.py"), "--out", str(out), "--resume"], cwd=ROOT)
    assert again.returncode == 0 and f"nothing to do: {out} is complete at step 2" in again.stdout, again.stderr


@pytest.mark.slow
def test_sigterm_during_the_end_of_run_samples_stops_them_and_writes_the_report(sft_setup, tmp_path):
    """SIGTERM once training is done stops the samples within seconds; the report is written,
    saying so, and the trainer exits 143, as a stopped command (a pipeline stops there)."""
    out = tmp_path / "run"
    proc, took = run_until(sft_command(sft_setup, out), "step 2/2", wait=3.0)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "SIGTERM: stopping the end-of-run samples; the report follows" in proc.stderr
    assert "samples: stopped by SIGTERM; the report has none" in proc.stdout and "Traceback" not in proc.stderr
    assert f"stopped by SIGTERM after the last step: {out} is complete at step 2" in proc.stdout
    assert took < 15, took
    check_stopped_samples(out)


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_before_the_same_sample(sft_setup, tmp_path):
    """2 processes (DDP over gloo): SIGTERM to rank 1 alone during the samples. Rank 0 learns
    of it before its next prompt, so both stop within seconds (rank 0 went on alone for minutes
    when rank 1 stopped at once), the report is written and the launch fails."""
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              ROOT / "configs" / "accelerate" / "cpu_ddp.yaml", "--main_process_port", free_port()]
    proc, took = run_until(sft_command(sft_setup, out, *launch, processes=2), "step 2/2", wait=3.0, rank=1,
                           timeout=120)
    assert took < 20, took
    # the launcher's report: a worker that left with 143 (the other one too, unless the launcher's
    # SIGTERM to what remains came first, as it does once one has failed)
    assert proc.returncode == 1 and "exitcode  : 143" in proc.stderr, proc.stderr[-3000:]
    assert "samples: stopped by SIGTERM; the report has none" in proc.stdout
    check_stopped_samples(out)


def _stop_after_step(rank: int, port: int, signums: tuple, results) -> None:
    """One of 2 gloo processes: `StopSignals.after_step` with `signums[rank]` received here."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        def reduce(t, op):  # what Accelerator.reduce(t, "sum") does
            torch.distributed.all_reduce(t)
            return t

        acc = SimpleNamespace(num_processes=2, device=torch.device("cpu"), reduce=reduce)
        run = SimpleNamespace(trainer=SimpleNamespace(accelerator=acc, steps_done=1, cfg=SimpleNamespace(max_steps=5)),
                              stopping=False, interrupted=None)
        stop = StopSignals()
        stop.signum = signums[rank]
        stop.after_step(run)
        results.put((rank, run.stopping, run.interrupted))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("signums, agreed", [((signal.SIGINT, signal.SIGTERM), signal.SIGTERM),
                                             ((None, signal.SIGINT), signal.SIGINT), ((None, None), None)])
def test_two_processes_stop_on_the_same_signal(signums, agreed):
    """Ranks that received different signals agree on one they received (the larger number),
    never on a number in between (the mean of SIGINT and SIGTERM is SIGFPE's)."""
    ctx = multiprocessing.get_context("fork")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_stop_after_step, args=(rank, port, signums, results)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got = sorted(results.get(timeout=1) for _ in procs)
    assert got == [(rank, agreed is not None, agreed) for rank in range(2)]


# ---- the umask -------------------------------------------------------------------------------------
def modes(folder: Path) -> set[tuple[str, int]]:
    """("dir" | "file", permission bits) of `folder` and everything in it."""
    found = {("dir", stat.S_IMODE(folder.stat().st_mode))}
    for p in folder.rglob("*"):
        found.add(("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode)))
    return found


@pytest.fixture()
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


@pytest.mark.parametrize("umask", [0o002, 0o027], indirect=True, ids=["002", "027"])
def test_a_run_and_its_export_follow_the_umask(umask, data, sp, tmp_path):
    """Files 0666 & ~umask, folders 0777 & ~umask, as `open` and `mkdir` give them: a training
    run's folder (checkpoints built in a temporary folder, safetensors' own 0600 files), an export
    (scripts/export_hf.py, built the same way) and each atomic write."""
    want = {("dir", 0o777 & ~umask), ("file", 0o666 & ~umask)}
    out = tiny_run(data, tmp_path / "run")
    assert modes(out) == want
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    ckpt = save_checkpoint(tmp_path / "ckpt", model, meta={"model_config": model.config, "tokenizer": sp.spec})
    assert modes(ckpt) == want
    proc = run_here([sys.executable, str(SCRIPTS / "export_hf.py"), str(ckpt), str(tmp_path / "hf"), "--no-check"],
                    cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert modes(tmp_path / "hf") == want
    from safetensors.torch import save_file

    (tmp_path / "atomic").mkdir()
    with atomic_path(tmp_path / "atomic" / "w.safetensors") as tmp:
        save_file({"w": torch.zeros(2)}, tmp)
    with atomic_write(tmp_path / "atomic" / "a.txt", "w") as f:
        f.write("a")
    assert modes(tmp_path / "atomic") == want

