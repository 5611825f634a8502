"""Loss maths: pure functions of tensors, returned as sums or per-item terms with their counts;
the trainer divides by the global batch's count. No module here imports a stage or the engine.

    loss_types.py  the loss variants by name (preference, policy); no torch, so configs and
                   --help list them without loading the maths
    tokens.py      cross-entropy sums with target counts, token accuracy and entropy sums,
                   per-sequence log-probs; a memory-light cross-entropy autograd Function
    dpo.py         DPO and its variants against a reference, per-pair losses [B]
    preference.py  the reward model's pairwise loss, reference-free terms (NLL, SimPO, ORPO),
                   the loss_type combinator and TRL's logged metrics as (sum, count)
    policy.py      PPO/GRPO per-token terms (clipped, CISPO, SAPO surrogates, KL, entropy,
                   value loss) and one normaliser per loss_type, exact over the global batch
"""
