"""The training engine: the one loop every stage runs on. It never imports a stage.

    stage.py      the Stage protocol: what a stage gives the loop (batches, loss, metrics
                  with their counts, targets, tokens, FLOPs, parameter groups, frozen models)
    loop.py       Trainer: accumulate, normalise over global targets, clip, schedule,
                  checkpoint, resume (accelerate: 1 process, DDP, FSDP); frozen models
    fit.py        the outer loop: Trainer.step repeated, with the callbacks around it
    callbacks.py  what happens around the steps, one job each: training records with
                  throughput and MFU, eval and checkpoint cadence, stop signals, samples,
                  loss.png and report.md
    optim.py      AdamW over parameter groups, the lr schedule applied to each group
    schedule.py   lr (warmup + cosine/WSD), sequence-length warmup, Chinchilla budget
    metrics.py    metrics.jsonl, trackers, MFU, loss-curve PNG
    report.py     report.md at the end of a run
    run.py        what every stage's script does around the loop (run folder, config,
                  resume, fit)
    fsdp.py       FSDP2 on CPU, optimizer state between layouts
"""
