"""The loss variants by name: no torch, so a config and a trainer's --help list them without
loading the maths (`sprout.losses.preference` and `sprout.losses.dpo` for the preference
losses, `sprout.losses.policy` for the policy losses).
"""

from __future__ import annotations

# preference losses: TRL's DPOConfig.loss_type names, combined with loss_weights
PREFERENCE_LOSS_TYPES = (
    "sigmoid", "sigmoid_norm", "hinge", "ipo", "robust", "exo_pair", "bco_pair", "nca_pair", "sppo_hard",
    "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "simpo", "orpo",
)
REFERENCE_FREE = frozenset({"sft", "simpo", "orpo"})  # need no reference log-probs
BATCH_COUPLED = frozenset({"aot", "aot_unpaired"})  # sort over the batch: entry k is a sorted position, not pair k

# policy losses: GRPO's loss_type and importance_sampling_level
POLICY_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # clipped_surrogate; cispo and sapo have their own
SEQUENCE_MEAN_LOSS_TYPES = ("grpo", "sapo")  # each sequence's token mean, then the mean over sequences
IMPORTANCE_SAMPLING = ("token", "sequence", "sequence_sum")
