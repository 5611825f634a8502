"""PPO (RLHF's classic stage): a policy with a value head, rewards from a reward model and/or verifiers,
per-token KL to a frozen reference, GAE, clipped policy and value losses, as one stage of the shared loop.

The trained module is `PolicyWithValue` (architecture "lm+value": one backbone, the value head
fresh or a copy of the reward model's score head, at its own lr). Frozen: the reference (a copy
of the init LM) and the reward model; checkpoints record both in `frozen_models` and a resume
refuses either once changed. Per generation batch (`fill_buffer`): score = reward_model_weight
× the reward model's score + the weighted verifier rewards (missing-eos rule applied); token
rewards -kl_coef × KL on every completion token plus the score on the last (`kl_in: reward`);
GAE; advantages whitened over the completion tokens of the whole global batch. The buffer
serves num_ppo_epochs × num_mini_batches optimizer steps. Per token: clipped surrogate
+ vf_coef × clipped value loss - entropy_coef × entropy (+ kl_coef × KL with `kl_in: loss`).
Normaliser: the completion tokens of the global mini-batch (every micro-batch on every
process), so the step's loss is that token mean whatever the split. The first
`value_warmup_steps` optimizer steps are the critic's alone: loss vf_coef × value loss, the value
head reading the hidden states detached, every other parameter's lr held at 0 (`hold_steps`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sprout.checkpoint import frozen_model_record
from sprout.ranges import check_ranges
from sprout.errors import SproutError
from sprout.formats.checkpoint_meta import META, reward_score_of
from sprout.losses.policy import clipped_surrogate, policy_loss, value_loss, value_only_loss
from sprout.model.load import init_from_lm, load_model
from sprout.rl.advantages import gae, token_rewards
from sprout.rl.kl import AdaptiveKLController, FixedKLController, kl_estimate, kl_k1, kl_k3
from sprout.rl.verifiers import reward_metrics
from sprout.engine.trainer import all_reduce_sums
from sprout.engine.optim import decay_groups
from sprout.engine.run_stage import apply_lora, frozen_models_meta, reference_model, train_stage
from sprout.stages.configs import PPOBatchConfig, PPOConfig, PPOLossConfig, RolloutConfig
from sprout.stages.reward import score_sequences
from sprout.stages.rl_rewards import build_rewards
from sprout.stages.packing import CompletionRows
from sprout.stages.rl_stage import RLStage, completion_logps, open_rl_run, pad_columns


# ---- pure pieces --------------------------------------------------------------------------------
def advantages_and_returns(scores: torch.Tensor, per_token_kl: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor, kl_coef: float, gamma: float, lam: float,
                           whiten_rewards=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token rewards, raw GAE advantages, returns) [N, L] in float64: the score [N] on each
    completion's last token, -kl_coef × KL on every token, optionally whitened
    (`whiten_rewards(x, mask)`), then `gae` over the old values."""
    rewards = token_rewards(scores.double(), per_token_kl.double(), mask, kl_coef)
    if whiten_rewards is not None:
        rewards = whiten_rewards(rewards, mask)
    adv, returns = gae(rewards, values.double(), mask, gamma, lam)
    return rewards, adv, returns


def whiten_global(acc, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`sprout.rl.advantages.masked_whiten` over the masked positions of every process: the
    mean, then the Bessel-corrected variance, from sums all-reduced in float64. Masked-out
    positions are 0."""
    m, xd = mask.double(), x.double()
    s = all_reduce_sums(acc, {"sum": (xd * m).sum(), "n": m.sum()})
    if s["n"] < 2:
        raise SproutError(f"whitening needs at least 2 completion tokens in the global batch, got {int(s['n'])}")
    mean = s["sum"] / s["n"]
    var = all_reduce_sums(acc, {"sq": ((xd - mean) ** 2 * m).sum()})["sq"] / (s["n"] - 1)
    out = (xd - mean) * (var + 1e-8) ** -0.5
    return (out if shift_mean else out + mean) * m


class WithValues:
    """The policy called as a plain LM (what `completion_logps` calls) that keeps its values:
    after a call, `values` [B, T] holds the value head's output at every input position."""

    def __init__(self, model, detach_values: bool = False):
        self.model, self.values, self.detach_values = model, None, detach_values

    def __call__(self, input_ids, **kwargs):
        logits, self.values = self.model(input_ids, return_values=True, detach_values=self.detach_values, **kwargs)
        return logits


def logps_and_values(model, batch: dict, temperature: float = 1.0, entropy: bool = False,
                     entropy_grad: bool = False, padding_free: bool = False, detach_values: bool = False):
    """(log-probs, values, entropy) [N, L] of the completion tokens: each value is V of the state
    before its token (read at the position that predicts it); `padding_free` as in
    `completion_logps`; `detach_values` as in `PolicyWithValue`. Off-mask positions hold garbage."""
    net, rows = WithValues(model, detach_values), CompletionRows(batch, padding_free)
    logps, ent = completion_logps(net, batch, temperature, entropy=entropy, entropy_grad=entropy_grad, rows=rows)
    return logps, rows.completion_of_all(net.values), ent


# ---- the stage ----------------------------------------------------------------------------------
class PPOStage(RLStage):
    name = "ppo"

    def __init__(self, accelerator, tokenizer, loader, val, batch: PPOBatchConfig, rollout: RolloutConfig, rewards,
                 *, ppo: PPOLossConfig, ref_model: torch.nn.Module, reward_model=None, reward_score: dict | None = None,
                 weight_decay: float = 0.0, seed: int = 0, eval_batch: int = 32, eval_generations: int = 0):
        c = ppo
        super().__init__(accelerator, tokenizer, loader, val, batch, rollout, rewards,
                         num_iterations=c.num_ppo_epochs * batch.num_mini_batches, seed=seed, eval_batch=eval_batch,
                         eval_generations=eval_generations, mini_batches=batch.num_mini_batches)
        self.cfg, self.ref_model, self.reward_model, self.weight_decay = c, ref_model, reward_model, weight_decay
        self.reward_score = reward_score or {"kind": "head"}  # how the reward model scores (`reward_score_of`)
        self.M = batch.num_mini_batches
        self.value_only = False  # this step is one of the value warm-up's (`next_micro_batches`)
        self.mini_rows = self.accum_steps * batch.micro_completions
        self.kl_ctl = (AdaptiveKLController(c.kl_coef, c.target_kl, c.horizon) if c.adaptive_kl
                       else FixedKLController(c.kl_coef))

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.ref_model = trainer.prepare_frozen(self.ref_model)
        if self.reward_model is not None:
            self.reward_model = trainer.prepare_frozen(self.reward_model)

    def param_groups(self, model) -> list[dict]:
        """The backbone and lm_head as `decay_groups`, held at lr 0 through the value warm-up; the
        value head alone at value_lr (or optim.lr × vf_lr_scale), without weight decay, named for
        its lr in the logs."""
        head = model.value_head.weight
        rest = [p for p in model.parameters() if p.requires_grad and p is not head]
        value = {"params": [head], "weight_decay": 0.0, "name": "value_head"}
        value.update({"lr": self.cfg.value_lr} if self.cfg.value_lr else {"lr_scale": self.cfg.vf_lr_scale})
        hold = {"hold_steps": self.cfg.value_warmup_steps} if self.cfg.value_warmup_steps else {}
        return decay_groups(rest, self.weight_decay, **hold) + [value]

    # ---- the rollout batch ----
    def reward_model_scores(self, rollout: dict) -> torch.Tensor:
        """The reward model's score [N] float64 of each prompt + completion, in micro-batches: its
        score head read at the completion's last token, or β × the completion's summed
        log-probability under it (temperature 1)."""
        logprob, free = self.reward_score["kind"] == "logprob", self.batch_cfg.padding_free

        def score(part: dict) -> torch.Tensor:
            if logprob:
                lp, _ = completion_logps(self.reward_model, part, padding_free=free)
                mask = part["completion_mask"].bool()
                return (self.reward_score["beta"] * torch.where(mask, lp, 0.0).double().sum(1)).cpu()
            ids = torch.cat([part["prompt_ids"], part["completion_ids"]], dim=1)
            mask = torch.cat([part["prompt_mask"], part["completion_mask"]], dim=1)
            return score_sequences(self.reward_model, ids, mask, padding_free=free).double().cpu()

        return torch.cat(self.no_grad_pass(score, rollout))

    def old_logps_and_values(self, rollout: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probs and values [N, L] (0 off the mask), in micro-batches."""
        L, mask = rollout["completion_ids"].shape[1], rollout["completion_mask"]

        def logps_values(part: dict) -> tuple[torch.Tensor, torch.Tensor]:
            lp, v, _ = logps_and_values(self.model, part, self.rollout.temperature,
                                        padding_free=self.batch_cfg.padding_free)
            return pad_columns(lp, L), pad_columns(v, L)

        lps, vals = zip(*self.no_grad_pass(logps_values, rollout))
        return torch.cat(lps) * mask, torch.cat(vals) * mask

    def scores_of(self, rollout: dict, idx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [N] after the missing-eos rule, reward model scores [N] (0 without one),
        verifier values [N, F]), float64."""
        c = self.cfg
        totals, per_fn = self.score(rollout, idx)
        rm = self.reward_model_scores(rollout) if self.reward_model is not None else torch.zeros_like(totals)
        scores = totals + c.reward_model_weight * rm
        missing = rollout["truncated"].bool()
        scores = torch.where(missing, scores - c.missing_eos_penalty if c.missing_eos == "penalty"
                             else torch.zeros_like(scores), scores)
        return scores, rm, per_fn

    def fill_buffer(self) -> tuple[dict, dict]:
        c, acc = self.cfg, self.acc
        times = {}
        t = time.perf_counter()
        idx = self.loader.next_prompts()
        rollout = self.sample(idx)
        times["time/generation_s"] = time.perf_counter() - t
        t = time.perf_counter()
        scores, rm, per_fn = self.scores_of(rollout, idx)
        times["time/reward_model_s"] = time.perf_counter() - t
        t = time.perf_counter()
        rollout["old_logps"], rollout["old_values"] = self.old_logps_and_values(rollout)
        times["time/values_s"] = time.perf_counter() - t
        t = time.perf_counter()
        rollout["ref_logps"] = self.logps_of(self.ref_model, rollout)
        times["time/reference_s"] = time.perf_counter() - t
        mask = rollout["completion_mask"]
        k1 = kl_k1(rollout["old_logps"], rollout["ref_logps"]).double() * mask
        k3 = kl_k3(rollout["old_logps"], rollout["ref_logps"]).double() * mask
        kl = k1 if c.kl_estimator == "k1" else k3
        kl_coef = self.kl_ctl.value
        whiten = (lambda x, m: whiten_global(acc, x, m, shift_mean=False)) if c.whiten_rewards else None
        _, adv, returns = advantages_and_returns(scores, kl if c.kl_in == "reward" else torch.zeros_like(kl),
                                                 rollout["old_values"], mask, kl_coef, c.gamma, c.lam, whiten)
        rollout["advantages"] = whiten_global(acc, adv, mask).float()
        rollout["returns"] = returns.float()
        rollout["scores"] = scores.float()
        rollout["kl_coef"] = torch.full_like(scores, kl_coef)
        n = scores.shape[0]
        rollout["order"] = torch.stack([torch.randperm(n, generator=self.generator, device=self.generator.device)
                                        for _ in range(c.num_ppo_epochs)]).cpu()
        # the global batch, in rank order: one row per completion
        table = self.gather(torch.cat([torch.stack([scores, rm, k1.sum(1), k3.sum(1), kl.sum(1),
                                                    -(rollout["old_logps"].double() * mask).sum(1),
                                                    rollout["lengths"].double(), rollout["truncated"].double()],
                                                   dim=1), per_fn], dim=1))
        stats = self.buffer_stats(table, rollout, kl_coef, times)
        self.kl_ctl.update(stats["objective/kl"][0] / stats["objective/kl"][1], int(table.shape[0]))
        rollout.pop("lengths")
        return rollout, stats

    def buffer_stats(self, table: torch.Tensor, rollout: dict, kl_coef: float, times: dict) -> dict:
        """The rollout batch's figures over the global batch as {name: (sum, count)}, TRL's names:
        objective/kl (mean over sequences of the summed per-token KL of the estimator in use),
        objective/kl_k1 and objective/kl_k3 (both estimators, always), objective/kl_coef,
        objective/entropy (mean over sequences of -sum log pi_old), objective/scores (mean score),
        objective/non_score_reward (mean over sequences of -kl_coef × summed KL),
        objective/rlhf_reward (scores + non_score_reward), rewards/reward_model/mean,
        rewards/<fn>/mean|std, val/explained_variance (1 - Var(R - V_old) / Var(R) over completion
        tokens), val/num_eos_tokens, completions/mean_length|max_length|min_length|clipped_ratio,
        sampling/logp_diff_mean|max (the old log-probs against the sampler's), and rank 0's
        seconds per batch in time/generation_s, time/reward_model_s, time/reference_s,
        time/values_s (old log-probs and values)."""
        mask = rollout["completion_mask"].double()
        R, V = rollout["returns"].double(), rollout["old_values"].double()
        s = all_reduce_sums(self.acc, {"n": mask.sum(), "r": (R * mask).sum(), "r2": (R * R * mask).sum(),
                                       "e": ((R - V) * mask).sum(), "e2": ((R - V) ** 2 * mask).sum()})
        var_r = s["r2"] / s["n"] - (s["r"] / s["n"]) ** 2
        var_e = s["e2"] / s["n"] - (s["e"] / s["n"]) ** 2
        n = table.shape[0]
        scores, kl = table[:, 0], table[:, 4]
        non_score = -kl_coef * kl
        lengths = table[:, 6]
        stats = {"objective/kl": (float(kl.sum()), n), "objective/kl_k1": (float(table[:, 2].sum()), n),
                 "objective/kl_k3": (float(table[:, 3].sum()), n), "objective/kl_coef": (kl_coef, 1),
                 "objective/entropy": (float(table[:, 5].sum()), n), "objective/scores": (float(scores.sum()), n),
                 "objective/non_score_reward": (float(non_score.sum()), n),
                 "objective/rlhf_reward": (float((scores + non_score).sum()), n),
                 "val/explained_variance": (1.0 - var_e / var_r if var_r > 0 else float("nan"), 1),
                 "val/num_eos_tokens": (float(n - table[:, 7].sum()), 1),
                 "completions/mean_length": (float(lengths.sum()), n),
                 "completions/max_length": (float(lengths.max()), 1),
                 "completions/min_length": (float(lengths.min()), 1),
                 "completions/clipped_ratio": (float(table[:, 7].sum()), n)}
        if self.reward_model is not None:
            stats["rewards/reward_model/mean"] = (float(table[:, 1].sum()), n)
        per_fn = {r.name: [None if v != v else v for v in table[:, 8 + i].tolist()]
                  for i, r in enumerate(self.rewards)}
        stats.update({k: (v, 1) for k, v in reward_metrics(per_fn).items()})
        stats.update({k: (v, 1) for k, v in times.items()})
        stats.update(self.logp_gap_stats(rollout))
        if stats["val/explained_variance"][0] != stats["val/explained_variance"][0]:
            del stats["val/explained_variance"]  # constant returns: no variance to explain
        return stats

    def next_micro_batches(self, step: int) -> list[dict]:
        """The next mini-batch of the buffer (pass k // M, mini-batch k % M of this rank's
        shuffled rows) in micro-batches; a new buffer (rollouts) when it is used up."""
        self.value_only = step < self.cfg.value_warmup_steps
        b = self.serve_buffer(step)
        epoch, mini = divmod(self.served - 1, self.M)
        rows = b["order"][epoch][mini * self.mini_rows:(mini + 1) * self.mini_rows]
        data = {k: v[rows] for k, v in b.items() if k not in ("stats", "stat_names", "order")}
        return self.micro_batches(data, self.mini_rows)

    def tensor_state(self) -> dict:
        return {**super().tensor_state(), "kl_ctl": self.kl_ctl.state_dict()}

    def load_tensor_state(self, state: dict) -> None:
        super().load_tensor_state(state)
        self.kl_ctl.load_state_dict(state["kl_ctl"])

    # ---- the loss ----
    def count_targets(self, batch: dict) -> torch.Tensor:
        return batch["completion_mask"].long().sum()

    def loss(self, model, batch: dict):
        """The per-token loss summed, its denominator (the micro-batch's completion tokens) and,
        per completion token: loss/policy (the clipped surrogate), val/loss, val/clipfrac (share
        where the clipped value loss is the larger), policy/clipfrac (share where the ratio's clip
        is active), clip_ratio/low_mean|high_mean, policy/approxkl (0.5 × mean (log pi - log
        pi_old)^2), policy/entropy, kl (kl_in: loss). In the value warm-up the loss is
        `value_only_loss` (the same normaliser) and the metrics are those of the policy it holds."""
        c = self.cfg
        mask = batch["completion_mask"]
        real = mask.bool()
        zero = torch.zeros((), device=mask.device)
        logps, values, entropy = logps_and_values(model, batch, self.rollout.temperature, entropy=True,
                                                  entropy_grad=c.entropy_coef > 0 and not self.value_only,
                                                  padding_free=self.batch_cfg.padding_free,
                                                  detach_values=self.value_only)
        logps, values = torch.where(real, logps, zero), torch.where(real, values, zero)
        old_values, returns = batch["old_values"], batch["returns"]
        per_token_vf = value_loss(values, old_values, returns, c.cliprange_value)
        kl_coef = float(batch["kl_coef"][0])
        kl = None
        if c.kl_in == "loss":
            kl = torch.where(real, kl_estimate(logps, batch["ref_logps"], c.kl_estimator), zero)
        out = policy_loss(logps, batch["old_logps"], batch["advantages"], mask, loss_type="dapo",
                          epsilon=c.cliprange, dual_clip=c.dual_clip, per_token_kl=kl, beta=kl_coef,
                          entropy=entropy, entropy_coef=c.entropy_coef, per_token_value_loss=per_token_vf,
                          vf_coef=c.vf_coef)
        m = mask.to(logps.dtype)
        tokens = mask.long().sum()
        with torch.no_grad():
            log_ratio = logps - batch["old_logps"]
            surrogate = clipped_surrogate(log_ratio, batch["advantages"], c.cliprange, dual_clip=c.dual_clip)
            clipped_v = torch.clamp(values, old_values - c.cliprange_value, old_values + c.cliprange_value)
            v_clipped = ((clipped_v - returns) ** 2 > (values - returns) ** 2).to(m.dtype)
            metrics = {"loss/policy": ((surrogate * m).sum(), tokens), "val/loss": ((per_token_vf * m).sum(), tokens),
                       "val/clipfrac": ((v_clipped * m).sum(), tokens),
                       "policy/approxkl": ((0.5 * log_ratio ** 2 * m).sum(), tokens)}
        names = {"clip_ratio/region_mean": "policy/clipfrac", "entropy": "policy/entropy"}
        metrics.update({names.get(k, k): v for k, v in out.metrics.items()})
        loss_sum, denominator = out.loss_sum, out.denominator
        if self.value_only:
            loss_sum, denominator = value_only_loss(per_token_vf, logps, mask, c.vf_coef)
        return loss_sum, denominator, {**metrics, **self.stat_metrics(batch)}


# ---- the run ------------------------------------------------------------------------------------
def load_reward_model(path: str, policy_meta: dict, longest: int):
    """The frozen reward model of `path`, checked against the policy: a reward model's checkpoint
    (`reward_score_of`: a score head, or an LM trained with reward.score logprob), the same
    tokenizer, a context that holds `longest` tokens. Returns (model, meta, how it scores)."""
    model, meta = load_model(path)
    where = Path(meta["path"]) / META
    kind = reward_score_of(meta)
    if kind is None:
        raise SproutError(f"{where}: reward_model must be a reward model checkpoint (scripts/train_reward.py, "
                          f"or an import of one's export), not a checkpoint of stage {meta.get('stage')!r} (architecture "
                          f"{meta['architecture']!r})")
    if meta.get("tokenizer_fingerprint") != policy_meta.get("tokenizer_fingerprint"):
        raise SproutError(f"{where}: the reward model's tokenizer differs from the policy's "
                          f"({meta.get('tokenizer')} vs {policy_meta.get('tokenizer')})")
    if model.config.max_seq_len < longest:
        raise SproutError(f"{where}: max_seq_len {model.config.max_seq_len} is shorter than data.max_prompt_length "
                          f"+ rollout.max_completion_length = {longest}")
    return model, meta, kind


def init_value_head(policy, reward_model, where) -> None:
    """The policy's value head set to a copy of the reward model's score head (`value_init: reward`)."""
    if reward_model.score_head.weight.shape != policy.value_head.weight.shape:
        raise SproutError(f"{where}: the reward model's d_model differs from the policy's; use ppo.value_init policy")
    with torch.no_grad():
        policy.value_head.weight.copy_(reward_model.score_head.weight)


def run_ppo(cfg: PPOConfig, resume: str | None = None) -> dict:
    """Check inputs, build the policy with its value head, the reference and the reward model,
    resume if asked, train; returns fit's summary (sprout.engine.training_loop)."""
    check_ranges(cfg)  # a config built in Python (the scripts' from_dict has checked)
    c = cfg.ppo
    if c.value_init == "reward" and not cfg.reward_model:
        raise SproutError("ppo.value_init reward needs a reward model: set reward_model or pass --reward-model RUN")
    if c.value_warmup_steps and not c.vf_coef:
        raise SproutError("ppo.value_warmup_steps trains the value loss alone, and ppo.vf_coef 0 weighs it 0: "
                          "set ppo.vf_coef > 0")
    M = cfg.batch.num_mini_batches
    rewards = build_rewards(cfg.rewards, cfg.rollout.max_completion_length)
    run = open_rl_run(cfg, "ppo", c.num_ppo_epochs * M, resume, mini_batches=M)
    cfg, acc = run.cfg, run.accelerator
    if c.value_warmup_steps >= cfg.train.max_steps:
        raise SproutError(f"ppo.value_warmup_steps {c.value_warmup_steps} leaves no policy step in "
                          f"train.max_steps {cfg.train.max_steps}")
    rm, rm_meta, kind = None, None, None
    if cfg.reward_model:
        rm, rm_meta, kind = load_reward_model(cfg.reward_model, run.base,
                                              cfg.data.max_prompt_length + cfg.rollout.max_completion_length)
        if c.value_init == "reward" and kind["kind"] != "head":
            raise SproutError(f"{Path(rm_meta['path']) / META}: ppo.value_init reward copies a score head, "
                              "and this log-probability reward model has none; use ppo.value_init policy")
        how = f"beta {kind['beta']} x the completion's log-prob" if kind["kind"] == "logprob" else "score head"
        acc.print(f"ppo: reward model {rm_meta['path']} (frozen, {how}), weight {c.reward_model_weight}")
    policy, _ = init_from_lm(run.base["path"], "lm+value", seed=cfg.train.seed)
    if c.value_init == "reward" and run.resume is None:
        init_value_head(policy, rm, rm_meta["path"])
    lora = apply_lora(policy, cfg, run.base)  # the value head trains in full beside the adapters
    ref, how = reference_model(policy, lora, run.init_lm, base_is_reference=True)
    acc.print(f"ppo: reference {run.base['path']} ({how}); KL {c.kl_estimator} in the {c.kl_in}, "
              f"kl_coef {c.kl_coef}{' (adaptive)' if c.adaptive_kl else ''}; value head from the {c.value_init}")
    stage = PPOStage(acc, run.tokenizer, run.loader, run.val, cfg.batch, cfg.rollout, rewards, ppo=c, ref_model=ref,
                     reward_model=rm, reward_score=kind, weight_decay=cfg.optim.weight_decay, seed=cfg.train.seed,
                     eval_batch=cfg.data.eval_batch, eval_generations=cfg.data.eval_num_generations)
    frozen = {"reward_model": frozen_model_record(rm_meta, score=kind)} if rm_meta else {}
    meta = {**run.provenance(), **frozen_models_meta(lora, reference=frozen_model_record(run.base), **frozen)}
    return train_stage(acc, policy, stage, cfg, resume=run.resume, tokenizer=run.tokenizer.spec,
                       micro_steps=None if cfg.batch.micro_batch_tokens else stage.accum_steps, extra_meta=meta)
