"""Every stage's config: the sections the stages read and the config each trainer parses (a
`sprout.engine.configs.StageConfig`: its own sections, then optim, train and out). No torch, so
a trainer's --help and its config and resume checks run without loading it; each stage's module
(`sprout.stages.pretrain`, `sft`, `reward`, `dpo`, `ppo`, `grpo`) explains its options.

    PretrainConfig  model, data (token shards), batch (tokens)
    SFTConfig       init, data (packed rows), batch (tokens), sample_prompts
    RewardConfig    init, data (pairs), batch (pairs), reward
    DPOConfig       init, data (pairs), batch (pairs), dpo
    PPOConfig       init, reward_model, data (prompts), batch, rollout, rewards, ppo
    GRPOConfig      init, data (prompts), batch, rollout, rewards, grpo

The RL stages' `rewards` section is `sprout.stages.rl_rewards.RewardsConfig`, beside the reward
functions it names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sprout.config import HASHED_WHEN_SET, RESUME_FREE, require, resume_free
from sprout.ranges import in_range
from sprout.losses.loss_types import CLIPPED_LOSS_TYPES, PREFERENCE_LOSS_TYPES
from sprout.model.config import ModelConfig
from sprout.engine.configs import LoraConfig, OptimConfig, StageConfig, TokenBatchConfig, TrainConfig
from sprout.stages.rl_rewards import RewardsConfig


# ---- pretraining --------------------------------------------------------------------------------
@dataclass
class TokenDataConfig:
    dir: str = resume_free("")     # the prep's folder (*_train_*.bin, *_val_*.bin, manifest.json) or a file of it
    tokenizer: str | None = None   # tokenizer spec for bits per byte; default: the data manifest's
    sampler: Literal["sequential", "random"] = "sequential"  # per-rank spans | nanoGPT random windows
    seq_len: int | None = in_range(None, "[1, inf)")  # None: model.max_seq_len
    seq_len_start: int = in_range(128, "[1, inf)")  # sequence-length warmup: start here, double up to seq_len ...
    seq_warmup_frac: float = in_range(0.1, "[0, 1]")  # ... over this fraction of the steps (0 disables)
    # val tokens scored at each eval (the first ones of the val split)
    eval_tokens: int = in_range(262144, "[1, inf)", metadata=RESUME_FREE)
    verify: Literal["full", "sizes"] = resume_free("full")  # start-up check: full (sha256 of every file) | sizes (skip the hashes)


@dataclass
class PretrainConfig(StageConfig, stage="pretrain", out="runs/pretrain"):
    model: ModelConfig = field(default_factory=ModelConfig)  # the transformer's shape
    data: TokenDataConfig = field(default_factory=TokenDataConfig)  # token shards, sampling and eval
    batch: TokenBatchConfig = field(default_factory=TokenBatchConfig)


# ---- supervised fine-tuning ---------------------------------------------------------------------
@dataclass
class SFTRowsConfig:
    # Paths may change on resume (the loader checks the row count and global batch), and the
    # epochs, which only set max_steps.
    path: str = resume_free("")   # packed rows from scripts/prepare_sft_data.py: its folder, or a file of it (sft.h5)
    val_path: str | None = resume_free(None)  # None: the `_val` file beside the train file (sft_val.h5)
    epochs: float = in_range(1.0, "(0, inf)", metadata=RESUME_FREE)  # sets train.max_steps when that is null
    verify: Literal["full", "sizes"] = resume_free("full")  # start-up check: full (sha256 of every dataset) | sizes (skip the hashes)


SAMPLE_PROMPTS = ("Name three colours.", "What is 12 plus 7?", "Write one sentence about the sea.")


@dataclass
class SFTConfig(StageConfig, stage="sft", out="runs/sft", optim=OptimConfig(lr=3e-5, warmup_steps=10, weight_decay=0.0),
                train=TrainConfig(eval_every=50, ckpt_every=100)):
    init: str = resume_free("")   # base checkpoint: a checkpoint dir, its checkpoints/ folder or its run dir
    data: SFTRowsConfig = field(default_factory=SFTRowsConfig)  # packed SFT rows and epochs
    batch: TokenBatchConfig = field(default_factory=lambda: TokenBatchConfig(global_tokens=65536, micro_tokens=8192))
    # Answered greedily at the end of training and shown in report.md ([] for none).
    sample_prompts: list = resume_free(default_factory=lambda: list(SAMPLE_PROMPTS))
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters instead of full fine-tuning (r > 0)


# ---- the preference stages: reward model and DPO ------------------------------------------------
@dataclass
class PairBatchConfig:
    """The batch of the preference stages, in pairs (each pair is two rows: chosen and rejected)."""
    global_pairs: int = in_range(64, "[1, inf)")  # per optimizer step, all processes together
    micro_pairs: int = in_range(8, "[1, inf)")    # per forward/backward on one process (2 × micro_pairs rows)
    # each micro-batch's sides packed into rows without padding, attention and positions per side (TRL's
    # padding_free; sprout.stages.packing): the same loss and gradients, no padding computed
    padding_free: bool = resume_free(False)
    # > 0: a micro-batch also ends before it would pass this many tokens (rows × width; padding_free: its
    # sides' tokens); at least 2 × data.seq_len, so a pair always fits; 0: micro_pairs pairs each
    micro_batch_tokens: int = in_range(0, "[0, inf)", metadata=HASHED_WHEN_SET)


@dataclass
class PairDataConfig:
    """The preference pairs: the train file, its held-out file, their length limit and checks."""
    # Paths may change on resume (the loader checks the pair count and global batch), and the
    # epochs, which only set max_steps.
    path: str = resume_free("")         # the preference prep's folder, or a file of it (preferences.jsonl)
    val_path: str | None = resume_free(None)  # None: preferences_dev.jsonl (<name>_dev.jsonl) beside the train file
    seq_len: int | None = in_range(None, "[2, inf)")  # longest side in tokens; None: the model's max_seq_len
    truncation: str = "drop"            # drop | keep_end (shorten the prompt; see formats.preference_tokens)
    epochs: float = in_range(1.0, "(0, inf)", metadata=RESUME_FREE)  # sets train.max_steps when that is null
    # start-up check against the prep's manifest.json: full (listed, and the sha256 of both
    # files) | sizes (listed only, no hashing)
    verify: Literal["full", "sizes"] = resume_free("full")


@dataclass
class RewardLossConfig:
    """How the reward model scores a response, and its loss's options (TRL's RewardConfig names)."""
    # head: a score head read at the response's eot; logprob: β × the LM's summed log-prob of the response
    score: Literal["head", "logprob"] = "head"
    beta: float = in_range(0.1, "(0, inf)")  # β of score logprob (DPO's β, no reference)
    center_rewards_coefficient: float = in_range(0.0, "[0, inf)")  # TRL's RewardConfig; 0.01 is its suggested value
    use_margin: bool = True             # subtract each record's margin (Llama 2); false: ignore margins

    def __post_init__(self) -> None:
        require(self.score == "head" or not self.center_rewards_coefficient, "center_rewards_coefficient",
                self.center_rewards_coefficient, "0 with score logprob (a log-probability score is at most 0; "
                "the term would act as an NLL term, not centre the scores)")
        require(self.score == "logprob" or self.beta == 0.1, "beta", self.beta,
                "0.1 with score head (beta scales a logprob score; a score head learns its own scale)")


@dataclass
class RewardConfig(StageConfig, stage="reward", out="runs/reward",
                   optim=OptimConfig(lr=1e-5, warmup_steps=10, weight_decay=0.0),
                   train=TrainConfig(eval_every=50, ckpt_every=100)):
    init: str = resume_free("")         # the LM checkpoint to start from (an SFT run dir or checkpoint)
    data: PairDataConfig = field(default_factory=PairDataConfig)
    batch: PairBatchConfig = field(default_factory=PairBatchConfig)
    reward: RewardLossConfig = field(default_factory=RewardLossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters instead of full fine-tuning (r > 0)


@dataclass
class DPOLossConfig:
    """TRL's DPOConfig names; each loss is in sprout.losses.dpo or sprout.losses.preference."""
    loss_type: str | list = field(default="sigmoid", metadata={
        "help": "a name or a list of: " + ", ".join(PREFERENCE_LOSS_TYPES) + " (TRL's names)"})
    loss_weights: list | None = None    # one weight per loss_type; None: 1.0 each
    beta: float = in_range(0.1, "(0, inf)")  # β of every variant (ORPO's λ)
    label_smoothing: float = in_range(0.0, "[0, 0.5]")  # ε of robust, exo_pair, aot, aot_unpaired (TRL's range)
    simpo_gamma: float = in_range(0.5, "[0, inf)")  # SimPO's target reward margin γ
    discopop_tau: float = in_range(0.05, "(0, inf)")  # DiscoPOP's temperature τ
    ref: str = ""                       # reference checkpoint; "": the init checkpoint
    precompute_ref_logps: bool = False  # reference log-probs computed once and cached beside the data


@dataclass
class DPOConfig(StageConfig, stage="dpo", out="runs/dpo", optim=OptimConfig(lr=5e-7, warmup_steps=10, weight_decay=0.0),
                train=TrainConfig(eval_every=50, ckpt_every=100)):
    init: str = resume_free("")         # the LM checkpoint to start from (an SFT run dir or checkpoint)
    data: PairDataConfig = field(default_factory=PairDataConfig)
    batch: PairBatchConfig = field(default_factory=PairBatchConfig)
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters instead of full fine-tuning (r > 0)


# ---- the RL stages: PPO and GRPO ----------------------------------------------------------------
@dataclass
class PromptBatchConfig:
    """The batch of the RL stages: prompts per optimizer step and completions per prompt."""
    global_prompts: int = in_range(16, "[1, inf)")  # prompts per generation batch, all processes together
    num_generations: int = in_range(8, "[2, inf)")  # G completions per prompt (a group; all on the prompt's rank)
    micro_completions: int = in_range(16, "[1, inf)")  # completions per forward/backward on one process
    # each micro-batch's prompt + completion sequences packed into rows without padding, attention and
    # positions per sequence (TRL's padding_free; sprout.stages.packing): the same loss and gradients
    padding_free: bool = resume_free(False)
    # > 0: a micro-batch also ends before it would pass this many tokens (rows × width; padding_free: its
    # sequences' tokens); at least data.max_prompt_length + rollout.max_completion_length; 0: micro_completions each
    micro_batch_tokens: int = in_range(0, "[0, inf)", metadata=HASHED_WHEN_SET)


@dataclass
class RLDataConfig:
    """The RL prompts: the train file, its held-out file and the held-out evaluation's size."""
    path: str = resume_free("")         # scripts/prepare_rl_prompts.py's folder, or a file of it (prompts.jsonl)
    val_path: str | None = resume_free(None)  # None: prompts_dev.jsonl beside the train file
    max_prompt_length: int = in_range(512, "[1, inf)")  # longer prompts (rendered, in tokens) are dropped and counted
    sources: list | None = None         # keep only the prompts of these sources (both files); None: all
    # held-out prompts per eval (the file's first; 0: all)
    eval_prompts: int = in_range(256, "[0, inf)", metadata=RESUME_FREE)
    eval_batch: int = in_range(32, "[1, inf)", metadata=RESUME_FREE)  # prompts per generation call in eval
    # sampled answers per held-out prompt (pass@1, pass@n); 0: greedy only
    eval_num_generations: int = in_range(4, "[0, inf)", metadata=RESUME_FREE)
    epochs: float = in_range(1.0, "(0, inf)", metadata=RESUME_FREE)  # sets train.max_steps when that is null
    # start-up check against the prep's manifest.json: full (listed, and the sha256 of both
    # files) | sizes (listed only, no hashing)
    verify: Literal["full", "sizes"] = resume_free("full")


@dataclass
class RolloutConfig:
    """How completions are sampled from the policy, and by which engine."""
    # new tokens per completion (a row without a stop id is truncated)
    max_completion_length: int = in_range(256, "[1, inf)")
    # 1 with no top-k/top-p: the sampler's distribution is the policy's
    temperature: float = in_range(1.0, "(0, inf)")
    top_k: int | None = in_range(None, "[1, inf)")  # sample among the k likeliest tokens; None: all
    top_p: float | None = in_range(None, "(0, 1]")  # sample within this probability mass (nucleus); None: all
    compile: bool = resume_free(False)  # compile sprout's decode step (single process only; model/generate.py)
    # sprout's decode step on fixed-shape buffers, replayed as a CUDA graph (model/static_decode.py); auto:
    # on CUDA; never with several processes (an FSDP forward gathers sharded weights: a collective)
    cuda_graph: bool | Literal["auto"] = resume_free("auto")
    # sprout: sprout's own decode on the live policy; vllm: vLLM in this process, one GPU, its copy of the
    # weights refreshed after every optimizer step (installed apart: docs/gpus.md); either way the loss
    # recomputes every log-prob (sprout.stages.rollout_engine)
    engine: Literal["sprout", "vllm"] = resume_free("sprout")
    # engine vllm: the share of the GPU's memory vLLM takes (TRL's vllm_gpu_memory_utilization)
    vllm_gpu_memory_utilization: float = in_range(0.3, "(0, 1]", metadata=RESUME_FREE)
    # engine vllm: free its weights and KV cache between generations (TRL's vllm_enable_sleep_mode)
    vllm_enable_sleep_mode: bool = resume_free(False)
    # consecutive steps whose every completion is out of the loss (truncated and masked: loss 0, no
    # gradient) before the run stops; the first such step is warned about
    max_all_masked_steps: int = in_range(5, "[1, inf)", metadata=RESUME_FREE)


@dataclass
class PPOBatchConfig(PromptBatchConfig):
    """The RL batch with PPO's defaults: one completion per prompt, and mini-batches."""
    num_generations: int = in_range(1, "[1, inf)")  # completions per prompt (PPO needs no groups)
    num_mini_batches: int = in_range(1, "[1, inf)")  # optimizer steps per pass over a generation batch (TRL's)


@dataclass
class PPOLossConfig:
    """TRL's PPOConfig names where it has them (module doc)."""
    reward_model_weight: float = in_range(1.0, "[0, inf)")  # weight of the reward model's score (with a reward_model)
    missing_eos: Literal["penalty", "zero"] = "penalty"  # a completion without end-of-turn: penalised or scored 0
    missing_eos_penalty: float = in_range(1.0, "[0, inf)")  # subtracted from its score (missing_eos: penalty)
    kl_coef: float = in_range(0.05, "[0, inf)")  # KL weight (the adaptive controller's initial value)
    kl_estimator: Literal["k1", "k3"] = "k1"  # per-token KL (r = ref / policy): k1 -log r, k3 r - 1 - log r
    kl_in: Literal["reward", "loss"] = "reward"  # the KL penalty subtracted from the rewards, or added to the loss
    adaptive_kl: bool = False           # steer kl_coef towards target_kl (Ziegler et al. 2019)
    target_kl: float = in_range(6.0, "(0, inf)")  # objective/kl the adaptive controller aims at (nats per sequence)
    horizon: int = in_range(10000, "[1, inf)")  # the adaptive controller's horizon, in completions
    gamma: float = in_range(1.0, "[0, 1]")  # GAE discount
    lam: float = in_range(0.95, "[0, 1]")   # GAE lambda
    whiten_rewards: bool = False        # whiten the token rewards (mean kept) before GAE
    cliprange: float = in_range(0.2, "(0, 1)")  # the policy ratio is clipped to [1 - cliprange, 1 + cliprange]
    # c (3 in Ye et al. 2020): a negative advantage's loss is at most -c A
    dual_clip: float | None = in_range(None, "(1, inf)")
    vf_coef: float = in_range(0.1, "[0, inf)")  # weight of the value loss
    cliprange_value: float = in_range(0.2, "[0, inf)")  # value clip around the old values
    entropy_coef: float = in_range(0.0, "[0, inf)")  # entropy bonus
    num_ppo_epochs: int = in_range(4, "[1, inf)")  # passes over each generation batch
    value_init: Literal["policy", "reward"] = "policy"  # value head: fresh, or the reward model's score head
    value_lr: float | None = in_range(None, "(0, inf)")  # the value head's peak lr; None: optim.lr × vf_lr_scale
    vf_lr_scale: float = in_range(1.0, "(0, inf)")  # the value head's lr as a multiple of optim.lr
    # the first N optimizer steps train the value head alone (value loss only, the policy's lr held at 0)
    value_warmup_steps: int = in_range(0, "[0, inf)", metadata=HASHED_WHEN_SET)


@dataclass
class PPOConfig(StageConfig, stage="ppo", out="runs/ppo", optim=OptimConfig(lr=1e-6, warmup_steps=0, weight_decay=0.0),
                train=TrainConfig(eval_every=50, ckpt_every=50)):
    init: str = resume_free("")         # the policy to start from (an SFT run dir or checkpoint); also the reference
    reward_model: str = resume_free("")  # a reward model run (scripts/train_reward.py); "" = verifiers only
    data: RLDataConfig = field(default_factory=RLDataConfig)
    batch: PPOBatchConfig = field(default_factory=PPOBatchConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    ppo: PPOLossConfig = field(default_factory=PPOLossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters instead of full fine-tuning (r > 0)


@dataclass
class GRPOLossConfig:
    """TRL's GRPOConfig names where it has them; see sprout.losses.policy and sprout.rl.advantages."""
    # a reward minus its group's mean (grpo; dr_grpo: never divided by a std) or the others' mean (rloo)
    advantage: Literal["grpo", "rloo", "dr_grpo"] = "grpo"
    # the std the advantages divide by (TRL's true: group, false: none); null: the advantage's (grpo: group)
    scale_rewards: Literal["group", "batch", "none"] | bool | None = None
    # sum_then_normalize: weighted sum of the reward functions, then the group statistics; normalize_then_sum
    # (advantage grpo): each function normalised within its group, summed, then normalised over the global batch
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    # TRL's RLOO option: advantages normalised to mean 0, std 1 over the global batch (not with dr_grpo)
    normalize_advantages: bool = False
    # the surrogate and its normaliser: clipped ratio for grpo (sequence means), bnpo and dapo (tokens),
    # dr_grpo (sequences × max_completion_length); cispo: capped stop-gradient weight × log-prob (tokens);
    # sapo: sigmoid-gated soft clip (sequence means)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = "dapo"
    epsilon: float = in_range(0.2, "(0, 1)")  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    # None: epsilon (clip-higher when larger); cispo: the cap on the importance weight itself (required; 5.0 in ScaleRL)
    epsilon_high: float | None = in_range(None, "(0, inf)")
    delta: float | None = in_range(None, "(1, inf)")  # two-sided clipping: the ratio is capped at delta
    # sapo's gate -(4/tau) sigmoid(tau (ratio - 1)) A: tau where the advantage is > 0
    sapo_temperature_pos: float = in_range(1.0, "(0, inf)")
    # sapo's tau where the advantage is <= 0 (larger: the gate closes faster off-policy)
    sapo_temperature_neg: float = in_range(1.05, "(0, inf)")
    # token; sequence (GSPO: the mean log-ratio); sequence_sum (TRL's RLOO: exp of the summed log-ratios);
    # unset or null: sequence_sum with advantage rloo (TRL's RLOO), token otherwise
    importance_sampling_level: Literal["token", "sequence", "sequence_sum"] | None = None
    num_iterations: int = in_range(1, "[1, inf)")  # μ: optimizer steps per generation batch
    beta: float = in_range(0.0, "[0, inf)")  # KL weight; 0: no reference model at all
    # the per-token KL (sprout.rl.kl; r = ref / policy): k1 -log r, k2 (log r)² / 2, k3 r - 1 - log r
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"  # the KL added to the loss, or subtracted from the rewards
    # kl_in loss, beta > 0: the per-token KL × the importance ratio (TRL's default, true), so its
    # gradient is the reverse KL's; the ratio carries a gradient, so even on-policy the KL gradient differs
    use_bias_correction_kl: bool = True
    mask_truncated_completions: bool = False  # a completion cut at max_completion_length leaves the loss (TRL's)
    dynamic_sampling: bool = False      # drop groups whose rewards all agree, generate more
    max_generation_rounds: int = in_range(4, "[1, inf)")  # rounds of generation per batch with dynamic_sampling
    entropy_coef: float = in_range(0.0, "[0, inf)")  # entropy bonus

    def __post_init__(self) -> None:
        given = self.scale_rewards
        if isinstance(given, bool):  # TRL's booleans
            self.scale_rewards = "group" if given else "none"
        require(self.scale_rewards in (None, "group", "batch", "none"), "scale_rewards", given,
                "group, batch, none, true, false or null")
        require(self.advantage != "dr_grpo" or self.scale_rewards in (None, "none"), "scale_rewards", given,
                "none, false or null with advantage dr_grpo")
        if self.importance_sampling_level is None:
            self.importance_sampling_level = "sequence_sum" if self.advantage == "rloo" else "token"
        require(not self.normalize_advantages or self.advantage != "dr_grpo", "normalize_advantages", True,
                "false with advantage dr_grpo (it divides by no std)")
        if self.multi_objective_aggregation == "normalize_then_sum":
            require(self.advantage == "grpo", "multi_objective_aggregation", self.multi_objective_aggregation,
                    f"sum_then_normalize with advantage {self.advantage} (normalize_then_sum is GRPO's)")
            require(self.scale_rewards is None, "scale_rewards", given, "null with normalize_then_sum "
                    "(it scales each reward function within its group and their sum over the global batch)")
            require(self.kl_in == "loss" or self.beta == 0, "kl_in", self.kl_in,
                    "loss with normalize_then_sum (a KL in the reward is no reward function to normalise)")
        require(self.loss_type != "cispo" or self.epsilon_high is not None, "epsilon_high", self.epsilon_high,
                "a number with loss_type cispo: the cap on the importance weight (e.g. 5.0)")
        require(self.delta is None or self.loss_type in CLIPPED_LOSS_TYPES, "delta", self.delta,
                f"null with loss_type {self.loss_type} (delta bounds the clipped ratio of "
                f"{', '.join(CLIPPED_LOSS_TYPES)})")


@dataclass
class GRPOConfig(StageConfig, stage="grpo", out="runs/grpo",
                 optim=OptimConfig(lr=1e-6, warmup_steps=0, weight_decay=0.0),
                 train=TrainConfig(eval_every=50, ckpt_every=50)):
    init: str = resume_free("")         # the policy to start from (an SFT run dir or checkpoint); also the reference
    data: RLDataConfig = field(default_factory=RLDataConfig)
    batch: PromptBatchConfig = field(default_factory=PromptBatchConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    grpo: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters instead of full fine-tuning (r > 0)
