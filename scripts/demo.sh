#!/usr/bin/env bash
# The whole CPU demo from the local data mirror: the pipeline runner on the demo preset
# (scripts/run_pipeline.py --preset demo; the stages are configs/pipelines/demo.yaml).
# `make demo` runs the same command. Stages already done are skipped, so a second run takes
# seconds; the report card (tables, held-out preference figures, greedy answers) is printed
# at the end and written to $DEMO/report.md. Extra arguments go to the runner (--from STAGE, --to STAGE).
set -euo pipefail
PY=${PY:-.venv/bin/python}
DEMO=${DEMO:-runs/demo}
MIRROR=${SPROUT_MIRROR:?set SPROUT_MIRROR to the data mirror folder}
exec "$PY" scripts/run_pipeline.py --preset demo --out "$DEMO" --mirror "$MIRROR" "$@"
