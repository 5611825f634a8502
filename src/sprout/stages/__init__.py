"""The training stages: each gives the engine (`sprout.engine`) its batches, loss and metrics;
the loop is never copied here.

    configs.py           every stage's config sections; no torch, so a trainer parses its
                         command line (and prints --help) before loading a stage
    pretrain.py          next-token prediction over token shards; val loss and bits per byte
    sft.py               masked next-token loss on packed chat rows
    preference_stage.py  what the reward model and DPO share: pair loaders, pairs as targets,
                         held-out groups, the run's checks
    reward.py            the reward model: a score head, or β × the summed log-probability
    reference_logps.py   DPO's reference log-probs, computed once and cached beside the data
    dpo.py               DPO and its variants against a live or cached reference
    preference_ranking.py  any checkpoint's ranking accuracy on a preference file, per
                         rejected_kind, by the stages' own scores (scripts/evaluate.py --preferences)
    rl_rewards.py        the RL stages' reward functions (built-in verifiers, module:function)
    rl_stage.py          what PPO and GRPO share: prompts, rollouts, the rollout buffer,
                         held-out eval
    rollout_engine.py    what generates the rollouts (rollout.engine): the interface, sprout's
                         own decode, the start-up check
    vllm_engine.py       rollout.engine vllm: vLLM colocated, loaded with the policy's weights
    ppo.py               PPO: a value head, a reward model and/or verifiers, KL, GAE
    grpo.py              GRPO and its variants (Dr. GRPO, DAPO, GSPO, RLOO, CISPO, SAPO)
"""
