"""The training engine: the one loop every stage runs on. It never imports a stage.

    stage.py      the Stage protocol: what a stage gives the loop (batches, loss, metrics
                  with their counts, targets, tokens, FLOPs, parameter groups, frozen models)
    loop.py       Trainer: accumulate, normalise over global targets, clip, schedule,
                  checkpoint, resume (accelerate: 1 process, DDP, FSDP); frozen models
    fit.py        the outer loop: Trainer.step repeated, with the callbacks around it
    callbacks.py  what happens around the steps, one job each: training records with
                  throughput and MFU, eval and checkpoint cadence, stop signals, samples,
                  loss.png and report.md
    configs.py    the config sections every stage shares (optim, train, a token batch) and
                  StageConfig, the base of a stage's config; no torch
    optim.py      AdamW over parameter groups, the lr schedule applied to each group
    schedule.py   lr (warmup + cosine/WSD), sequence-length warmup, Chinchilla budget
    metrics.py    metrics.jsonl, trackers, MFU, loss-curve PNG
    report.py     report.md at the end of a run
    run_args.py   a training script's command line, its config (fresh or resumed) and its
                  run folder (checks, lock, --overwrite); no torch, so --help never loads it
    run.py        what every stage does around the loop once its config is resolved
                  (accelerator, run length, optimizer, resume, config.yaml, fit)
    fsdp.py       FSDP2 on CPU, optimizer state between layouts
"""
