"""DPO and its variants on preference pairs, as one stage of the shared loop.

The policy starts from an LM checkpoint; both sides of each pair go through one forward, a
side's log-probability summed over its response tokens (`sequence_logps`; logits are computed
at those tokens alone, `sprout.stages.packing.loss_forward`). The loss per pair
is `sprout.losses.preference.preference_loss` with TRL's DPOConfig options (`dpo` section).
Normaliser: the pairs of the whole global batch (all micro-batches, all processes); within a
pair, each variant's own rule. aot and aot_unpaired sort within each micro-batch, so their
loss depends on `batch.micro_pairs`, not on the number of processes (their held-out val_loss
does, eval pairs being striped over ranks). The reference (every loss_type outside
`REFERENCE_FREE`; none is built otherwise) is `dpo.ref` (default: init), a frozen copy run on
each micro-batch or, with `precompute_ref_logps`, cached once (`sprout.stages.reference_logps`);
checkpoints record it in `frozen_models` and a resume refuses it once changed. Metrics are
TRL's (`preference_metric_sums`); FLOPs and MFU count the policy only (its lm_head at the
response tokens only), not the reference forward.
"""

from __future__ import annotations

import torch

from sprout.checkpoint import frozen_model_record, load_weights, read_meta
from sprout.ranges import check_ranges
from sprout.errors import SproutError
from sprout.losses.preference import (
    check_preference_options,
    implicit_rewards,
    loss_type_list,
    mean_logit_sums,
    preference_loss,
    preference_metric_sums,
)
from sprout.losses.loss_types import REFERENCE_FREE
from sprout.losses.tokens import sequence_logps
from sprout.model.load import uninitialised
from sprout.model.transformer import Transformer
from sprout.engine.trainer import all_reduce_sums
from sprout.engine.run_stage import apply_lora, frozen_models_meta, reference_model, train_stage
from sprout.stages.configs import DPOConfig, DPOLossConfig
from sprout.stages.packing import loss_forward
from sprout.stages.preference_stage import PreferenceStage, open_preference_run, pair_groups
from sprout.stages.reference_logps import ReferenceLogps, reference_logps, response_logps


def needs_reference(loss_cfg: DPOLossConfig) -> bool:
    return not REFERENCE_FREE.issuperset(loss_type_list(loss_cfg.loss_type))


def check_dpo_options(c: DPOLossConfig) -> None:
    """Refuse options no loss can run with, naming the `dpo.` field."""
    try:
        check_preference_options(c.loss_type, c.loss_weights, beta=c.beta, label_smoothing=c.label_smoothing,
                                 discopop_tau=c.discopop_tau)
    except SproutError as exc:
        raise SproutError(f"dpo.{exc}") from None


def side_logps(model, batch: dict, padding_free: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed response log-probs [2B], response tokens [2B], logit sums [2B]) of one forward over
    both sides (`padding_free`: packed, `sprout.stages.packing`), logits computed at the response
    tokens alone (`loss_forward`); the logit sums (`mean_logit_sums`, no gradient) are taken
    before any backward."""
    logits = loss_forward(model, batch, padding_free)
    logit_sums = mean_logit_sums(logits, batch["loss_mask"])
    logps, lengths = sequence_logps(logits, batch["targets"], batch["loss_mask"], overwrite_logits=True)
    return logps, lengths, logit_sums


class DPOStage(PreferenceStage):
    name = "dpo"

    def __init__(self, accelerator, loader, val, accum_steps: int, loss_cfg: DPOLossConfig,
                 ref_model: torch.nn.Module | None = None, ref_path: str | None = None,
                 tokenizer_fingerprint: str = "", val_groups: list[list[str | None]] | None = None, **batching):
        super().__init__(accelerator, loader, val, accum_steps, val_groups, **batching)
        self.loss_cfg, self.ref_path, self.fingerprint = loss_cfg, ref_path, tokenizer_fingerprint
        self.ref_model = ref_model          # live reference (unprepared until setup)
        self.cached: ReferenceLogps | None = None  # precomputed reference log-probs (train, val)

    def setup(self, trainer) -> None:
        """Prepare the live reference, or compute / read the cached reference log-probs and free it."""
        if self.ref_model is None:
            return
        ref = trainer.prepare_frozen(self.ref_model)
        if self.loss_cfg.precompute_ref_logps:
            self.cached = reference_logps(self.acc, ref, self.ref_path, self.fingerprint,
                                          (self.loader, self.val), micro_pairs=self.micro_pairs,
                                          padding_free=self.padding_free)
            if ref in trainer.frozen:  # a frozen copy is freed; a LoRA policy's view stays the policy
                trainer.frozen.remove(ref)
            ref = None
        self.ref_model = ref

    def extend(self, batch: dict, held_out: bool = False) -> dict:
        """The cached reference log-probs of the batch's pairs as `ref_logps` [2B] (chosen, then rejected)."""
        if self.cached is None:
            return batch
        table = self.cached.val if held_out else self.cached.train
        idx = batch["pair_index"]
        return {**batch, "ref_logps": torch.cat([table[0][idx], table[1][idx]])}

    def _ref_logps(self, batch: dict) -> torch.Tensor | None:
        if "ref_logps" in batch:
            return batch["ref_logps"]
        if self.ref_model is None:
            return None
        with torch.no_grad():
            return response_logps(self.ref_model, batch, self.padding_free)

    def pair_terms(self, model, batch: dict):
        """(per-pair losses [B], metric sums over the batch's real pairs, each pair ranked right:
        implicit reward of chosen > rejected [B]) of one micro-batch."""
        c, keep = self.loss_cfg, batch["pair_mask"]
        logps, lengths, logit_sums = side_logps(model, batch, self.padding_free)
        ref = self._ref_logps(batch)
        b = keep.shape[0]
        lp_c, lp_r, len_c, len_r = logps[:b], logps[b:], lengths[:b], lengths[b:]
        ref_c, ref_r = (None, None) if ref is None else (ref[:b], ref[b:])
        per_pair = preference_loss(c.loss_type, lp_c, lp_r, ref_c, ref_r, len_c, len_r,
                                   loss_weights=c.loss_weights, beta=c.beta, label_smoothing=c.label_smoothing,
                                   discopop_tau=c.discopop_tau, simpo_gamma=c.simpo_gamma, pair_mask=keep)
        k = keep.bool()
        pick = (lambda x: None if x is None else x[k])  # noqa: E731 (padding pairs of eval count nothing)
        metrics = preference_metric_sums(lp_c[k], lp_r[k], pick(ref_c), pick(ref_r), c.beta,
                                         chosen_logit_sums=logit_sums[:b][k], rejected_logit_sums=logit_sums[b:][k],
                                         chosen_lengths=len_c[k], rejected_lengths=len_r[k])
        with torch.no_grad():
            rc, rr = implicit_rewards(lp_c, lp_r, ref_c, ref_r, c.beta)
        return per_pair, metrics, rc > rr

    def logit_positions(self, batch: dict) -> int:
        return int(batch["loss_mask"].sum())  # `side_logps`: the response tokens

    def loss(self, model, batch: dict):
        """Summed per-pair losses over the real pairs, their count, and TRL's metrics: per pair
        rewards/chosen|rejected (β(logp − ref_logp); β·logp reference-free), rewards/margins,
        rewards/accuracies (chosen strictly above), logps/chosen|rejected (summed); per response
        token logits/chosen|rejected (the mean logit over the vocabulary)."""
        per_pair, metrics, _ = self.pair_terms(model, batch)
        keep = batch["pair_mask"]
        return torch.where(keep, per_pair, torch.zeros((), device=per_pair.device)).sum(), keep.sum(), metrics

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        """Over every held-out pair (denominator `val_pairs`): val_loss (per pair) and the per-pair
        metrics prefixed val_, and val_rewards/accuracies/<group> per source and rejected_kind
        with its val_pairs/<group> (`group_figures`)."""
        names = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
                 "logps/rejected")
        sums: dict[str, torch.Tensor | float] = {"loss": 0.0, "n": 0.0}
        model.eval()
        for batch in self.eval_batches():
            with self.acc.autocast():
                per_pair, metrics, correct = self.pair_terms(model, batch)
            keep = batch["pair_mask"]
            self.add_group_sums(sums, batch, correct)
            sums["loss"] = sums["loss"] + per_pair[keep].double().sum().cpu()
            sums["n"] = sums["n"] + keep.sum().cpu()
            for name in names:
                sums[name] = sums.get(name, 0.0) + metrics[name][0].double().cpu()
        model.train()
        tot = all_reduce_sums(self.acc, sums)
        if tot["n"] == 0:
            raise SproutError(f"{self.val.path}: no held-out pairs to evaluate")
        return {"val_loss": tot["loss"] / tot["n"], **{f"val_{k}": tot[k] / tot["n"] for k in names},
                "val_pairs": tot["n"], **self.group_figures(tot, "val_rewards/accuracies")}


def run_dpo(cfg: DPOConfig, resume: str | None = None) -> dict:
    """Check inputs, load the policy (and the reference unless reference-free), resume if asked,
    train; returns fit's summary (sprout.engine.training_loop)."""
    check_ranges(cfg)  # a config built in Python (the scripts' from_dict has checked)
    check_dpo_options(cfg.dpo)
    run = open_preference_run(cfg, "dpo", resume)
    cfg, acc = run.cfg, run.accelerator
    policy = uninitialised(Transformer, run.model_config)  # the init checkpoint's weights, or the resumed run's
    if run.resume is None or not cfg.lora.off:  # a LoRA resume loads its adapters onto the base
        load_weights(policy, run.base["path"], run.base)
    lora = apply_lora(policy, cfg, run.base)
    ref_model, ref_path = None, None
    if needs_reference(cfg.dpo):
        ref_meta = read_meta(cfg.dpo.ref) if cfg.dpo.ref else run.base
        if ref_meta["model_config"] != run.base["model_config"] or ref_meta["architecture"] != "lm":
            raise SproutError(f"{ref_meta['path']}: dpo.ref must be an LM with the init checkpoint's model config")
        ref_path = ref_meta["path"]

        def frozen_copy():
            copy = uninitialised(Transformer, run.model_config)
            load_weights(copy, ref_path, ref_meta)
            return copy
        # a LoRA policy whose base is the reference: the policy with its adapters off
        ref_model, how = reference_model(policy, lora, frozen_copy,
                                         base_is_reference=ref_meta["files"] == run.base["files"])
        acc.print(f"dpo: reference {ref_path}" + (" (log-probs precomputed)" if cfg.dpo.precompute_ref_logps
                                                 else f" ({how})"))
    stage = DPOStage(acc, run.loader, run.val, run.accum_steps, cfg.dpo, ref_model, ref_path,
                     run.tokenizer.fingerprint(), pair_groups(run.val_path, run.val), **run.batching())
    del ref_model  # the stage holds it (and frees it once its log-probs are precomputed)
    frozen = {"reference": frozen_model_record(ref_meta)} if ref_path is not None else {}
    meta = {**run.provenance(), **frozen_models_meta(lora, **frozen)}
    return train_stage(acc, policy, stage, cfg, resume=run.resume, tokenizer=run.tokenizer.spec,
                       micro_steps=None if cfg.batch.micro_batch_tokens else run.accum_steps, extra_meta=meta)
