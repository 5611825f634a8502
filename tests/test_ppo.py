"""The PPO stage: GAE by hand and in the buffer, the score on the last generated token whatever the
padding, a log-probability reward model's score by hand and in a run, the missing-eos rule, both KL estimators logged and the adaptive coefficient, the entropy
bonus's gradient, the value head's own lr and its init from the reward model, the value warm-up
(the value head alone trains, its loss and normaliser), exact resume with the value head
(mid-buffer and at a boundary, in and after the warm-up), 2 processes equal 1 (slow, one case
with a warm-up), and learning: a verifier reward and a reward model's preference rise, and the
warm-up lowers the value loss (slow)."""

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from data_loader.prompt_batches import PromptLoader
from grpo_fixtures import data  # noqa: F401 (data, base: fixtures)
from grpo_fixtures import tiny_cfg as grpo_cfg
from ppo_fixtures import config_dict, run_per_prompt, tiny_cfg, write_digit_reward_model
from preference_train_fixtures import base, resume_folder, write_lm  # noqa: F401 (base)
from proc import free_port, run_group
from safetensors.torch import load_file

from sprout.checkpoint import read_meta
from sprout.config import from_dict, resume_config
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import reward_score_of
from sprout.model.heads import PolicyWithValue
from sprout.model.load import init_from_lm, load_model
from sprout.rl.advantages import gae, masked_whiten, token_rewards
from sprout.engine.metrics import read_metrics
from sprout.engine.optim import OptimConfig, build_optimizer
from sprout.stages.ppo import (
    PPOBatchConfig,
    PPOConfig,
    PPOLossConfig,
    PPOStage,
    advantages_and_returns,
    init_value_head,
    run_ppo,
    whiten_global,
)
from sprout.stages.reward import score_sequences
from sprout.stages.grpo import run_grpo
from sprout.stages.rl_rewards import RewardsConfig, build_rewards
from sprout.stages.rl_stage import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rm_path(sp, tmp_path_factory):
    return write_digit_reward_model(tmp_path_factory.mktemp("rm") / "ckpt", sp)


@pytest.fixture(scope="module")
def logprob_rm(sp, tmp_path_factory):
    """An LM checkpoint as `reward.score: logprob` leaves it (another seed than the policy's; β 0.5)."""
    return write_lm(tmp_path_factory.mktemp("logprob_rm") / "ckpt", sp, seed=1,
                    meta={"stage": "reward", "reward_score": {"kind": "logprob", "beta": 0.5}})


def train_records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def make_stage(sp, base, data, rm=None, reward_funcs=("grpo_fixtures:digit_share",), max_completion_length=12,
               **ppo):
    """A PPOStage on one process with the init model as its policy (no Trainer)."""
    policy, _ = init_from_lm(base, "lm+value")
    ref, _ = load_model(base)
    batch = PPOBatchConfig(global_prompts=4, num_generations=2, micro_completions=4)
    rollout = RolloutConfig(max_completion_length=max_completion_length)
    loader = PromptLoader(data, sp, 24, batch.global_prompts, seed=0)
    val = PromptLoader(data.with_name("prompts_dev.jsonl"), sp, 24, 1, shuffle=False)
    rewards = build_rewards(RewardsConfig(reward_funcs=list(reward_funcs)), max_completion_length)
    stage = PPOStage(Accelerator(cpu=True), sp, loader, val, batch, rollout, rewards, ppo=PPOLossConfig(**ppo),
                     ref_model=ref, reward_model=load_model(rm)[0] if rm else None,
                     reward_score=reward_score_of(read_meta(rm)) if rm else None)
    stage.setup(SimpleNamespace(generation_model=policy, sharded=False, prepare_frozen=lambda m: m))
    return stage, policy


# ---- advantages -------------------------------------------------------------------------------------------------
def test_advantages_and_returns_by_hand():
    """Token rewards -kl_coef × KL plus the score on the last token, then GAE, with one row ending a
    token early (nothing bootstrapped past its end; masked positions 0)."""
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    values = torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.1, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, adv, returns = advantages_and_returns(scores, kl, values, mask, kl_coef=0.5, gamma=0.9, lam=0.8)
    # row 0: r = [-0.05, -0.1, 0.85]; deltas 0.55, -0.1 + 0.9·0.3 - 0.4 = -0.23, -0.05 + 0.9·0.4 - 0.5 = -0.19
    #        A2 = 0.55, A1 = -0.23 + 0.72·0.55 = 0.166, A0 = -0.19 + 0.72·0.166 = -0.07048
    # row 1: r = [-0.2, 1.75, 0]; A1 = 1.75 - 0.1 = 1.65, A0 = -0.2 + 0.9·0.1 - 0.2 + 0.72·1.65 = 0.878
    expected = {"rewards": (rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]),
                "advantages": (adv, [[-0.07048, 0.166, 0.55], [0.878, 1.65, 0.0]]),
                "returns": (returns, [[0.42952, 0.566, 0.85], [1.078, 1.75, 0.0]])}
    for name, (got, want) in expected.items():
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-9), name


def test_whiten_global_on_one_process_is_masked_whiten():
    torch.manual_seed(0)
    x, mask = torch.randn(3, 5, dtype=torch.float64), torch.tensor([[1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    acc = Accelerator(cpu=True)
    for shift in (True, False):
        assert torch.allclose(whiten_global(acc, x, mask, shift), masked_whiten(x, mask, shift), atol=1e-12)


def test_the_buffer_holds_gae_of_its_own_rollouts(sp, base, data):
    """The stage's advantages and returns are GAE over its scores, its k1 KL and its old values,
    the advantages whitened over the batch."""
    stage, _ = make_stage(sp, base, data, kl_coef=0.3, gamma=0.95, lam=0.9)
    stage.next_micro_batches(0)
    b = stage.buffer
    mask = b["completion_mask"]
    kl = (b["old_logps"] - b["ref_logps"]) * mask
    rewards = token_rewards(b["scores"].double(), kl.double(), mask, 0.3)
    adv, returns = gae(rewards, b["old_values"].double(), mask, 0.95, 0.9)
    assert torch.allclose(b["returns"].double(), returns, atol=1e-5)
    assert torch.allclose(b["advantages"].double(), masked_whiten(adv, mask), atol=1e-5)
    assert (b["old_values"] != 0).any() and (b["old_values"][mask == 0] == 0).all()


# ---- scores -----------------------------------------------------------------------------------------------------
def test_score_lands_on_the_last_generated_token(sp, base, data, rm_path):
    """The reward model's score of a left-padded prompt + right-padded completion equals the score
    of the row alone and of the row right-padded, and the token reward puts it on the completion's
    last token."""
    stage, _ = make_stage(sp, base, data, rm=rm_path)
    long, short = stage.loader.ids[0], stage.loader.ids[1][-6:]
    rollout = stage.sample(np.array([0, 1]), ids=[long, short])
    assert (rollout["prompt_mask"] == 0).any()  # the short prompt is left-padded
    scores = stage.reward_model_scores(rollout)
    rows = [p[m.bool()].tolist() + c[cm.bool()].tolist() for p, m, c, cm in
            zip(rollout["prompt_ids"], rollout["prompt_mask"], rollout["completion_ids"], rollout["completion_mask"])]
    rm = stage.reward_model
    alone = torch.stack([rm(torch.tensor([r]))[0, -1] for r in rows]).double()
    T = max(map(len, rows))
    right = score_sequences(rm, torch.tensor([r + [0] * (T - len(r)) for r in rows]),
                            torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])).double()
    assert torch.allclose(scores, alone, atol=1e-5) and torch.allclose(scores, right, atol=1e-5)
    placed = token_rewards(scores, torch.zeros(rollout["completion_mask"].shape), rollout["completion_mask"], 0.0)
    for i, n in enumerate(rollout["lengths"].tolist()):
        assert placed[i, n - 1] == pytest.approx(float(scores[i])) and placed[i].count_nonzero() <= 1


def test_a_logprob_reward_model_scores_beta_times_the_completions_logprob(sp, base, data, logprob_rm):
    """A log-probability reward model's score of a left-padded prompt + right-padded completion is
    β × Σ log p(completion token | everything before it) under it, computed here row by row,
    unpadded, at temperature 1 whatever the sampling temperature."""
    stage, _ = make_stage(sp, base, data, rm=logprob_rm)
    long, short = stage.loader.ids[0], stage.loader.ids[1][-6:]
    stage.rollout = dataclasses.replace(stage.rollout, temperature=0.7)
    rollout = stage.sample(np.array([0, 1]), ids=[long, short])
    assert rollout["completion_mask"][0, -4:].all()
    rollout["completion_mask"][0, -4:] = 0  # as if the first row had ended 4 tokens early
    assert (rollout["prompt_mask"] == 0).any()  # the short prompt is left-padded
    scores = stage.reward_model_scores(rollout)
    want = []
    for p, m, c, cm in zip(rollout["prompt_ids"], rollout["prompt_mask"], rollout["completion_ids"],
                           rollout["completion_mask"]):
        prompt, completion = p[m.bool()].tolist(), c[cm.bool()].tolist()
        with torch.no_grad():
            logp = stage.reward_model(torch.tensor([prompt + completion]))[0].log_softmax(-1)
        want.append(0.5 * sum(float(logp[len(prompt) + j - 1, t]) for j, t in enumerate(completion)))
    assert scores.tolist() == pytest.approx(want, abs=1e-4) and scores.dtype == torch.float64


def test_a_run_with_a_logprob_reward_model_records_it_and_adds_its_weighted_score(base, data, logprob_rm, tmp_path):
    """run_ppo with a log-probability reward model alone (verifier weight 0, no eos penalty, kl in
    the loss): each batch's mean score is reward_model_weight × the reward model's mean score,
    and the checkpoint's meta says how the reward model scored."""
    out = tmp_path / "ppo_logprob"
    run_ppo(tiny_cfg(data, base, out, logprob_rm, max_steps=2, reward_weights=[0.0], missing_eos_penalty=0.0,
                     reward_model_weight=0.5, kl_in="loss"))
    rec = train_records(out)
    for step in (1, 2):
        rm_mean = rec[step]["rewards/reward_model/mean"]
        assert rm_mean < -1.0  # a random LM's summed log-probability of 12 tokens, × 0.5
        assert rec[step]["objective/scores"] == pytest.approx(0.5 * rm_mean, rel=1e-5)
    meta = read_meta(out / "checkpoints")
    assert meta["frozen_models"]["reward_model"]["path"] == str(logprob_rm)
    assert meta["frozen_models"]["reward_model"]["score"] == {"kind": "logprob", "beta": 0.5}


@pytest.mark.parametrize("rule", ["penalty", "zero"])
def test_a_missing_end_of_turn_is_penalised_or_scored_zero(rule, sp, base, data):
    stage, _ = make_stage(sp, base, data, reward_funcs=("grpo_fixtures:constant",), missing_eos=rule,
                          missing_eos_penalty=0.7)
    idx = stage.loader.next_prompts()
    rollout = stage.sample(idx)
    rollout["truncated"] = torch.tensor([True, False] * 4)
    scores, _, _ = stage.scores_of(rollout, idx)
    expected = 1.0 - 0.7 if rule == "penalty" else 0.0
    assert scores.tolist() == pytest.approx([expected, 1.0] * 4)


# ---- KL -----------------------------------------------------------------------------------------------------------
def test_both_estimators_logged_and_the_adaptive_coefficient_follows_the_measured_kl(base, data, tmp_path):
    out = tmp_path / "akl"
    run_ppo(tiny_cfg(data, base, out, max_steps=3, lr=1e-2, kl_coef=0.1, adaptive_kl=True, target_kl=0.01,
                     horizon=100, kl_estimator="k1"))
    rec = train_records(out)
    assert rec[1]["objective/kl_k1"] == rec[1]["objective/kl_k3"] == 0.0  # the policy is the reference
    for s in (2, 3):
        assert rec[s]["objective/kl"] == rec[s]["objective/kl_k1"] and rec[s]["objective/kl_k3"] > 0
        assert rec[s]["objective/kl_k1"] != rec[s]["objective/kl_k3"]
    for s in (1, 2):  # each batch's measured KL moves the next batch's coefficient (8 completions)
        error = min(max(rec[s]["objective/kl"] / 0.01 - 1, -0.2), 0.2)
        assert rec[s + 1]["objective/kl_coef"] == pytest.approx(rec[s]["objective/kl_coef"] * (1 + error * 8 / 100))
    assert rec[3]["objective/kl_coef"] != 0.1
    assert rec[2]["objective/non_score_reward"] == pytest.approx(-rec[2]["objective/kl_coef"] * rec[2]["objective/kl"])


# ---- the loss -----------------------------------------------------------------------------------------------------
def test_the_entropy_bonus_changes_the_gradient(sp, base, data):
    stage, policy = make_stage(sp, base, data, num_ppo_epochs=1)
    batch = stage.next_micro_batches(0)[0]
    grads = {}
    for coef in (0.0, 0.5):
        stage.cfg = dataclasses.replace(stage.cfg, entropy_coef=coef)
        policy.zero_grad()
        loss_sum, n, metrics = stage.loss(policy, batch)
        loss_sum.backward()
        grads[coef] = policy.lm_head.weight.grad.clone()
        assert "policy/entropy" in metrics and int(n) == int(batch["completion_mask"].sum())
    assert (grads[0.0] - grads[0.5]).abs().max() > 1e-6


def test_the_value_head_has_its_own_lr_and_starts_from_the_reward_model(sp, base, data, rm_path):
    stage, policy = make_stage(sp, base, data, value_lr=0.05)
    opt = build_optimizer(policy, OptimConfig(lr=1e-3), stage.param_groups(policy))
    heads = [g for g in opt.param_groups if g.get("name") == "value_head"]
    assert len(heads) == 1 and heads[0]["lr"] == 0.05 and heads[0]["params"] == [policy.value_head.weight]
    assert {g["lr"] for g in opt.param_groups if g.get("name") != "value_head"} == {1e-3}
    rm, _ = load_model(rm_path)
    init_value_head(policy, rm, rm_path)
    assert torch.equal(policy.value_head.weight, rm.score_head.weight)


# ---- the value warm-up --------------------------------------------------------------------------------------------
def weights_at(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


@pytest.mark.parametrize("value_lr", [1e-2, None], ids=["own_lr", "optim_lr"])
def test_the_value_warmup_trains_the_value_head_alone(value_lr, base, data, tmp_path):
    """With value_warmup_steps 2 (weight decay on, a fresh value head): after steps 1 and 2 every
    weight but the value head's is the init's, bit for bit; the value head moved; each warm-up
    step's loss is vf_coef × its value loss (the same completion-token normaliser), the logged lr
    0 and the value head's lr its own (value_lr, or optim.lr like the policy's: logged apart
    all the same). Step 3 moves the policy at optim.lr."""
    out = tmp_path / "warm"
    run_ppo(tiny_cfg(data, base, out, max_steps=3, value_warmup_steps=2, weight_decay=0.1, vf_coef=0.5,
                     value_lr=value_lr, ckpt_every=1, keep_checkpoints=10))
    head_lr = value_lr or 3e-3  # without value_lr: optim.lr × vf_lr_scale 1
    init = load_file(str(base / "model.safetensors"))
    policy = [k for k in init if k != "value_head.weight"]
    w1, w2, w3 = (weights_at(out, s) for s in (1, 2, 3))
    assert all(torch.equal(w[k], init[k]) for w in (w1, w2) for k in policy)
    assert not torch.equal(w1["value_head.weight"], w2["value_head.weight"])
    assert any(not torch.equal(w3[k], init[k]) for k in policy)
    rec = train_records(out)
    for s in (1, 2):
        assert rec[s]["loss"] == pytest.approx(0.5 * rec[s]["val/loss"], rel=1e-5)
        assert rec[s]["lr"] == 0.0 and rec[s]["lr/value_head"] == head_lr
    assert rec[3]["lr"] == 3e-3
    assert rec[3]["lr/value_head"] == head_lr  # logged at every step, also where it equals the policy's


def test_the_value_only_loss_gives_the_policy_an_exact_zero_gradient(sp, base, data):
    """In the warm-up every parameter gets a gradient (none is left None, as a distributed
    backward needs), zero for all but the value head's."""
    stage, policy = make_stage(sp, base, data, value_warmup_steps=1)
    batch = stage.next_micro_batches(0)[0]
    assert stage.value_only
    loss_sum, n, _ = stage.loss(policy, batch)
    loss_sum.backward()
    grads = {k: p.grad for k, p in policy.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert grads["value_head.weight"].abs().sum() > 0
    assert all(not g.any() for k, g in grads.items() if k != "value_head.weight")
    assert int(n) == int(batch["completion_mask"].sum())
    stage.next_micro_batches(1)
    assert not stage.value_only  # the warm-up is steps [0, value_warmup_steps)


def test_the_value_warmup_leaves_a_default_config_hash_as_it_was():
    """value_warmup_steps enters the resume config only once set, so a run made before the option
    resumes; a set one is hashed (a resume must keep it)."""
    assert "value_warmup_steps" not in resume_config(PPOConfig())["ppo"]
    assert resume_config(from_dict(PPOConfig, {"ppo": {"value_warmup_steps": 4}}))["ppo"]["value_warmup_steps"] == 4
    with pytest.raises(SproutError, match=r"ppo\.value_warmup_steps: got -1; expected an integer in \[0, inf\)"):
        from_dict(PPOConfig, {"ppo": {"value_warmup_steps": -1}})


@pytest.mark.slow
def test_the_value_warmup_lowers_the_value_loss(base, data, tmp_path):
    """20 warm-up steps from a fresh value head, the policy held: the mean value loss of steps
    16-20 is below 0.6 × that of steps 1-2 (the head learns the returns of a fixed policy; what is
    left is their spread, which a head on a held random model cannot explain)."""
    out = tmp_path / "warm_learn"
    run_ppo(tiny_cfg(data, base, out, max_steps=21, value_warmup_steps=20, global_prompts=16, num_generations=1,
                     micro_completions=16, max_completion_length=8, value_lr=3e-2, vf_coef=1.0))
    rec = train_records(out)
    start = np.mean([rec[s]["val/loss"] for s in (1, 2)])
    end = np.mean([rec[s]["val/loss"] for s in (16, 17, 18, 19, 20)])
    print(f"value loss: {start:.4f} -> {end:.4f}")
    assert end < 0.6 * start


# ---- resume -------------------------------------------------------------------------------------------------------
RESUME = dict(max_steps=6, num_ppo_epochs=2, num_mini_batches=2, micro_completions=2, ckpt_every=1, keep_checkpoints=10,
              value_init="reward", value_lr=1e-2, adaptive_kl=True, target_kl=0.01, horizon=100, whiten_rewards=True,
              eval_every=3, value_warmup_steps=3)


@pytest.fixture(scope="module")
def run_a(base, data, rm_path, tmp_path_factory):
    """6 steps, the first 3 the value warm-up's; a new buffer every 4 (2 epochs × 2 mini-batches); a
    checkpoint after every step."""
    out = tmp_path_factory.mktemp("ppo_a")
    run_ppo(tiny_cfg(data, base, out, rm_path, **RESUME))
    return out


@pytest.mark.parametrize("step", [2, 4], ids=["mid_buffer", "rollout_boundary"])
def test_resume_with_the_value_head_matches_an_uninterrupted_run_bit_for_bit(step, run_a, base, data, rm_path,
                                                                             tmp_path):
    meta = read_meta(run_a / "checkpoints")
    assert meta["architecture"] == "lm+value" and "reward_model" in meta["frozen_models"]
    model, _ = load_model(run_a / "checkpoints")
    assert isinstance(model, PolicyWithValue)
    first = load_file(str(run_a / "checkpoints" / "step_00000001" / "model.safetensors"))
    last = load_file(str(Path(meta["path"]) / "model.safetensors"))
    assert not torch.equal(first["value_head.weight"], last["value_head.weight"])  # the head trains
    out_b = resume_folder(run_a, step, tmp_path / "ppo_b")
    run_ppo(tiny_cfg(data, base, out_b, rm_path, **RESUME), resume="latest")
    a, b = train_records(run_a), train_records(out_b)
    assert sorted(b) == list(range(step + 1, 7))
    keys = ("loss", "val/loss", "objective/kl", "objective/kl_coef", "objective/scores", "grad_norm",
            "val/explained_variance")
    assert [[b[s][k] for k in keys] for s in b] == [[a[s][k] for k in keys] for s in b]
    assert "lr/value_head" in a[1]


def test_a_resume_against_another_reward_model_or_reference_is_refused(run_a, base, data, rm_path, sp, tmp_path):
    """Checkpoints record the frozen models (weights sha256; the reward model's score kind too);
    init and reward_model are paths a resume may change (a moved folder), but a resume whose
    reward model or reference is another model is refused in one line naming it, before a step."""
    frozen = read_meta(run_a / "checkpoints")["frozen_models"]
    assert frozen["reward_model"] == {"path": read_meta(rm_path)["path"], "score": {"kind": "head"},
                                      "weights_sha256": read_meta(rm_path)["files"]["model.safetensors"]}
    assert frozen["reference"]["weights_sha256"] == read_meta(base)["files"]["model.safetensors"]

    def resume(init, rm):
        out = resume_folder(run_a, 2, tmp_path / f"ppo_{init.parent.name}_{rm.parent.name}")
        try:
            run_ppo(tiny_cfg(data, init, out, rm, **RESUME), resume="latest")
        except SproutError:  # refused before a step: no metrics, no config.yaml written
            assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()
            raise
        return out

    moved = tmp_path / "moved_rm" / "ckpt"  # the same reward model elsewhere: resumes
    shutil.copytree(rm_path, moved)
    assert sorted(train_records(resume(base, moved))) == [3, 4, 5, 6]
    retrained = write_digit_reward_model(tmp_path / "retrained_rm" / "ckpt", sp, steps=5)
    with pytest.raises(SproutError, match=r"the run's reward_model was .*retrained_rm.*weights_sha256.*"
                                          r"refusing to resume against another model"):
        resume(base, retrained)
    other_base = write_lm(tmp_path / "other_lm" / "ckpt", sp, seed=3)
    with pytest.raises(SproutError, match=r"the run's reference was .*weights_sha256"):
        resume(other_base, rm_path)


def test_grpo_starts_from_a_ppo_policy_without_its_value_head(run_a, data, tmp_path):
    """The pipeline's chain SFT -> DPO -> PPO -> GRPO: GRPO (policy and reference) loads a PPO
    checkpoint's LM weights exactly and leaves the value head behind."""
    out = tmp_path / "grpo"
    run_grpo(grpo_cfg(data, run_a, out, max_steps=1, lr=1e-30, beta=0.04))  # a step too small to move an fp32 weight
    ppo_w = load_file(str(Path(read_meta(run_a / "checkpoints")["path"]) / "model.safetensors"))
    meta = read_meta(out / "checkpoints")
    grpo_w = load_file(str(Path(meta["path"]) / "model.safetensors"))
    assert meta["architecture"] == "lm" and "value_head.weight" in ppo_w and "value_head.weight" not in grpo_w
    assert sorted(grpo_w) == sorted(k for k in ppo_w if k != "value_head.weight")
    assert all(torch.equal(grpo_w[k], ppo_w[k]) for k in grpo_w)
    assert meta["frozen_models"]["reference"]["path"] == read_meta(run_a / "checkpoints")["path"]


# ---- processes ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("score", ["head", "logprob"])
def test_two_processes_match_one(score, base, data, rm_path, logprob_rm, tmp_path):
    """2 gloo processes × 2 micro-batches of 2 completions == 1 process × 1 of 8 (per-prompt sampling;
    rewards and advantages whitened over the global batch), with a score-head reward model (the value
    head its copy) and with a log-probability one (the value head fresh on the policy, its first 2
    steps the value warm-up)."""
    rm, value_init = (rm_path, "reward") if score == "head" else (logprob_rm, "policy")
    values = dict(max_steps=4, num_ppo_epochs=2, whiten_rewards=True, value_init=value_init, reward_model_weight=0.5)
    if score == "logprob":
        values["value_warmup_steps"] = 2  # a fresh value head: its warm-up, then PPO
    one = tmp_path / "one"
    run_per_prompt(tiny_cfg(data, base, one, rm, micro_completions=8, **values))
    out = tmp_path / "ddp"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config_dict(data, base, out, rm, micro_completions=2, **values)))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           str(ROOT / "tests" / "ppo_fixtures.py"), str(cfg)]
    proc = run_group(cmd, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) × 2 micro-steps" in proc.stdout
    a, b = train_records(one), train_records(out)
    for s in (1, 2, 3, 4):
        for k in ("loss", "val/loss", "objective/kl", "objective/scores", "val/explained_variance",
                  "rewards/reward_model/mean"):
            assert b[s][k] == pytest.approx(a[s][k], abs=1e-5), (s, k)
    wa = load_file(str(read_meta(one / "checkpoints")["path"] + "/model.safetensors"))
    wb = load_file(str(read_meta(out / "checkpoints")["path"] + "/model.safetensors"))
    # Adam divides by sqrt(v): summation-order rounding in a near-zero gradient moves that one
    # weight by a visible part of its step. Each weight may differ by 1 % of one AdamW step (lr
    # 3e-3) per optimizer step taken (4); the weights as a whole agree 100 times closer.
    diffs = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    assert diffs.max().item() < 4 * 3e-5 and diffs.mean().item() < 3e-7


# ---- learning -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_mean_verifier_reward_rises(base, data, tmp_path):
    """From a random tiny model, the share of digits in its answers to 1-digit additions rises."""
    out = tmp_path / "learn"
    run_ppo(tiny_cfg(data, base, out, max_steps=30, global_prompts=16, num_generations=1, micro_completions=16,
                     max_completion_length=8, lr=1e-2, num_ppo_epochs=1, kl_coef=0.0, missing_eos_penalty=0.0))
    rec = train_records(out)
    start = np.mean([rec[s]["rewards/digit_share/mean"] for s in (1, 2, 3)])
    end = np.mean([rec[s]["rewards/digit_share/mean"] for s in (28, 29, 30)])
    print(f"mean digit share: {start:.3f} -> {end:.3f}")
    assert end > start + 0.2


@pytest.mark.slow
def test_the_reward_models_preference_is_learnt_with_bounded_kl(base, data, rm_path, tmp_path):
    """Rewards from a reward model that prefers digits alone (verifier weight 0): its score rises
    while the KL to the reference stays bounded: the KL penalty at its largest costs less than
    the score gained, and the penalised reward (objective/rlhf_reward) rises too."""
    out = tmp_path / "rm_learn"
    run_ppo(tiny_cfg(data, base, out, rm_path, max_steps=30, global_prompts=16, num_generations=1,
                     micro_completions=16, max_completion_length=8, lr=1e-2, num_ppo_epochs=1, kl_coef=0.05,
                     reward_weights=[0.0], missing_eos_penalty=0.0, value_init="reward"))
    rec = train_records(out)
    start = np.mean([rec[s]["rewards/reward_model/mean"] for s in (1, 2, 3)])
    end = np.mean([rec[s]["rewards/reward_model/mean"] for s in (28, 29, 30)])
    kl = max(rec[s]["objective/kl"] for s in rec)
    print(f"reward model score: {start:.3f} -> {end:.3f}; largest objective/kl {kl:.3f}")
    rlhf = [np.mean([rec[s]["objective/rlhf_reward"] for s in steps]) for steps in ((1, 2, 3), (28, 29, 30))]
    assert end > start + 0.5 and 0.05 * kl < end - start and rlhf[1] > rlhf[0] + 0.5


# ---- refused options ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, pattern", [
    ({"value_init": "reward"}, r"ppo.value_init reward needs a reward model"),
    ({"num_mini_batches": 3}, r"not a multiple of batch.num_mini_batches 3"),
    ({"reward_model": "lm"}, r"reward_model must be a reward model checkpoint \(scripts/train_reward.py, or an "
                             r"import of one's export\), not a checkpoint of stage 'sft' \(architecture 'lm'\)"),
    ({"reward_model": "logprob", "value_init": "reward"},
     r"meta.json: ppo.value_init reward copies a score head, and this log-probability reward model has none"),
    ({"value_warmup_steps": 2, "vf_coef": 0.0}, r"ppo.value_warmup_steps trains the value loss alone, and "
                                                r"ppo.vf_coef 0 weighs it 0: set ppo.vf_coef > 0"),
    ({"value_warmup_steps": 4}, r"ppo.value_warmup_steps 4 leaves no policy step in train.max_steps 4"),
])
def test_bad_options_are_refused_in_one_line(values, pattern, base, data, logprob_rm, tmp_path):
    values = dict(values)
    rm = {"lm": base, "logprob": logprob_rm, None: None}[values.pop("reward_model", None)]
    with pytest.raises(SproutError, match=pattern):
        run_ppo(tiny_cfg(data, base, tmp_path / "out", rm, **values))
