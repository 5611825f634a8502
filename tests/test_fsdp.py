"""FSDP2 on CPU over gloo (configs/accelerate/cpu_fsdp.yaml): a sharded 2-process run matches
one process, resumes bit for bit, and writes the same full checkpoint a single process writes.

The module's main runs (`ref`, one process, and `fsdp`, two) share one model with tied
embeddings (as gpt2-small's and SmolLM2's are) and a val set of 33 rows, which 2 ranks cannot
split evenly, so that one launch checks the match, the tied matrix, the bit-for-bit resume and
the uneven evaluation. The short runs (compile, bf16) keep an untied model and check its full
checkpoint (lm_head stored whole) against one process's; an untied resume is checked bit for
bit in one process and on 2 DDP processes (tests/test_train.py)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from proc import free_port, run_group
from test_sft_train import ROW, base, sft_file, train_losses  # noqa: F401, F811 (fixtures)
from test_sft_train import tiny_cfg as sft_cfg
from test_train import data, launch_tiny, losses, tiny_cfg  # noqa: F401, F811 (data: a fixture)

from data_loader.token_batches import eval_rows, open_token_sources, read_tokens
from sprout.checkpoint import load_train_state, read_meta, tied_aliases
from sprout.model.load import load_model
from sprout.model.transformer import Transformer
from sprout.engine.fsdp import optimizer_state_by_index, optimizer_state_by_name
from sprout.engine.metrics import read_metrics
from sprout.stages.pretrain import run_pretrain
from sprout.stages.sft import run_sft

ROOT = Path(__file__).resolve().parents[1]
MICRO = 512  # 2 micro-steps per process: gradient accumulation (no_sync) under FSDP is exercised
EVAL_TOKENS = 2112  # the main runs' val set: 33 rows of 64 tokens, 16 + 17 over 2 ranks
MAIN = ("--model.tie_embeddings", "true", "--data.eval_tokens", str(EVAL_TOKENS))  # the main runs' flags
SHARDED = re.compile(r"FSDP: parameters sharded over 2 process\(es\); rank 0 holds ([\d,]+) of ([\d,]+)")


def launch(data: Path, out: Path, port: int, *args: str, **kw) -> subprocess.CompletedProcess:
    """scripts/pretrain.py on 2 gloo processes with cpu_fsdp.yaml, the tiny config of test_train."""
    return launch_tiny("cpu_fsdp.yaml", data, out, port, *args, micro=MICRO, **kw)


def short_fsdp_and_one(data: Path, tmp_path: Path, port: int, steps: int, *fsdp_flags: str,
                       **launch_kw) -> tuple[Path, Path]:
    """A short 2-process FSDP run (plus `fsdp_flags`) and the plain 1-process run it should match:
    no sequence-length warmup, eval only before and after. Returns (one, fsdp) run dirs."""
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    proc = launch(data, fsdp, port, "--train.max_steps", str(steps), "--train.eval_every", "0",
                  "--data.seq_warmup_frac", "0", *fsdp_flags, **launch_kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert SHARDED.search(proc.stdout), proc.stdout[-2000:]
    cfg = tiny_cfg(data, one, max_steps=steps, eval_every=0, micro_tokens=MICRO)
    cfg.data.seq_warmup_frac = 0
    run_pretrain(cfg)
    return one, fsdp


def main_cfg(data: Path, out: Path):
    """`tiny_cfg` with MICRO and the main runs' flags (MAIN): the 1-process side of `fsdp`."""
    cfg = tiny_cfg(data, out, micro_tokens=MICRO)
    cfg.model.tie_embeddings, cfg.data.eval_tokens = True, EVAL_TOKENS
    return cfg


def assert_same_state(ck: Path, other: Path, atol: float) -> None:
    """Two checkpoints' weights within `atol`, and their optimizer states: the same numbered
    layout, Adam moments within `atol` of each tensor's largest entry."""
    saved, other_saved = (load_file(c / "model.safetensors") for c in (ck, other))
    assert sorted(saved) == sorted(other_saved)
    for k in saved:
        torch.testing.assert_close(saved[k], other_saved[k], rtol=0, atol=atol)
    opt, other_opt = (load_train_state(c)["optimizer"] for c in (ck, other))
    assert opt["param_groups"] == other_opt["param_groups"]  # numbered, as Optimizer.state_dict() has it
    assert sorted(opt["state"]) == sorted(other_opt["state"]) == list(range(len(saved)))
    for i, state in other_opt["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt["state"][i][k].shape == state[k].shape
            assert (opt["state"][i][k] - state[k]).abs().max() <= atol * state[k].abs().max()


def assert_whole(ck: Path) -> dict[str, torch.Tensor]:
    """An FSDP checkpoint holds every tensor of a fresh model of its config whole, not shards, a
    tied matrix once (`tied_aliases`), and loads in one process with lm_head tied exactly when
    the config ties it; returns the saved tensors."""
    saved = load_file(ck / "model.safetensors")
    model, _ = load_model(ck)  # one process, no FSDP
    fresh = Transformer(model.config)
    aliases = tied_aliases(fresh)
    assert {k: v.shape for k, v in saved.items()} == {
        k: v.shape for k, v in fresh.state_dict().items() if k not in aliases}
    assert (model.lm_head.weight is model.embed_tokens.weight) == model.config.tie_embeddings
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    return saved


def grad_norms(out: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def checkpoint(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def ref(data, tmp_path_factory):
    """The reference: one process × 4 micro-steps, checkpoints at 8 and 16 (`main_cfg`)."""
    out = tmp_path_factory.mktemp("ref")
    run_pretrain(main_cfg(data, out))
    return out


@pytest.fixture(scope="module")
def fsdp(data, tmp_path_factory):
    """The same run on 2 FSDP2 processes × 2 micro-steps; returns (run dir, stdout)."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    proc = launch(data, out, free_port(), *MAIN, timeout=120)  # a rank left alone in an eval forward hangs
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_optimizer_state_layouts_round_trip():
    """A gathered FSDP optimizer state (keyed by name) <-> Optimizer.state_dict() (numbered)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight]},
                             {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0}])
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    numbered = opt.state_dict()
    names = ["0.weight", "1.weight", "0.bias", "1.bias"]
    by_name = optimizer_state_by_name(numbered, names)
    assert by_name["param_groups"][1]["params"] == ["0.bias", "1.bias"]
    assert torch.equal(by_name["state"]["1.bias"]["exp_avg"], numbered["state"][3]["exp_avg"])
    back = optimizer_state_by_index(by_name)
    assert back["param_groups"] == numbered["param_groups"]
    assert all(torch.equal(back["state"][i][k], numbered["state"][i][k]) for i in range(4) for k in ("exp_avg", "step"))


@pytest.mark.slow
def test_two_fsdp_processes_match_one(ref, fsdp):
    out, stdout = fsdp
    assert "2 process(es) × 2 micro-steps" in stdout
    # counted from the parameter tensors of the running model: a DDP run prints no such line,
    # and a replicated model would hold all of its parameters on rank 0
    m = SHARDED.search(stdout)
    assert m, stdout[-2000:]
    local, total = (int(g.replace(",", "")) for g in m.groups())
    assert total == 139_584 - 256 * 64 and local < 0.6 * total  # the tied lm_head counted once
    a, b = losses(ref), losses(out)
    assert sorted(b) == sorted(a) == list(range(1, 17))
    diff = max(abs(a[s] - b[s]) for s in a)
    print(f"1 process vs 2 FSDP processes: max |loss diff| over {len(a)} steps = {diff:.3g}")
    assert diff < 1e-5
    na, nb = grad_norms(ref), grad_norms(out)
    assert all(nb[s] == pytest.approx(na[s], rel=1e-4) for s in na)
    va = [r["val_loss"] for r in read_metrics(ref / "metrics.jsonl") if "val_loss" in r]
    vb = [r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert va == pytest.approx(vb, abs=1e-5)


@pytest.mark.slow
def test_fsdp_resume_matches_an_uninterrupted_run_bit_for_bit(fsdp, data, tmp_path):
    out_a, _ = fsdp
    out_b = tmp_path / "resumed"  # a run stopped at step 8: its state is exactly A's step-8 checkpoint
    shutil.copytree(checkpoint(out_a, 8), checkpoint(out_b, 8))
    (out_b / "checkpoints" / "latest").write_text("step_00000008\n")
    proc = launch(data, out_b, free_port(), *MAIN, "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert SHARDED.search(proc.stdout) and "resumed from" in proc.stdout
    a, b = losses(out_a), losses(out_b)
    assert sorted(b) == list(range(9, 17))
    assert [b[s] for s in b] == [a[s] for s in b]  # exact float equality


@pytest.mark.slow
def test_fsdp_eval_with_rows_that_do_not_split_evenly(ref, fsdp):
    """33 val rows over 2 ranks (16 + 17): every forward under FSDP is a collective, so the
    rank with fewer rows must still run as many forwards (it hung before) and count none twice."""
    out, _ = fsdp
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    val = read_tokens(open_token_sources(cfg["data"]["dir"], "val"), cfg["data"]["eval_tokens"] + 1)
    seq_len = cfg["model"]["max_seq_len"]  # the eval's rows: the run's final sequence length
    assert [len(eval_rows(val, seq_len, rank, 2)[0]) for rank in (0, 1)] == [16, 17]
    va, vb = ([r["val_loss"] for r in read_metrics(o / "metrics.jsonl") if "val_loss" in r] for o in (ref, out))
    assert len(va) == len(vb) == 3 and va == pytest.approx(vb, abs=1e-5)  # steps 0, 8, 16


@pytest.mark.slow
def test_fsdp_checkpoint_is_a_full_checkpoint(ref, fsdp, data, tmp_path):
    out, _ = fsdp
    ck = checkpoint(out, 16)
    assert read_meta(ck)["world_size"] == 2
    saved = assert_whole(ck)
    assert "lm_head.weight" not in saved  # tied: stored once, as embed_tokens.weight
    # the weights and optimizer state of the 1-process run's checkpoint, up to the summation
    # order of the 4 micro-batch gradients (measured: weights 1.2e-7 apart; moments 4.9e-7 of
    # each tensor's largest entry)
    assert_same_state(ck, checkpoint(ref, 16), atol=1e-5)
    # and it resumes in one process without FSDP
    one = tmp_path / "one"
    run_pretrain(main_cfg(data, one), resume=str(checkpoint(out, 8)))
    a, b = losses(out), losses(one)
    assert sorted(b) == list(range(9, 17))
    assert max(abs(a[s] - b[s]) for s in b) < 1e-5


@pytest.mark.slow
def test_fsdp_tied_embeddings(ref, fsdp):
    """The shared matrix is stored once and loads tied; the tied run matches one process (its
    resume under FSDP: test_fsdp_resume_matches_an_uninterrupted_run_bit_for_bit)."""
    out, _ = fsdp
    for run in (ref, out):
        saved = load_file(checkpoint(run, 16) / "model.safetensors")
        assert "embed_tokens.weight" in saved and "lm_head.weight" not in saved
    model, _ = load_model(checkpoint(out, 16))
    assert model.lm_head.weight is model.embed_tokens.weight
    a, r = losses(out), losses(ref)
    assert sorted(a) == sorted(r) == list(range(1, 17)) and max(abs(a[s] - r[s]) for s in r) < 1e-5


@pytest.mark.slow
def test_fsdp1_on_cpu_is_refused(data, tmp_path):
    proc = launch(data, tmp_path / "x", free_port(), "--train.max_steps", "1", launch_args=("--fsdp_version", "1"))
    assert proc.returncode != 0
    assert "error: accelerate config: FSDP on CPU needs fsdp_config.fsdp_version 2, not 1" in proc.stderr


@pytest.mark.slow
def test_fsdp_sft_from_a_base_checkpoint_matches_one_process(sft_file, base, tmp_path):
    """SFT's --init loads the base weights before the model is sharded; masked loss and metrics agree."""
    run_sft(sft_cfg(sft_file, base, tmp_path / "one"))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_fsdp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "train_sft.py"), "--init", str(base), "--data", str(sft_file),
           "--out", str(tmp_path / "fsdp"), "--batch.global_tokens", str(8 * ROW),
           "--batch.micro_tokens", str(4 * ROW), "--train.max_steps", "16", "--optim.warmup_steps", "2",
           "--optim.lr", "3e-3", "--optim.weight_decay", "0", "--train.log_every", "1", "--train.eval_every", "8",
           "--train.ckpt_every", "8", "--train.progress", "false"]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FSDP: parameters sharded over 2 process(es)" in proc.stdout
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    assert sorted(a) == sorted(b)
    assert max(abs(a[s][i] - b[s][i]) for s in a for i in range(3)) < 1e-5  # loss, accuracy, entropy


@pytest.mark.slow
def test_fsdp_with_torch_compile_matches_eager_one_process(data, tmp_path):
    """The gpt2-small preset's path (FSDP2 + torch.compile), on CPU: same losses as eager, 1 process."""
    one, fsdp = short_fsdp_and_one(data, tmp_path, free_port(), 4, "--train.compile", "true")
    a, b = losses(one), losses(fsdp)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5
    assert "lm_head.weight" in assert_whole(checkpoint(fsdp, 4))  # untied: lm_head stored whole
    assert_same_state(checkpoint(fsdp, 4), checkpoint(one, 4), atol=1e-4)


@pytest.mark.slow
def test_fsdp_with_bf16_mixed_precision(data, tmp_path):
    """fsdp.yaml's GPU setting (FSDP2 + bf16) on CPU: bf16 compute, fp32 master weights and checkpoint."""
    one, fsdp = short_fsdp_and_one(data, tmp_path, free_port(), 3, "--train.mixed_precision", "bf16",
                                   launch_args=("--mixed_precision", "bf16"))
    a, b = losses(one), losses(fsdp)
    assert sorted(b) == [1, 2, 3]
    print("fp32 vs FSDP bf16 losses:", {s: (a[s], b[s]) for s in a})
    # bf16 rounds activations and gradients (8 bits of mantissa): close to fp32 (measured: at most
    # 1.9e-4 apart over 3 steps), never equal
    assert all(abs(a[s] - b[s]) < 5e-3 for s in a) and any(a[s] != b[s] for s in a)
    saved = load_file(checkpoint(fsdp, 3) / "model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.float32}
    assert "lm_head.weight" in assert_whole(checkpoint(fsdp, 3))
