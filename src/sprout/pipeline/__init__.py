"""The pipeline: every stage of a preset run in order (`runner`), and the report card that
compares the stages' checkpoints on one table (`report_card`)."""
