"""The training stages, one module per algorithm, each with its config beside it.

    pretrain.py          next-token pretraining on token shards (`run_pretrain`)
    sft.py               supervised fine-tuning on packed chat rows with a loss mask (`run_sft`)
    preference_stage.py  what the reward model and DPO share: pair batches, held-out pairs
    reward.py            a Bradley-Terry reward model on preference pairs (`run_reward`)
    reference_logps.py   DPO's frozen reference log-probs, computed once and cached
    dpo.py               direct preference optimisation and its loss variants (`run_dpo`)
    rl_stage.py          what PPO and GRPO share: prompts, rollouts, rewards, evaluation
    ppo.py               PPO with a value head and GAE (`run_ppo`)
    grpo.py              GRPO with group-normalised advantages (`run_grpo`)

A stage gives the engine (`sprout.engine`) its batches, its loss and its metrics; the loop
itself is never copied here.
"""
