"""The training stages, one module per algorithm (pretrain, sft, reward, dpo, ppo, grpo), on the
bases they share (`preference_stage` for the reward model and DPO, with DPO's cached
`reference_logps`; `rl_stage` for PPO and GRPO, with the reward functions of `rl_rewards`). A
stage gives the engine (`sprout.engine`) its batches, its loss and its metrics; the loop is
never copied here. Every stage's config is in `configs`, which imports no torch, so a
trainer parses its command line (and prints its --help) before loading it.
"""
