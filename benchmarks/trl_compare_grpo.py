"""The GRPO rows of benchmarks/trl_compare.py: GRPOStage under sprout's loop against TRL's GRPOTrainer.

Both sides sample their own completions from the same prompts; the check takes TRL's first
optimizer step's micro-batches as TRL built them (prompt and completion ids, masks,
advantages), recorded during its training, and feeds them to sprout's loss and log-probs
(`grpo_check`), on the device and in the precision of the run (trl_compare_device.Precision).
"""

from __future__ import annotations

import numpy as np
import torch

from data_loader.prompt_batches import PromptLoader
from sprout.formats.prompts import write_prompts
from sprout.rl.verifiers import WeightedReward, correctness_reward
from sprout.stages.grpo import GRPOLossConfig, GRPOStage
from sprout.stages.rl_stage import PromptBatchConfig, RolloutConfig, completion_logps
from trl_compare_rows import Bench, Row, median, problems, user


def correctness(completions, gold, **_) -> list:
    """The reward of both GRPO runs: 1 when the completion's answer (its <answer> block, else
    its last number) equals the gold, else 0 (`sprout.rl.verifiers.correctness_reward`).
    TRL passes conversational completions as messages, sprout as text."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return correctness_reward(texts, gold, fallback_last_number=True)


def grpo(b: Bench) -> Row:
    """GRPOStage under sprout's loop against TRL's GRPOTrainer (transformers generate, no vLLM):
    the same prompts in the same order (no shuffling), G, completion length, temperature,
    loss_type, epsilon, epsilon_high, beta 0 (no reference model), batch (TRL: per_device_train_batch_size =
    micro_completions, gradient_accumulation_steps = prompts × G / micro_completions) and
    reward. Check: TRL's first optimizer step's micro-batches (prompt and completion ids,
    masks, advantages) and its loss on each are recorded during training; sprout's
    GRPOStage.loss on those same tensors, with its old log-probs from its own forward (TRL, at
    one step per generation batch, takes the current log-probs as the old ones) gives the
    loss compared; TRL's per-token log-probs of the completions against sprout's too."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    a = b.args
    P, G, M, L = a.prompts, a.generations, a.micro_completions, a.completion_length
    if P * G % M:
        raise SystemExit(f"error: --prompts {P} x --generations {G} is not a multiple of --micro-completions {M}")
    records = [{"id": f"p{i}", "source": "arithmetic", "prompt": user(p.question), "gold": p.gold, "level": p.level}
               for i, p in enumerate(problems((b.total_steps + 1) * P))]
    write_prompts(b.tmp / "prompts.jsonl", records)

    trainer = b.sprout_trainer(b.sprout_model(), 1e-6)
    loader = PromptLoader(b.tmp / "prompts.jsonl", b.tok, b.context - L, P, shuffle=False)
    stage = GRPOStage(trainer.accelerator, b.tok, loader, None, PromptBatchConfig(P, G, M),
                      RolloutConfig(max_completion_length=L, temperature=a.temperature),
                      [WeightedReward("correctness", correctness)],
                      grpo=GRPOLossConfig(loss_type=a.loss_type, epsilon=a.epsilon, epsilon_high=a.epsilon_high,
                                          beta=0.0), seed=0)
    stage.setup(trainer)
    lengths = []

    def step():
        lengths.append(trainer.step(stage.next_micro_batches(trainer.steps_done), stage)["completions/mean_length"])

    class RecordingGRPO(GRPOTrainer):
        """GRPOTrainer that keeps the first optimizer step's micro-batches, losses and log-probs."""
        first_step: list[dict] = []
        lengths: list[float] = []  # mean completion length of each generation batch

        def _generate(self, prompts):
            out = super()._generate(prompts)
            self.lengths.append(float(np.mean([len(ids) for ids in out[1]])))
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            if len(self.first_step) < self.args.gradient_accumulation_steps:
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
                with torch.no_grad():
                    logps = self._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].size(1))[0]
                self.first_step.append({**{k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)},
                                        "loss": float(loss), "logps": logps})
            return loss

    cfg = b.trl_config(GRPOConfig, "grpo", 1e-6, per_device_train_batch_size=M, gradient_accumulation_steps=P * G // M,
                       num_generations=G, max_completion_length=L, temperature=a.temperature, top_p=1.0, top_k=0,
                       loss_type=a.loss_type, epsilon=a.epsilon, epsilon_high=a.epsilon_high, beta=0.0,
                       shuffle_dataset=False)
    data = Dataset.from_list([{"prompt": r["prompt"], "gold": r["gold"]} for r in records])
    trl = RecordingGRPO(model=b.hf_model(), reward_funcs=[correctness], args=cfg, train_dataset=data,
                        processing_class=b.hf_tok, **b.trl_options())
    ours, theirs = b.time_side_by_side(trl, step)

    loss_ours, loss_theirs, logp_err = grpo_check(b, stage, trl.first_step)
    check = {"loss": abs(loss_ours - loss_theirs), "logps": logp_err}
    if b.lora is not None:  # the log-probs again with the same non-zero adapters on both sides
        check["adapted logps"] = grpo_adapted_logps(b, stage, trl)
    adv = torch.cat([c["advantages"] for c in trl.first_step])
    trl_lengths = trl.lengths
    return Row("GRPO step", "s", median(ours), median(theirs), median(theirs) / median(ours), 1.5, check,
               [f"{P} prompts x {G} completions of <= {L} tokens, micro-batch {M}, loss_type {a.loss_type}, "
                f"temperature {a.temperature}; each step generates, scores, computes log-probs and updates",
                f"mean completion length over the timed steps: sprout {np.mean(lengths[a.warmup:]):.1f}, "
                f"TRL {np.mean(trl_lengths[a.warmup:]):.1f} tokens (sampled: step times follow them)",
                f"first step's loss on TRL's tensors: sprout {loss_ours:.6f}, TRL {loss_theirs:.6f} "
                f"({int((adv != 0).sum())} of {len(adv)} completions with a non-zero advantage); largest |log-prob "
                f"difference| over its completion tokens {logp_err:.1e}",
                "old log-probs: " + ("taken from the loss's own forward at one optimizer step per generation "
                                     "batch, as TRL does" if stage.old_from_loss else
                                     "one extra no-grad forward per generation batch")],
               step, {"generation": (stage, "sample"), "rewards": (stage, "score"), "old log-probs": (stage, "logps_of"),
                      "loss forward": (stage, "loss"), "backward": (trainer.accelerator, "backward"),
                      "optimizer step": (trainer.optimizer, "step")})


def grpo_check(b: Bench, stage: GRPOStage, captured: list[dict]) -> tuple[float, float, float]:
    """(sprout's loss, TRL's loss, largest |log-prob difference|) on TRL's first step's micro-batches."""
    model = b.sprout_model()
    loss_sum, count, logp_err = 0.0, 0.0, 0.0
    for c in captured:
        batch = b.precision.to({k: c[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                                  "advantages")})
        batch["extra_target"] = torch.zeros(len(c["advantages"]), dtype=torch.long, device=b.precision.device)
        real = batch["completion_mask"].bool()
        with torch.no_grad(), b.precision.autocast():
            logps = completion_logps(model, batch, stage.rollout.temperature)[0]
            batch["old_logps"] = logps.masked_fill(~real, 0.0)
            s, n, _ = stage.loss(model, batch)
        loss_sum, count = loss_sum + float(s), count + float(n)
        logp_err = max(logp_err, float((logps.float() - c["logps"].float()).abs()[real].max()))
    return loss_sum / count, sum(c["loss"] for c in captured), logp_err


def grpo_adapted_logps(b: Bench, stage: GRPOStage, trl) -> float:
    """The largest |log-prob difference| over TRL's first step's completion tokens, TRL's
    model (after training) and a sprout model both holding the same non-zero adapters
    (`b.lora.same_adapters`): a LoRA row's check of the adapters' arithmetic."""
    model, err = b.sprout_model(), 0.0
    with b.lora.same_adapters(trl.model, model), torch.no_grad(), b.precision.autocast():
        for c in map(b.precision.to, trl.first_step):
            ids = torch.cat([c["prompt_ids"], c["completion_ids"]], dim=1)
            mask = torch.cat([c["prompt_mask"], c["completion_mask"]], dim=1)
            theirs = trl._get_per_token_logps_and_entropies(trl.model, ids, mask, c["completion_ids"].size(1))[0]
            ours = completion_logps(model, c, stage.rollout.temperature)[0]
            err = max(err, float((ours.float() - theirs.float()).abs()[c["completion_mask"].bool()].max()))
    return err
