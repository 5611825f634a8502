"""The config sections every stage shares, and the base of a stage's config; no torch, so a
trainer's --help and its config checks run without loading it.

    OptimConfig       AdamW and its lr schedule (`sprout.engine.optim`)
    TrainConfig       run length, precision, seed, cadence of logs, eval and checkpoints
                      (`sprout.engine.trainer`)
    TokenBatchConfig  the batch of the token stages (pretraining, SFT), in tokens
    LoraConfig        LoRA adapters of the post-training stages (`sprout.model.lora`); r 0: full fine-tuning
    StageConfig       what every stage's config ends with: optim, train and out
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from sprout.config import RESUME_FREE, require, resume_free
from sprout.ranges import SEED_RANGE, in_range


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (`sprout.engine.schedule`)."""
    lr: float = in_range(6e-4, "(0, inf)")  # peak lr; a stage's parameter groups may scale it
    min_lr_ratio: float = in_range(0.1, "[0, 1]")  # the lr decays to lr × min_lr_ratio
    warmup_steps: int = in_range(100, "[0, inf)")  # steps of linear warmup up to lr
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # shape after warmup (wsd: warmup-stable-decay)
    wsd_decay_frac: float = in_range(0.2, "[0, 1]")  # wsd: fraction of the steps in the final linear decay
    weight_decay: float = in_range(0.1, "[0, inf)")  # on matrices (ndim >= 2) only
    beta1: float = in_range(0.9, "[0, 1)")   # AdamW's first-moment decay
    beta2: float = in_range(0.95, "[0, 1)")  # AdamW's second-moment decay
    eps: float = in_range(1e-8, "(0, inf)")  # AdamW's denominator epsilon
    grad_clip: float = in_range(1.0, "[0, inf)")  # 0 disables clipping (the norm is still logged)


@dataclass
class TrainConfig:
    """Run length, precision, seed and cadence of logging, eval and checkpoints. The fields
    declared `resume_free` may change when a run is resumed."""
    # null / auto: the stage decides (pretraining: the Chinchilla budget; SFT and preference stages: data.epochs)
    max_steps: int | Literal["auto"] | None = in_range(None, "[1, inf)", metadata=RESUME_FREE)
    chinchilla_ratio: float = in_range(20.0, "(0, inf)", metadata=RESUME_FREE)  # tokens per parameter for that budget
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"  # auto: bf16 on a GPU, fp32 on CPU
    compile: bool = resume_free(False)  # torch.compile the model's forward
    # recompute each transformer block in backward instead of keeping its activations: less memory, more time
    gradient_checkpointing: bool = resume_free(False)
    # torch threads per process on CPU; 0: torch's default
    cpu_threads: int = in_range(0, "[0, inf)", metadata=RESUME_FREE)
    seed: int = in_range(1337, SEED_RANGE)  # initial weights, data order, dropout: every process alike
    # steps between training records (metrics.jsonl, log line)
    log_every: int = in_range(10, "[1, inf)", metadata=RESUME_FREE)
    eval_every: int = in_range(100, "[0, inf)", metadata=RESUME_FREE)  # 0: eval only before and after training
    ckpt_every: int = in_range(100, "[0, inf)", metadata=RESUME_FREE)  # 0: checkpoint only at the end
    keep_checkpoints: int = in_range(3, "[1, inf)", metadata=RESUME_FREE)  # newest checkpoints kept in <out>/checkpoints
    progress: bool = resume_free(True)  # tqdm bar on rank 0
    trackers: list[Literal["tensorboard", "wandb"]] = resume_free(default_factory=list)  # also log to these
    # peak per process for MFU; 0: measured at start (~0.5 s); < 0: no MFU
    peak_tflops: float = in_range(0.0, "(-inf, inf)", metadata=RESUME_FREE)

    def __post_init__(self) -> None:
        if self.max_steps == "auto":
            self.max_steps = None


@dataclass
class TokenBatchConfig:
    """The batch of the token stages (pretraining, SFT), in tokens (rows × row length)."""
    global_tokens: int = in_range(524288, "[1, inf)")  # per optimizer step, all processes together
    micro_tokens: int = in_range(16384, "[1, inf)")    # per forward/backward on one process


LORA_LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """LoRA adapters: peft's `LoraConfig` fields without their `lora_` prefix (TRL's `lora_r`,
    `lora_alpha`, ...): every targeted linear layer gains B A (A [r, in], B [out, r], B starting
    at 0), scaled by alpha / r (alpha / sqrt(r) with use_rslora), and only those and the model's
    scalar head train. r 0 trains every weight, and leaves the config hash as it was without this section."""
    r: int = in_range(0, "[0, inf)")  # adapter rank; 0: full fine-tuning
    alpha: float = in_range(32.0, "(0, inf)")  # scale numerator (peft's lora_alpha)
    dropout: float = in_range(0.0, "[0, 1)")  # on the adapters' input in training (peft's lora_dropout)
    # linear layers that gain adapters, by name: all-linear (attention and MLP) or some of
    # q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    use_rslora: bool = False  # scale alpha / sqrt(r) (rank-stabilised LoRA) instead of alpha / r

    @property
    def off(self) -> bool:
        """Full fine-tuning: no adapters, and no part of the resume config (`sprout.config.resume_config`)."""
        return self.r == 0

    def __post_init__(self) -> None:
        require(isinstance(self.target_modules, list) and len(self.target_modules) > 0
                and all(isinstance(t, str) for t in self.target_modules), "target_modules",
                self.target_modules, "a non-empty list of linear layer names, or [all-linear]")
        unknown = [t for t in self.target_modules if t != "all-linear" and t not in LORA_LINEAR_LAYERS]
        require(not unknown, "target_modules", unknown, f"all-linear or names of the model's linear layers "
                f"({', '.join(LORA_LINEAR_LAYERS)})")
        require("all-linear" not in self.target_modules or len(self.target_modules) == 1, "target_modules",
                self.target_modules, "[all-linear] alone, or a list of layer names without it")


RUN_FOLDER_HELP = "run folder: config.yaml, metrics, checkpoints, report"


class StageConfig:
    """What every stage's config ends with: `optim`, `train` and `out` (the run folder, which a
    resume may change), read by `sprout.engine.run_stage.train_stage`. A stage's config is a dataclass subclass that
    declares its own fields (init or model, data, batch, its loss section, ...) and gives its
    defaults for these three as class arguments:

        @dataclass
        class DPOConfig(StageConfig, stage="dpo", out="runs/dpo", optim=OptimConfig(lr=5e-7),
                        train=TrainConfig(eval_every=50)):

    They are added after the subclass's own fields (a dataclass base would put them first), so
    they come last in its YAML, its config.yaml and its --help. `stage` is the stage's name
    (`stage_name`): a resume refuses another stage's run by it."""

    optim: OptimConfig
    train: TrainConfig
    out: str
    stage_name = ""  # the stage's name, as its checkpoints record it (meta.json's `stage`)

    def __init_subclass__(cls, *, stage: str, out: str, optim: OptimConfig = OptimConfig(),
                          train: TrainConfig = TrainConfig(), **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.stage_name = stage
        cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}), "optim": OptimConfig,
                               "train": TrainConfig, "out": str}
        cls.optim = dataclasses.field(default_factory=functools.partial(copy.deepcopy, optim))
        cls.train = dataclasses.field(default_factory=functools.partial(copy.deepcopy, train))
        cls.out = dataclasses.field(default=out, metadata={**RESUME_FREE, "help": RUN_FOLDER_HELP})
