"""The pipeline: every stage of a preset run in order (`runner`), and the report card that
compares the stages' checkpoints on one table (`report_card`), with the held-out evaluation's
95 % intervals and each policy's paired change (`report_intervals`)."""
