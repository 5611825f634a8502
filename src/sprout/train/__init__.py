"""The one training loop shared by every stage, and the stages built on it.

    loop.py      the Stage protocol and Trainer: accumulate, normalise over global targets,
                 clip, schedule, log, checkpoint, resume (accelerate: 1 process, DDP, FSDP);
                 frozen models; the optimizer, training and batch configs
    run.py       what every stage's script does around the loop (config, resume, fit)
    schedule.py  lr (warmup + cosine/WSD), sequence-length warmup, Chinchilla budget
    metrics.py   metrics.jsonl, trackers, MFU, loss-curve PNG
    report.py    report.md at the end of a run
    fsdp.py      FSDP2 on CPU, optimizer state between layouts
    pretrain.py  the pretraining stage and `run_pretrain`
    sft.py       the SFT stage and `run_sft`
"""

from sprout.train.loop import (
    NonFiniteLoss,
    OptimConfig,
    Stage,
    TokenBatchConfig,
    TokenStage,
    TrainConfig,
    Trainer,
    all_reduce_sums,
)

__all__ = ["NonFiniteLoss", "OptimConfig", "Stage", "TokenBatchConfig", "TokenStage", "TrainConfig", "Trainer",
           "all_reduce_sums"]
