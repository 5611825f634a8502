"""The one training loop shared by every stage, and the stages built on it.

    loop.py      Trainer: accumulate, normalise over global targets, clip, schedule, log,
                 checkpoint, resume (accelerate: 1 process, DDP, FSDP)
    schedule.py  lr (warmup + cosine/WSD), sequence-length warmup, Chinchilla budget
    metrics.py   metrics.jsonl, trackers, MFU, loss-curve PNG
    pretrain.py  the pretraining stage and `run_pretrain`
"""

from sprout.train.loop import NonFiniteLoss, Stage, TrainConfig, Trainer, all_reduce_sums, count_targets

__all__ = ["NonFiniteLoss", "Stage", "TrainConfig", "Trainer", "all_reduce_sums", "count_targets"]
