#!/usr/bin/env bash
# Static checks CI enforces before the tests: ruff lint, ruff format, mypy on the package, and
# mypy --strict on core/ and store/ (the typed heart: domain objects keep their types across seams).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy airflow_deadline_batch
.venv/bin/mypy --strict airflow_deadline_batch/core airflow_deadline_batch/store
