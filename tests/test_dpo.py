"""The DPO stage: margins grow and held-out implicit accuracy rises on a seeded toy, precomputed
reference log-probs equal the live reference's (cache reused, and invalidated when the data or
the reference changes), an empty response gives a finite loss and gradient, reference-free
losses build no reference, exact resume, refused options, 1 vs 2 processes for sigmoid,
sigmoid_norm and aot (slow)."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from preference_train_fixtures import (base, cli_flags, grouped_held_out_pairs, marked_pairs, tiny_cfg,  # noqa: F401 (base: a fixture)
                                       resume_folder, write_lm, write_pairs)
from proc import free_port, run_group

from data_loader.preference_batches import PreferenceLoader
from sprout.checkpoint import read_meta
from sprout.errors import SproutError
from sprout.formats.preference_pairs import write_preferences
from sprout.losses.tokens import sequence_logps
from sprout.model.load import load_model
import sprout.stages.dpo as dpo_stage
from sprout.engine.trainer import TrainConfig, make_accelerator
from sprout.stages.dpo import DPOConfig, DPOLossConfig, DPOStage, run_dpo
from sprout.stages.preference_stage import pair_groups
from sprout.engine.metrics import read_metrics
from sprout.stages.reference_logps import reference_logps

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("prefs"))


@pytest.fixture(scope="module")
def run_a(data, base, tmp_path_factory):
    """12 steps with a live (frozen) reference."""
    out = tmp_path_factory.mktemp("dpo_a")
    return out, run_dpo(tiny_cfg(DPOConfig, data, base, out, lr=1e-3))


def train_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def test_margins_grow_and_held_out_accuracy_rises(run_a):
    out, result = run_a
    first, last = result["first_eval"], result["last_eval"]
    assert first["val_rewards/margins"] == 0.0 and first["val_loss"] == pytest.approx(0.6931, abs=1e-4)
    assert last["val_rewards/accuracies"] > 0.5 and last["val_rewards/margins"] > 0.1
    assert last["val_loss"] < first["val_loss"] - 0.05
    rec = train_records(out)
    assert rec[12]["rewards/margins"] > rec[1]["rewards/margins"]
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected",
            "logits/chosen", "logits/rejected", "targets"} <= set(rec[1])
    assert rec[1]["targets"] == 16  # pairs of the global batch
    meta = read_meta(out / "checkpoints")
    assert meta["stage"] == "dpo" and meta["architecture"] == "lm" and "reference" in meta["frozen_models"]
    model, _ = load_model(out)
    assert type(model).__name__ == "Transformer"


def test_resume_matches_an_uninterrupted_run_bit_for_bit(run_a, data, base, tmp_path):
    out_a, _ = run_a
    out_b = resume_folder(out_a, 6, tmp_path / "dpo_b")
    run_dpo(tiny_cfg(DPOConfig, data, base, out_b, lr=1e-3), resume="latest")
    a, b = train_records(out_a), train_records(out_b)
    assert sorted(b) == list(range(7, 13))
    assert [(b[s]["loss"], b[s]["rewards/margins"]) for s in b] == [(a[s]["loss"], a[s]["rewards/margins"]) for s in b]


def test_a_resume_against_another_reference_is_refused(run_a, data, base, sp, tmp_path, monkeypatch):
    """The reference is the init checkpoint (a path a resume may change): the checkpoint records
    its weights' sha256, and a resume whose init is now another model is refused in one line,
    before the stage's setup (which would prepare the reference or precompute its log-probs)."""
    setups = []
    monkeypatch.setattr(dpo_stage.DPOStage, "setup", lambda self, trainer: setups.append(trainer))
    out_a, _ = run_a
    assert read_meta(out_a / "checkpoints")["frozen_models"]["reference"]["weights_sha256"] == \
        read_meta(base)["files"]["model.safetensors"]
    out_b = resume_folder(out_a, 6, tmp_path / "dpo_b")
    other = write_lm(tmp_path / "other" / "ckpt", sp, seed=5)
    with pytest.raises(SproutError, match=r"step_00000006: the run's reference was .*, now .*other/ckpt "
                                          r"\(weights_sha256 .*refusing to resume against another model"):
        run_dpo(tiny_cfg(DPOConfig, data, other, out_b, lr=1e-3), resume="latest")
    assert setups == []


def test_precomputed_reference_gives_the_live_run(run_a, data, base, tmp_path):
    """The same run with the reference log-probs precomputed: the same losses, and the cache files."""
    out = tmp_path / "pre"
    run_dpo(tiny_cfg(DPOConfig, data, base, out, lr=1e-3, precompute_ref_logps=True))
    a, b = train_records(run_a[0]), train_records(out)
    assert max(abs(a[s]["loss"] - b[s]["loss"]) for s in a) < 1e-5
    assert len(list(data.parent.glob("preferences.jsonl.ref_logps.*.safetensors"))) == 1
    assert len(list(data.parent.glob("preferences_dev.jsonl.ref_logps.*.safetensors"))) == 1


# ---- the reference log-prob cache -------------------------------------------------------------------------
def live_logps(ref, loader):
    chosen, rejected = torch.zeros(loader.num_pairs), torch.zeros(loader.num_pairs)
    with torch.no_grad():
        for i in range(loader.num_pairs):
            b = loader.collate([i])
            lp = sequence_logps(ref(b["input_ids"]), b["targets"], b["loss_mask"])[0]  # alone: no padding
            chosen[i], rejected[i] = lp[0], lp[1]
    return chosen, rejected


def test_reference_cache_equals_live_is_reused_and_invalidated(sp, base, tmp_path):
    folder = tmp_path / "prefs"
    data = write_pairs(folder, n_train=10, n_test=5, seed=3)
    acc = Accelerator(cpu=True)
    ref, _ = load_model(base)
    loaders = lambda: tuple(PreferenceLoader(p, sp, 4, 64, shuffle=False)  # noqa: E731
                            for p in (data, folder / "preferences_dev.jsonl"))
    first = reference_logps(acc, ref, str(base), sp.fingerprint(), loaders(), micro_pairs=3)
    assert first.reused == (False, False)
    for got, loader in zip((first.train, first.val), loaders()):
        want = live_logps(ref, loader)
        assert torch.allclose(got[0], want[0], atol=1e-4) and torch.allclose(got[1], want[1], atol=1e-4)
        assert (got[0] < 0).all() and not torch.equal(got[0], got[1])
    stamp = first.paths[0].stat().st_mtime_ns
    again = reference_logps(acc, ref, str(base), sp.fingerprint(), loaders(), micro_pairs=3)
    assert again.reused == (True, True) and again.paths == first.paths
    assert torch.equal(again.train[0], first.train[0]) and first.paths[0].stat().st_mtime_ns == stamp
    # the data changes: another cache file for it, the held-out one reused
    write_preferences(data, marked_pairs(11, 3))
    changed = reference_logps(acc, ref, str(base), sp.fingerprint(), loaders(), micro_pairs=3)
    assert changed.reused == (False, True) and changed.paths[0] != first.paths[0]
    assert changed.train[0].shape == (11,)
    # the reference changes: both computed again
    other = write_lm(tmp_path / "other", sp, seed=1)
    ref2, _ = load_model(other)
    moved = reference_logps(acc, ref2, str(other), sp.fingerprint(), loaders(), micro_pairs=3)
    assert moved.reused == (False, False) and moved.paths[1] != first.paths[1]
    assert not torch.allclose(moved.val[0], first.val[0])


def test_held_out_accuracy_per_group_by_hand(data, sp, tmp_path, monkeypatch):
    """Four held-out pairs, summed log-probs set by hand (a reference-free loss: implicit reward
    β·logp): near misses ranked right once in two, the broken format once in one, a pair without a
    kind right; each group's accuracy over its own pairs, beside the overall one."""
    path = grouped_held_out_pairs(data, tmp_path)
    loader = PreferenceLoader(path, sp, batch_size=4, seq_len=64, shuffle=False)
    batch = loader.collate([0, 1, 2, 3])
    chosen, rejected = [-1.0, -3.0, -1.0, -2.0], [-2.0, -1.0, -4.0, -5.0]  # right, wrong, right, right
    table = {tuple(row.tolist()): v for row, v in zip(batch["input_ids"], chosen + rejected)}

    def logps_by_hand(model, b, padding_free=False):
        lp = torch.tensor([table[tuple(row.tolist())] for row in b["input_ids"]])
        return lp, torch.ones_like(lp), torch.zeros_like(lp)

    monkeypatch.setattr(dpo_stage, "side_logps", logps_by_hand)
    stage = DPOStage(make_accelerator(TrainConfig(progress=False)), loader, loader, 1,
                     DPOLossConfig(loss_type="simpo"), val_groups=pair_groups(path, loader))
    got = stage.evaluate(torch.nn.Linear(1, 1))
    assert got["val_rewards/accuracies"] == 0.75 and got["val_pairs"] == 4
    assert got["val_rewards/accuracies/arith"] == pytest.approx(2 / 3) and got["val_pairs/arith"] == 3
    assert got["val_rewards/accuracies/chat"] == 1.0 and got["val_pairs/chat"] == 1
    assert got["val_rewards/accuracies/rejected_near_miss"] == 0.5 and got["val_pairs/rejected_near_miss"] == 2
    assert got["val_rewards/accuracies/rejected_broken_format"] == 1.0
    assert got["val_pairs/rejected_broken_format"] == 1


# ---- edge cases of the loss ------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["sigmoid", "sigmoid_norm", "ipo", "robust", "aot", "simpo", "orpo",
                                       ["sigmoid", "sft"]])
def test_an_empty_response_gives_a_finite_loss_and_gradient(loss_type, data, sp, base):
    """The format refuses an empty answer (test_reward's bad-input cases), so a response always
    has at least its eot; a row whose response mask is empty (log-prob 0, length 0) must still be
    finite for every loss that divides by a length."""
    loader = PreferenceLoader(data, sp, batch_size=2, seq_len=64, shuffle=False)
    batch = loader.collate([0, 1])
    batch["loss_mask"][0] = False  # pair 0's chosen response: nothing scored
    policy, _ = load_model(base)
    policy.train()
    ref, _ = load_model(base)
    cfg = DPOLossConfig(loss_type=loss_type, label_smoothing=0.1 if loss_type == "robust" else 0.0)
    stage = DPOStage(None, loader, loader, 1, cfg, ref_model=ref)
    loss, n, metrics = stage.loss(policy, batch)
    loss.backward()
    assert torch.isfinite(loss) and n.item() == 2
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)
    assert all(torch.isfinite(s) for s, _ in metrics.values())


def test_reference_free_losses_build_no_reference(data, base, tmp_path):
    out = tmp_path / "simpo"
    result = run_dpo(tiny_cfg(DPOConfig, data, base, out, loss_type="simpo", beta=2.0, max_steps=2, eval_every=0))
    assert "reference" not in read_meta(out / "checkpoints")["frozen_models"]
    assert result["steps"] == 2


@pytest.mark.parametrize("values, pattern", [
    ({"loss_type": "dpo"}, r"dpo\.loss_type: unknown 'dpo'"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, r"dpo\.loss_weights: 1 weights for 2"),
    ({"beta": 0.0}, r"dpo\.beta: got 0\.0; expected a number in \(0, inf\)"),
])
def test_bad_options_are_refused_before_anything_runs(values, pattern, data, base, tmp_path):
    with pytest.raises(SproutError, match=pattern):
        run_dpo(tiny_cfg(DPOConfig, data, base, tmp_path / "out", **values))
    assert not (tmp_path / "out").exists()


# ---- multi-process --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "sigmoid_norm", "aot"])
def test_two_gloo_processes_match_one(loss_type, run_a, data, base, tmp_path):
    """2 processes × 1 micro-batch of 8 pairs with the reference log-probs precomputed (split over
    the ranks and gathered) against 1 process × 2 micro-batches of 8 with a live reference: the
    per-pair normaliser (sigmoid, sigmoid_norm), and aot's sort over the same micro-batches."""
    out_a = run_a[0] if loss_type == "sigmoid" else tmp_path / "one"
    if loss_type != "sigmoid":
        run_dpo(tiny_cfg(DPOConfig, data, base, out_a, lr=1e-3, loss_type=loss_type))
    out = tmp_path / "ddp"
    copy = tmp_path / "prefs"  # a fresh folder: the cache is computed by the 2 processes
    copy.mkdir()
    for f in ("preferences.jsonl", "preferences_dev.jsonl"):
        shutil.copy(data.with_name(f), copy / f)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "scripts" / "train_dpo.py"), *cli_flags(copy / "preferences.jsonl", base, out, lr=1e-3),
           "--dpo.precompute_ref_logps", "true", "--dpo.loss_type", loss_type]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) × 1 micro-steps" in proc.stdout and "computed and written to" in proc.stdout
    a, b = train_records(out_a), train_records(out)
    assert sorted(a) == sorted(b)
    diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
    print(f"dpo {loss_type}, 1 vs 2 processes: max |loss diff| over {len(a)} steps = {diff:.3g}")
    assert diff < 1e-5
    va = [r["val_rewards/margins"] for r in read_metrics(out_a / "metrics.jsonl") if "val_loss" in r]
    vb = [r["val_rewards/margins"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert va == pytest.approx(vb, abs=1e-5)
