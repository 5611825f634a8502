#!/usr/bin/env bash
# The whole CPU demo from the local data mirror: the pipeline runner on the demo preset
# (scripts/run_pipeline.py --preset demo; the stages are configs/pipelines/demo.yaml).
# `make demo` runs the same command. Stages already done are skipped, so a second run takes
# seconds; the report card (tables, held-out preference figures, greedy answers) is printed
# at the end and written to $DEMO/report.md. Extra arguments go to the runner (--from STAGE, --to STAGE).
# The mirror is $SPROUT_MIRROR, else ../shared/data beside the repository (as src/sprout/mirror.py
# and the Makefile find it); Python is $PY, else the repository's .venv/bin/python, else python3.
# It runs from the repository root, so a relative DEMO is under it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEMO=${DEMO:-runs/demo}
MIRROR=${SPROUT_MIRROR:-$(dirname "$ROOT")/shared/data}
exec "$PY" scripts/run_pipeline.py --preset demo --out "$DEMO" --mirror "$MIRROR" "$@"
