#!/usr/bin/env bash
# The main job end to end on the embedded defaults, through Airflow: the local example DAG under
# a real dag.test() (SQLite metadata and manifest store, local files, local subprocess workers,
# the real small model SmolLM2-135M-Instruct on CPU, injected Spot-style preemptions).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ADB_ENGINE="${ADB_ENGINE:-transformers}" exec .venv/bin/python scripts/run_example_dag.py "$@"
