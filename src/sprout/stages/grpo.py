"""GRPO and its variants (Dr. GRPO, DAPO, GSPO, RLOO, CISPO, SAPO) on verifiable rewards, one stage of the loop.

The rollout buffer, prompts, rewards and held-out eval are `sprout.stages.rl_stage`'s. Per
generation batch: G = batch.num_generations completions per prompt, scored by the reward
functions (`sample_groups`, with dynamic sampling's rounds); old log-probs from one no-grad
forward unless the buffer serves one step and no KL enters the reward (then the loss's own
detached log-probs are the old ones: ratio 1, the same gradient, as TRL); group advantages
(`advantages`), every batch-wide figure over the gathered global batch. The buffer then
serves `grpo.num_iterations` steps of `sprout.losses.policy.policy_loss`. Normaliser
(`count_targets` = `denominator` of the loss mask): grpo/sapo the sequences of the global batch
(each one's token mean), bnpo/dapo/cispo its completion tokens, dr_grpo its sequences ×
rollout.max_completion_length; a global batch with no completion token left counts 1 (TRL's
clamp). `mask_truncated_completions` takes truncated completions out of the loss mask (still a
sequence for grpo and dr_grpo). With β = 0 no reference model is built.
"""

from __future__ import annotations

import math
import sys

import torch

from sprout.checkpoint import frozen_model_record
from sprout.ranges import check_ranges
from sprout.losses.policy import denominator, policy_loss
from sprout.rl.advantages import (DEFAULT_SCALE, STD_EPS, batch_normalize, group_advantages, normalize_then_sum,
                                   uniform_groups)
from sprout.rl.kl import kl_estimate
from sprout.rl.verifiers import reward_metrics
from sprout.engine.trainer import all_reduce_sums
from sprout.engine.run_stage import apply_lora, frozen_models_meta, reference_model, train_stage
from sprout.stages.configs import GRPOConfig, GRPOLossConfig
from sprout.stages.rl_rewards import build_rewards
from sprout.stages.rl_stage import RLStage, completion_logps, concat_rollouts, open_rl_run


class GRPOStage(RLStage):
    name = "grpo"

    def __init__(self, *args, grpo: GRPOLossConfig, ref_model: torch.nn.Module | None = None, **kw):
        super().__init__(*args, num_iterations=grpo.num_iterations, **kw)
        self.cfg, self.ref_model = grpo, ref_model
        self.scale = DEFAULT_SCALE[grpo.advantage] if grpo.scale_rewards is None else grpo.scale_rewards
        # the loss's own detached log-probs are the old ones: no old-logprob forward
        self.old_from_loss = grpo.num_iterations == 1 and not (ref_model is not None and grpo.kl_in == "reward")
        # sampling/logp_diff_max over this step's micro-batches (old_from_loss), kept on the device
        self.step_logp_diff_max = torch.zeros(())
        self.first_buffer = True  # the first generation batch of this process (a resumed run looks again)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self.ref_model is not None:
            self.ref_model = trainer.prepare_frozen(self.ref_model)

    # ---- rollouts ----
    def sample_groups(self) -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
        """(rollout, reward totals [N], per-function values [N, F], counts) of this rank's groups.
        With dynamic sampling a group whose rewards all agree is set aside and more prompts are
        drawn until every rank holds its share or max_generation_rounds were run; a batch still
        short is topped up with set-aside groups (advantage 0)."""
        c, G, need = self.cfg, self.G, self.loader.per_rank
        kept, spare, counts = [], [], {"rounds": 0, "groups": 0, "zero_std": 0}
        while True:
            counts["rounds"] += 1
            idx = self.loader.next_prompts()  # every rank draws, full or not: the order stays shared
            if len(kept) < need or self.sharded:  # under FSDP every rank generates (a collective)
                rollout = self.sample(idx)
                totals, per_fn = self.score(rollout, idx)
                flat = uniform_groups(per_fn if c.multi_objective_aggregation == "normalize_then_sum" else totals, G)
                for j in range(len(idx)):
                    rows = slice(j * G, (j + 1) * G)
                    zero = bool(flat[j])
                    counts["groups"] += 1
                    counts["zero_std"] += zero
                    group = ({k: v[rows] for k, v in rollout.items()}, totals[rows], per_fn[rows])
                    (spare if zero and c.dynamic_sampling else kept).append(group)
            kept = kept[:need]
            if not c.dynamic_sampling:
                break
            short = all_reduce_sums(self.acc, {"short": float(len(kept) < need)})["short"]
            if short == 0 or counts["rounds"] >= c.max_generation_rounds:
                break
        counts["short"] = float(len(kept) < need)
        if len(kept) < need:  # the most recent set-aside groups fill the rest (advantage 0)
            kept += spare[len(spare) - (need - len(kept)):]
        rollout = concat_rollouts([g[0] for g in kept])
        return rollout, torch.cat([g[1] for g in kept]), torch.cat([g[2] for g in kept]), counts

    def fill_buffer(self) -> tuple[dict, dict]:
        c, acc = self.cfg, self.acc
        with self.engine.generating():  # the rounds share one set of fused weight copies, freed after them
            rollout, totals, per_fn, counts = self.sample_groups()
        mask = rollout["completion_mask"]
        if not self.old_from_loss:
            rollout["old_logps"] = self.logps_of(self.model, rollout)
        kl_sums = None
        if self.ref_model is not None:
            rollout["ref_logps"] = self.logps_of(self.ref_model, rollout)
            if c.kl_in == "reward":
                kl = kl_estimate(rollout["old_logps"], rollout["ref_logps"], c.kl_estimator) * mask
                kl_sums = (float(kl.sum()), float(mask.sum()))
                totals_adv = totals - c.beta * kl.sum(dim=1).double()
        if kl_sums is None:
            totals_adv = totals
        # the global batch, in rank order: [reward for advantages, reward, length, truncated, per function]
        table = self.gather(torch.cat([torch.stack([totals_adv, totals, rollout["lengths"].double(),
                                                    rollout["truncated"].double()], dim=1), per_fn], dim=1))
        rollout["advantages"] = self.advantages(totals_adv, per_fn, table[:, 0]).float()
        if self.first_buffer:
            self.first_buffer = False
            self.warn_zero_rewards(table[:, 1])
        stats = self.buffer_stats(table, rollout, counts, kl_sums)
        rollout.pop("lengths")
        # TRL clamps the token denominator to 1: a global batch whose every completion left the
        # loss (all truncated, masked) counts one target, on rank 0's first micro-batch.
        empty = denominator(self.loss_mask(rollout), c.loss_type, self.rollout.max_completion_length)
        empty = all_reduce_sums(acc, {"n": empty})["n"] == 0
        rollout["extra_target"] = torch.zeros(rollout["advantages"].shape[0], dtype=torch.long)
        rollout["extra_target"][0] = int(empty and acc.is_main_process)
        return rollout, stats

    def advantages(self, rewards: torch.Tensor, per_fn: torch.Tensor, batch_rewards: torch.Tensor) -> torch.Tensor:
        """This rank's advantages [n] from its rewards [n], its per-function values [n, F] and the
        rewards of the global batch: `group_advantages` (sum_then_normalize; batch scaling by the
        global batch's reward std) or `normalize_then_sum` + `batch_normalize`, then optionally
        `batch_normalize` (normalize_advantages); each batch-wide figure is taken over the global
        batch, gathered, so N processes compute what one does."""
        c, G = self.cfg, self.G
        if c.multi_objective_aggregation == "normalize_then_sum":
            summed = normalize_then_sum(per_fn, [r.weight for r in self.rewards], G)
            adv = batch_normalize(summed, self.gather(summed))
        elif self.scale == "batch":
            adv = group_advantages(rewards, G, c.advantage, "none").advantages / (batch_rewards.std() + STD_EPS)
        else:
            adv = group_advantages(rewards, G, c.advantage, self.scale).advantages
        if c.normalize_advantages:
            adv = batch_normalize(adv, self.gather(adv))
        return adv

    def warn_zero_rewards(self, rewards: torch.Tensor) -> None:
        """A warning (rank 0) when every reward of the global batch `rewards` is 0: every
        advantage is then 0 and the step learns nothing."""
        if self.acc.is_main_process and not bool(rewards.abs().sum()):
            names = ", ".join(r.name for r in self.rewards)
            print(f"warning: grpo: every reward of the first generation batch is 0 ({rewards.numel()} completions; "
                  f"reward functions {names}): every advantage is 0 and nothing is learned until some reward is not; "
                  f"check rewards.reward_funcs and the prompts' gold", file=sys.stderr, flush=True)

    def buffer_stats(self, table: torch.Tensor, rollout: dict, counts: dict, kl_sums) -> dict:
        """The buffer's figures over the global batch as {name: (sum, count)}, TRL's names: reward,
        reward_std (mean over groups), rewards/<fn>/mean|std, frac_reward_zero_std (over every
        group generated, set-aside ones included), completions/mean_length|max_length|min_length|
        clipped_ratio, kl (per completion token, kl_in: reward), sampling/logp_diff_mean|max,
        dynamic_sampling/rounds|short_batches. The loss adds kl, entropy and clip ratios."""
        acc, G = self.acc, self.G
        red = all_reduce_sums(acc, {"groups": counts["groups"], "zero_std": counts["zero_std"],
                                    "short": counts["short"], **dict(zip(("kl", "kl_n"), kl_sums or (0, 0)))})
        n, lengths = table.shape[0], table[:, 2]
        stats = {"reward": (float(table[:, 1].sum()), n),
                 "reward_std": (float(table[:, 0].view(-1, G).std(dim=1).sum()), n // G),
                 "frac_reward_zero_std": (red["zero_std"], red["groups"]),
                 "completions/mean_length": (float(lengths.sum()), n),
                 "completions/max_length": (float(lengths.max()), 1),
                 "completions/min_length": (float(lengths.min()), 1),
                 "completions/clipped_ratio": (float(table[:, 3].sum()), n)}
        if "old_logps" in rollout:  # else the loss logs them (`sampling_metrics`)
            stats.update(self.logp_gap_stats(rollout))
        per_fn = {r.name: [None if math.isnan(v) else v for v in table[:, 4 + i].tolist()]
                  for i, r in enumerate(self.rewards)}
        stats.update({k: (v, 1) for k, v in reward_metrics(per_fn).items()})
        if kl_sums is not None:
            stats["kl"] = (red["kl"], red["kl_n"])
        if self.cfg.dynamic_sampling:
            stats["dynamic_sampling/rounds"] = (counts["rounds"], 1)
            stats["dynamic_sampling/short_batches"] = (float(red["short"] > 0), 1)
        return stats

    # ---- the loss ----
    def loss_mask(self, batch: dict) -> torch.Tensor:
        mask = batch["completion_mask"]
        if self.cfg.mask_truncated_completions:
            mask = mask * (~batch["truncated"].bool())[:, None].to(mask.dtype)
        return mask

    def count_targets(self, batch: dict) -> torch.Tensor:
        return denominator(self.loss_mask(batch), self.cfg.loss_type, self.rollout.max_completion_length) \
            + batch["extra_target"].sum()

    def loss(self, model, batch: dict):
        c = self.cfg
        real = batch["completion_mask"].bool()
        logps, entropy = completion_logps(model, batch, self.rollout.temperature, entropy=True,
                                          entropy_grad=c.entropy_coef > 0, padding_free=self.batch_cfg.padding_free)
        logps = torch.where(real, logps, torch.zeros((), device=logps.device))
        kl = None
        if self.ref_model is not None and c.kl_in == "loss":
            kl = kl_estimate(logps, batch["ref_logps"], c.kl_estimator)
            kl = torch.where(real, kl, torch.zeros((), device=kl.device))
        old, sampling = batch.get("old_logps"), {}
        if old is None:  # old_from_loss
            old, sampling = logps.detach(), self.sampling_metrics(logps.detach(), batch, real)
        out = policy_loss(logps, old, batch["advantages"], self.loss_mask(batch),
                          loss_type=c.loss_type, max_completion_length=self.rollout.max_completion_length,
                          epsilon=c.epsilon, epsilon_high=c.epsilon_high, delta=c.delta,
                          importance_sampling=c.importance_sampling_level,
                          sapo_temperature_pos=c.sapo_temperature_pos, sapo_temperature_neg=c.sapo_temperature_neg,
                          per_token_kl=kl, beta=c.beta, use_bias_correction_kl=c.use_bias_correction_kl,
                          entropy=entropy, entropy_coef=c.entropy_coef)
        n = out.denominator + batch["extra_target"].sum()
        return out.loss_sum, n, {**out.metrics, **sampling, **self.stat_metrics(batch)}

    def sampling_metrics(self, logps: torch.Tensor, batch: dict, real: torch.Tensor) -> dict:
        """sampling/logp_diff_mean of a micro-batch as (sum, count) per completion token; its
        max is kept for `derived_metrics`. Used when the loss's log-probs are the old ones."""
        diff = (logps - batch["sampler_logps"]).abs()[real]
        if diff.numel():
            self.step_logp_diff_max = torch.maximum(self.step_logp_diff_max.to(diff.device), diff.max())
        return {"sampling/logp_diff_mean": (diff.double().sum(), diff.numel())}

    def derived_metrics(self, reduced: dict) -> dict:
        """sampling/logp_diff_max of the step over every rank (old_from_loss; else the buffer's)."""
        if not self.old_from_loss:
            return {}
        worst = float(self.gather(self.step_logp_diff_max.reshape(1)).max())
        self.step_logp_diff_max = torch.zeros(())
        return {"sampling/logp_diff_max": worst}


def run_grpo(cfg: GRPOConfig, resume: str | None = None) -> dict:
    """Check inputs, load the policy (and the reference when grpo.beta > 0), resume if asked,
    train; returns fit's summary (sprout.engine.training_loop)."""
    check_ranges(cfg)  # a config built in Python (the scripts' from_dict has checked)
    rewards = build_rewards(cfg.rewards, cfg.rollout.max_completion_length)
    run = open_rl_run(cfg, "grpo", cfg.grpo.num_iterations, resume)
    cfg, acc = run.cfg, run.accelerator
    # from a PPO policy: without its value head; a LoRA resume loads its adapters onto the base
    policy = run.init_lm(load=run.resume is None or not cfg.lora.off)
    lora = apply_lora(policy, cfg, run.base)
    ref = None
    if cfg.grpo.beta > 0:
        ref, how = reference_model(policy, lora, run.init_lm, base_is_reference=True)
        acc.print(f"grpo: reference {run.base['path']} ({how}), beta {cfg.grpo.beta}, KL in the {cfg.grpo.kl_in}")
    stage = GRPOStage(acc, run.tokenizer, run.loader, run.val, cfg.batch, cfg.rollout, rewards, grpo=cfg.grpo,
                      ref_model=ref, seed=cfg.train.seed, eval_batch=cfg.data.eval_batch,
                      eval_generations=cfg.data.eval_num_generations)
    frozen = {"reference": frozen_model_record(run.base)} if ref is not None else {}
    meta = {**run.provenance(), **frozen_models_meta(lora, **frozen)}
    return train_stage(acc, policy, stage, cfg, resume=run.resume, tokenizer=run.tokenizer.spec,
                       micro_steps=None if cfg.batch.micro_batch_tokens else stage.accum_steps, extra_meta=meta)

