"""The pipeline: every stage of a preset run in order, and the report card over their checkpoints.

    preset.py           the preset format, its seeds, its stages' command lines
    runner.py           run_pipeline.py's engine: stages in order, skip what is done, resume
    report_card.py      the stages' checkpoints compared on one table
    report_held_out.py  the held-out evaluation's 95 % intervals and each policy's paired change
    sweep.py            a train stage run once per setting, judged on the dev split only; --set
    sweep_table.py      a sweep's table: each setting's dev figures, paired changes, the choice
"""
