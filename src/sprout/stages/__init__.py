"""The training stages, one module per algorithm (pretrain, sft, reward, dpo, ppo, grpo), each
with its config beside it, on the bases they share (`preference_stage` for the reward model
and DPO, with DPO's cached `reference_logps`; `rl_stage` for PPO and GRPO). A stage gives the
engine (`sprout.engine`) its batches, its loss and its metrics; the loop is never copied here.
"""
