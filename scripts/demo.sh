#!/usr/bin/env bash
# The main job end to end on the embedded defaults: SQLite store, local files, local subprocess
# workers, the real small model on CPU, injected Spot-style preemptions.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/deadline-batch run dags/data/sample_reviews.jsonl \
  --deadline "${DEADLINE:-+30m}" --engine transformers --workers 2 \
  --preempt-rate "${PREEMPT_RATE:-40}" --preempt-notice 20 --seed 1 "$@"
