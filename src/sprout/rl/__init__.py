"""RL building blocks the PPO and GRPO stages share: pure functions and small classes, no
model and no training loop.

    verifiers.py   reward functions on reasoning answers (correctness, format, overlong),
                   TRL's fn(completions, **columns) convention, their weighted sum and metrics
    advantages.py  group-relative advantages (GRPO, RLOO, Dr. GRPO; sum- or normalise-first
                   over reward functions), PPO's per-token rewards, GAE and whitening
    kl.py          per-token KL estimators k1, k2, k3 and the fixed and adaptive KL controllers
"""
