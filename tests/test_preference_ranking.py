"""Ranking accuracy of a checkpoint on a preference file (`sprout.stages.preference_ranking`,
scripts/evaluate.py --preferences): figures equal to a hand count of each pair's scores, per
rejected_kind; a plain LM, a logprob reward model, a score-head reward model and DPO's implicit
reward; and the reward stage's own held-out evaluation repeated from its checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from preference_train_fixtures import base, tiny_cfg, write_lm, write_pairs  # noqa: F401 (base)
from proc import run_here

from data_loader.preference_batches import PreferenceLoader
from sprout.checkpoint import read_meta, save_checkpoint
from sprout.engine.trainer import TrainConfig, make_accelerator
from sprout.errors import SproutError
from sprout.evaluation.statistics import wilson_interval
from sprout.formats.preference_pairs import read_preferences, write_preferences
from sprout.model.load import init_from_lm, load_model
from sprout.stages.configs import RewardConfig
from sprout.stages.preference_ranking import rank_preferences, ranking_figures, ranking_rule
from sprout.stages.reward import run_reward

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["near_miss", "broken_format", None]  # pair i of the held-out file: KINDS[i % 3]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """preferences.jsonl (96 pairs) and preferences_test.jsonl (32 pairs, rejected_kind by KINDS;
    every other pair the other way round, so a model favouring one answer ranks some pairs wrong)."""
    train = write_pairs(tmp_path_factory.mktemp("prefs"))
    test = train.with_name("preferences_test.jsonl")
    write_preferences(test, [{**r, **({"chosen": r["rejected"], "rejected": r["chosen"]} if i % 2 else {}),
                              **({"rejected_kind": KINDS[i % 3]} if KINDS[i % 3] else {})}
                             for i, r in enumerate(read_preferences(test))])
    return train


@pytest.fixture(scope="module")
def acc():
    return make_accelerator(TrainConfig(progress=False))


def side_logps(lm, ids, mask) -> float:
    """Σ log p(ids[t] | ids[:t]) over the response tokens of one side, alone and unpadded."""
    with torch.no_grad():
        logp = lm(torch.tensor([ids.tolist()]))[0].log_softmax(-1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])


def test_figures_are_a_hand_count_of_the_pairs():
    outcomes = [{"id": "a", "kind": "near_miss", "correct": True, "margin": 1.0},
                {"id": "b", "kind": "near_miss", "correct": False, "margin": -0.5},
                {"id": "c", "kind": "broken_format", "correct": True, "margin": 2.0},
                {"id": "d", "kind": None, "correct": False, "margin": 0.0}]
    m = ranking_figures(outcomes, {"pairs_read": 5, "dropped_too_long": 1, "truncated": 0})
    assert (m["accuracy"], m["correct"], m["pairs"], m["pairs_read"], m["pairs_dropped"]) == (0.5, 2, 4, 5, 1)
    assert m["accuracy_ci"] == list(wilson_interval(2, 4)) and m["margin"] == pytest.approx(2.5 / 4)
    assert (m["by_kind/near_miss/accuracy"], m["by_kind/near_miss/pairs"]) == (0.5, 2)
    assert m["by_kind/near_miss/accuracy_ci"] == list(wilson_interval(1, 2))
    assert (m["by_kind/broken_format/accuracy"], m["by_kind/broken_format/pairs"]) == (1.0, 1)
    assert not [k for k in m if "None" in k]  # a pair without a kind counts in the whole only


def test_an_lm_ranks_by_beta_times_its_summed_response_logprob(data, base, sp, acc):
    test = data.with_name("preferences_test.jsonl")
    result = rank_preferences(acc, str(base), str(test), beta=0.5, batch_size=5)
    assert result["settings"]["rule"] == {"kind": "logprob", "beta": 0.5}
    lm, _ = load_model(base)
    loader = PreferenceLoader(test, sp, 5, 64, shuffle=False)
    records = list(read_preferences(test))
    pairs = result["pairs"]
    assert [p["id"] for p in pairs] == [r["id"] for r in records]  # every pair fits: all kept, in file order
    right = 0
    for p, pair in zip(pairs, loader.pairs):
        margin = 0.5 * (side_logps(lm, pair.chosen, pair.chosen_mask) - side_logps(lm, pair.rejected, pair.rejected_mask))
        assert p["margin"] == pytest.approx(margin, abs=1e-4)
        assert abs(margin) < 1e-4 or p["correct"] == (margin > 0)
        right += p["correct"]
    m = result["metrics"]
    assert m["accuracy"] == right / 32 and m["correct"] == right and m["pairs"] == 32 and m["pairs_dropped"] == 0
    assert 0 < right < 32  # a random model: both outcomes occur, so the count means something
    kinds = {k: [p for p in pairs if p["kind"] == k] for k in ("near_miss", "broken_format")}
    for kind, group in kinds.items():
        assert m[f"by_kind/{kind}/pairs"] == len(group) == sum(KINDS[i % 3] == kind for i in range(32))
        assert m[f"by_kind/{kind}/correct"] == sum(p["correct"] for p in group)
    no_kind = [p for p in pairs if p["kind"] is None]
    assert sum(m[f"by_kind/{k}/pairs"] for k in kinds) + len(no_kind) == m["pairs"]
    assert sum(m[f"by_kind/{k}/correct"] for k in kinds) + sum(p["correct"] for p in no_kind) == m["correct"]
    # β scales the margins, never the order
    again = rank_preferences(acc, str(base), str(test), batch_size=5)
    assert again["settings"]["rule"]["beta"] == 0.1 and again["metrics"]["accuracy"] == m["accuracy"]


def test_pairs_over_seq_len_are_dropped_and_counted(data, base, sp, acc):
    test = data.with_name("preferences_test.jsonl")
    loader = PreferenceLoader(test, sp, 8, 64, shuffle=False)
    seq_len = sorted(p.longest for p in loader.pairs)[16]  # about half the pairs are longer
    result = rank_preferences(acc, str(base), str(test), seq_len=seq_len)
    m = result["metrics"]
    assert m["pairs_read"] == 32 and m["pairs"] + m["pairs_dropped"] == 32 and 0 < m["pairs_dropped"] < 32
    assert len(result["dropped"]) == m["pairs_dropped"] and all(d["tokens"] > seq_len for d in result["dropped"])
    assert not {d["id"] for d in result["dropped"]} & {p["id"] for p in result["pairs"]}


def test_a_score_head_reward_model_ranks_by_its_score(data, base, sp, acc, tmp_path):
    rm, meta = init_from_lm(base, "reward", seed=3)  # the base's backbone, a fresh score head
    keep = ("model_config", "tokenizer", "tokenizer_fingerprint", "template_version")
    path = save_checkpoint(tmp_path / "rm", rm, meta={**{k: meta[k] for k in keep}, "stage": "reward", "step": 0})
    test = data.with_name("preferences_test.jsonl")
    result = rank_preferences(acc, str(path), str(test), batch_size=3)
    assert result["settings"]["rule"] == {"kind": "head"}
    loader = PreferenceLoader(test, sp, 3, 64, shuffle=False)
    rm.eval()
    with torch.no_grad():
        for p, pair in zip(result["pairs"], loader.pairs):
            c, r = (float(rm(torch.tensor([ids.tolist()]))[0, -1]) for ids in (pair.chosen, pair.rejected))
            assert p["margin"] == pytest.approx(c - r, abs=1e-4)
    for bad in ({"beta": 0.5}, {"reference": str(base)}):
        with pytest.raises(SproutError, match="a reward model ranks pairs by its own score"):
            rank_preferences(acc, str(path), str(test), **bad)


def test_a_reference_gives_dpos_implicit_reward(data, base, sp, acc, tmp_path):
    """β × ((log p_c − log p_r) − (log p_ref_c − log p_ref_r)): the policy's margin less the
    reference's; a policy against itself ties every pair, and a tie is wrong."""
    policy = write_lm(tmp_path / "policy", sp, seed=1)
    test = data.with_name("preferences_test.jsonl")
    implicit = rank_preferences(acc, str(policy), str(test), beta=0.5, reference=str(base))
    assert implicit["settings"]["rule"] == {"kind": "implicit", "beta": 0.5, "reference": str(base)}
    assert implicit["reference"]["path"] == read_meta(base)["path"]
    own, ref = (rank_preferences(acc, str(path), str(test), beta=0.5) for path in (policy, base))
    for p, a, b in zip(implicit["pairs"], own["pairs"], ref["pairs"]):
        assert p["margin"] == pytest.approx(a["margin"] - b["margin"], abs=1e-4)
    itself = rank_preferences(acc, str(base), str(test), reference=str(base))
    assert itself["metrics"]["accuracy"] == 0.0 and {p["margin"] for p in itself["pairs"]} == {0.0}
    other = write_lm(tmp_path / "wide", sp, d_model=32)
    with pytest.raises(SproutError, match="a reference must be an LM with the checkpoint's model config"):
        rank_preferences(acc, str(base), str(test), reference=str(other))
    with pytest.raises(SproutError, match="beta must be a finite number above 0"):
        ranking_rule(read_meta(base), beta=0.0)


# ---- the reward stage's own held-out evaluation, repeated ---------------------------------------------
@pytest.mark.parametrize("score", ["logprob", "head"])
def test_the_stages_evaluation_is_repeated_from_its_checkpoint(score, data, base, acc, tmp_path):
    """A logprob reward model's step-0 evaluation is the init LM's ranking with the same β; after
    training, the stage's last evaluation is its saved checkpoint's ranking (score head or
    logprob): the figures a results record quotes are rerunnable with evaluate.py."""
    extra = {"score": "logprob", "beta": 0.5} if score == "logprob" else {}
    test = tmp_path / "held_out_pairs.jsonl"  # the pairs of the sealed test file, which no stage may read
    test.write_bytes(data.with_name("preferences_test.jsonl").read_bytes())
    result = run_reward(tiny_cfg(RewardConfig, data, base, tmp_path / "rm", max_steps=2, eval_every=0,
                                 ckpt_every=0, val_path=str(test), **extra))
    checks = [(result["last_eval"], rank_preferences(acc, str(tmp_path / "rm"), str(test)))]
    if score == "logprob":
        checks.append((result["first_eval"], rank_preferences(acc, str(base), str(test), beta=0.5)))
    for stage, ours in checks:
        m = ours["metrics"]
        assert stage["val_accuracy"] == m["accuracy"] and stage["val_pairs"] == m["pairs"] == 32
        assert stage["val_margin"] == pytest.approx(m["margin"], rel=1e-5, abs=1e-6)
        for kind in ("near_miss", "broken_format"):
            assert stage[f"val_accuracy/rejected_{kind}"] == m[f"by_kind/{kind}/accuracy"]
            assert stage[f"val_pairs/rejected_{kind}"] == m[f"by_kind/{kind}/pairs"]


# ---- the script ----------------------------------------------------------------------------------------
def evaluate_script(*args):
    return run_here([sys.executable, str(ROOT / "scripts" / "evaluate.py"), *map(str, args)], cwd=ROOT)


def test_evaluate_py_writes_the_ranking(data, base, acc, tmp_path):
    test = data.with_name("preferences_test.jsonl")
    out = tmp_path / "ranking.json"
    r = evaluate_script(base, "--preferences", test, "--beta", "0.5", "--batch-size", "5", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(out.read_text())
    want = rank_preferences(acc, str(base), str(test), beta=0.5, batch_size=5)
    assert {k: got[k] for k in want} == json.loads(json.dumps(want))
    assert got["command"].endswith(f"--out {out}") and got["task"] == "preferences"
    assert "near_miss" in r.stdout and "95 % interval" in r.stdout and f"wrote {out}" in r.stdout
    assert "32 of 32 pairs ranked" in r.stdout
    run = shutil.copytree(base, tmp_path / "run" / "checkpoints" / "step_00000080")
    r = evaluate_script(run, "--preferences", test)  # the default file name, in the run folder
    assert r.returncode == 0 and (tmp_path / "run" / "eval" / "preferences_test_step80.json").is_file()
    r = evaluate_script(base, "--task", "arith", "--beta", "0.5")
    assert r.returncode != 0 and "--beta, --reference, --seq-len and --truncation go with --preferences" in r.stderr
    r = evaluate_script(base, "--task", "arith", "--preferences", test)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
