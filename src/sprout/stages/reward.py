"""Reward model: a scalar score per response, trained on preference pairs as one stage of the shared loop.

`reward.score`, both built by `init_from_lm` from an LM checkpoint, both sides of every pair in
one forward (`pair_scores`): `head`, a `RewardModel` (the LM's backbone and a fresh score head)
read at the response's end-of-turn token (`score_sequences`; meta.json `architecture: reward`);
or `logprob`, the LM itself, a response scoring β × its summed log-probability given the prompt
(`architecture: lm` with `reward_score: {kind: logprob, beta}`, read by
`sprout.formats.checkpoint_meta.reward_score_of`; always <= 0, so center_rewards_coefficient is
refused with it; logits computed at the response tokens alone). Loss per pair (`sprout.losses.preference.reward_pair_loss`):
−log σ(r_c − r_r − m) + center_rewards_coefficient · (r_c + r_r)². Normaliser: the pairs of the
whole global batch (all micro-batches, all processes), nothing within a pair. Training metrics
are per pair; `derived_metrics` gives the population std over the global batch's real pairs
from the reduced mean and mean square, not an average of per-micro-batch stds.
"""

from __future__ import annotations

import torch

from sprout.ranges import check_ranges
from sprout.errors import SproutError
from sprout.losses.preference import reward_pair_loss
from sprout.model.heads import last_index, padding_inputs, score_at
from sprout.model.load import init_from_lm
from sprout.engine.trainer import all_reduce_sums
from sprout.engine.run_stage import apply_lora, train_stage
from sprout.stages.configs import RewardConfig, RewardLossConfig
from sprout.stages.packing import PackedRows
from sprout.stages.preference_stage import (
    PreferenceStage,
    open_preference_run,
    pair_groups,
    split_sides,
)
from sprout.stages.reference_logps import response_logps


def population_std(mean: float, mean_sq: float) -> float:
    """The population standard deviation of values with mean `mean` and mean square `mean_sq`:
    sqrt(mean_sq − mean²), normalised by the number of values (not n − 1); a negative
    difference left by rounding counts as 0."""
    return max(0.0, mean_sq - mean * mean) ** 0.5


def score_sequences(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    end_index: torch.Tensor | None = None, padding_free: bool = False) -> torch.Tensor:
    """The score of each row [B]: the model's score at `end_index` (default: the row's last real
    token), with segment and position ids from the mask, so left and right padding give the
    same scores and each row computes what it computes alone; `padding_free`: the rows packed
    (`sprout.stages.packing.PackedRows`), each score read back at its row's place."""
    if padding_free:
        rows = PackedRows(attention_mask)
        scores = rows.unpack(rows.forward(model, input_ids))
    else:
        segment_ids, position_ids = padding_inputs(attention_mask)
        scores = model(input_ids, segment_ids=segment_ids, position_ids=position_ids)
    return score_at(scores, last_index(attention_mask) if end_index is None else end_index)


def reward_score(c: RewardLossConfig) -> dict:
    """meta.json's `reward_score` of a run with these options: {"kind": "head"} or
    {"kind": "logprob", "beta": β}, what `sprout.formats.checkpoint_meta.reward_score_of` reads back."""
    return {"kind": "logprob", "beta": c.beta} if c.score == "logprob" else {"kind": "head"}


def pair_scores(model, batch: dict, loss_cfg: RewardLossConfig, padding_free: bool = False) -> torch.Tensor:
    """The score [2B] of both sides of a micro-batch of pairs (chosen, then rejected), one forward
    (`padding_free`: over the sides packed): the score head at each side's end-of-turn, or β × the
    summed log-probability of each side's response tokens (`reward.score`)."""
    if loss_cfg.score == "logprob":
        return loss_cfg.beta * response_logps(model, batch, padding_free, overwrite_logits=True)
    return score_sequences(model, batch["input_ids"], batch["attention_mask"], batch["end_index"], padding_free)


def reward_batch_loss(model, batch: dict, loss_cfg: RewardLossConfig, padding_free: bool = False):
    """(per-pair losses [B], r_chosen [B], r_rejected [B]) of one micro-batch of pairs, one forward."""
    r_chosen, r_rejected = split_sides(pair_scores(model, batch, loss_cfg, padding_free))
    margin = batch["margin"] if loss_cfg.use_margin else None
    return (reward_pair_loss(r_chosen, r_rejected, margin, loss_cfg.center_rewards_coefficient),
            r_chosen, r_rejected)


class RewardStage(PreferenceStage):
    name = "reward"

    def __init__(self, accelerator, loader, val, accum_steps: int, loss_cfg: RewardLossConfig,
                 val_groups: list[list[str | None]] | None = None, **batching):
        super().__init__(accelerator, loader, val, accum_steps, val_groups, **batching)
        self.loss_cfg = loss_cfg

    def logit_positions(self, batch: dict) -> int | None:
        """`score: logprob`: the response tokens (`response_logps`); the score head: none of
        them (a reward model has no lm_head)."""
        return int(batch["loss_mask"].sum()) if self.loss_cfg.score == "logprob" else None

    def _pair_loss(self, model, batch: dict):
        return reward_batch_loss(model, batch, self.loss_cfg, self.padding_free)

    def loss(self, model, batch: dict):
        """Summed per-pair losses over the real pairs, their count, and per pair: accuracy (r_c > r_r
        strictly; a tie is wrong), margin (r_c − r_r), rewards/chosen|rejected and their squares."""
        per_pair, rc, rr = self._pair_loss(model, batch)
        keep = batch["pair_mask"]
        n = keep.sum()
        zero = torch.zeros((), device=per_pair.device)
        with torch.no_grad():
            rc, rr = torch.where(keep, rc, zero), torch.where(keep, rr, zero)
            metrics = {"accuracy": (((rc > rr) & keep).sum(), n), "margin": ((rc - rr).sum(), n),
                       "rewards/chosen": (rc.sum(), n), "rewards/rejected": (rr.sum(), n),
                       "rewards/chosen_sq": ((rc * rc).sum(), n), "rewards/rejected_sq": ((rr * rr).sum(), n)}
        return torch.where(keep, per_pair, zero).sum(), n, metrics

    def derived_metrics(self, reduced: dict) -> dict:
        """rewards/chosen_std and rewards/rejected_std of the step: population std over the global
        batch's real pairs, sqrt(mean(r²) − mean(r)²) from the reduced mean and mean square."""
        return {f"rewards/{side}_std": population_std(reduced[f"rewards/{side}"], reduced[f"rewards/{side}_sq"])
                for side in ("chosen", "rejected") if f"rewards/{side}_sq" in reduced}

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        """Over every held-out pair (denominator `val_pairs`): val_loss, val_accuracy, val_margin,
        val_rewards/{chosen,rejected} and their population `_std`, and val_accuracy/<group> per
        source and rejected_kind with its val_pairs/<group> (`group_figures`)."""
        sums: dict[str, torch.Tensor | float] = dict.fromkeys(
            ("loss", "n", "correct", "margin", "rc", "rc2", "rr", "rr2"), 0.0)
        model.eval()
        for batch in self.eval_batches():
            with self.acc.autocast():
                per_pair, rc, rr = self._pair_loss(model, batch)
            keep = batch["pair_mask"]
            self.add_group_sums(sums, batch, rc > rr)
            rc, rr = rc[keep].double(), rr[keep].double()
            for k, v in (("loss", per_pair[keep].sum()), ("n", keep.sum()), ("correct", (rc > rr).sum()),
                         ("margin", (rc - rr).sum()), ("rc", rc.sum()), ("rc2", (rc * rc).sum()),
                         ("rr", rr.sum()), ("rr2", (rr * rr).sum())):
                sums[k] = sums[k] + v.double().cpu()
        model.train()
        tot = all_reduce_sums(self.acc, sums)
        n = tot["n"]
        if n == 0:
            raise SproutError(f"{self.val.path}: no held-out pairs to evaluate")
        mean_c, mean_r = tot["rc"] / n, tot["rr"] / n
        out = {"val_loss": tot["loss"] / n, "val_accuracy": tot["correct"] / n, "val_margin": tot["margin"] / n,
               "val_rewards/chosen": mean_c, "val_rewards/chosen_std": population_std(mean_c, tot["rc2"] / n),
               "val_rewards/rejected": mean_r, "val_rewards/rejected_std": population_std(mean_r, tot["rr2"] / n),
               "val_pairs": n}
        return {**out, **self.group_figures(tot, "val_accuracy")}


def run_reward(cfg: RewardConfig, resume: str | None = None) -> dict:
    """Check inputs, build the reward model from the init LM, resume if asked, train; returns fit's summary (sprout.engine.training_loop)."""
    check_ranges(cfg)  # a config built in Python (the scripts' from_dict has checked)
    c = cfg.reward
    run = open_preference_run(cfg, "reward", resume)
    cfg, acc = run.cfg, run.accelerator
    logprob = c.score == "logprob"
    model, _ = init_from_lm(run.base["path"], "lm" if logprob else "reward", seed=cfg.train.seed)
    lora = apply_lora(model, cfg, run.base)  # the score head trains in full beside the adapters
    acc.print(f"reward: score {'beta ' + str(c.beta) + ' x the summed response log-prob' if logprob else 'head'}")
    stage = RewardStage(acc, run.loader, run.val, run.accum_steps, c, pair_groups(run.val_path, run.val),
                        **run.batching())
    return train_stage(acc, model, stage, cfg, resume=run.resume, tokenizer=run.tokenizer.spec,
                       micro_steps=None if cfg.batch.micro_batch_tokens else run.accum_steps,
                       extra_meta={**run.provenance(), "reward_score": reward_score(c), **lora})
