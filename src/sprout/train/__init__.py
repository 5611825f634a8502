"""The one training loop shared by every stage, and the stages built on it.

    stage.py     the Stage protocol: what a stage gives the loop (batches, loss, metrics
                 with their counts, targets, tokens, FLOPs, parameter groups, frozen models)
    loop.py      Trainer: accumulate, normalise over global targets, clip, schedule,
                 checkpoint, resume (accelerate: 1 process, DDP, FSDP); frozen models
    fit.py       the outer loop that Trainer.fit runs: training records, eval and checkpoint
                 cadence, a clean stop on Ctrl-C or SIGTERM, loss.png and report.md
    optim.py     AdamW over parameter groups, the lr schedule applied to each group
    run.py       what every stage's script does around the loop (config, resume, fit)
    schedule.py  lr (warmup + cosine/WSD), sequence-length warmup, Chinchilla budget
    metrics.py   metrics.jsonl, trackers, MFU, loss-curve PNG
    report.py    report.md at the end of a run
    fsdp.py      FSDP2 on CPU, optimizer state between layouts
    pretrain.py  the pretraining stage and `run_pretrain`
    sft.py       the SFT stage and `run_sft`
"""

from sprout.train.loop import NonFiniteLoss, TrainConfig, Trainer, all_reduce_sums
from sprout.train.optim import OptimConfig
from sprout.train.stage import Stage, TokenBatchConfig, TokenStage

__all__ = ["NonFiniteLoss", "OptimConfig", "Stage", "TokenBatchConfig", "TokenStage", "TrainConfig", "Trainer",
           "all_reduce_sums"]
