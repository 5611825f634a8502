"""The training engine: the one loop every stage runs on. It never imports a stage.

    stage.py          the Stage protocol: what a stage gives the loop (batches, loss, metrics with their counts)
    trainer.py        Trainer: one optimizer step (normalised over global targets), checkpoint, resume
    training_loop.py  fit: Trainer.step repeated, with the callbacks around it
    callbacks.py      around the steps, one job each: records, eval/checkpoint cadence, stop signals, report
    run_stage.py      what every stage does around the loop (accelerator, run length, optimizer, resume, fit)
    cli.py            a training script's command line, its config and run folder; no torch
    run_setup.py      a setup that ends early (refused, failed, signalled) leaves the run folder as it was
    configs.py        the config sections every stage shares (optim, train, a token batch), StageConfig
    optim.py          AdamW over parameter groups, the lr schedule applied to each group
    schedule.py       lr (warmup + cosine/WSD), sequence-length warmup, Chinchilla budget
    metrics.py        metrics.jsonl, trackers, MFU, loss-curve PNG
    report.py         report.md at the end of a run
    fsdp.py           FSDP2 on CPU, optimizer state between layouts
"""
