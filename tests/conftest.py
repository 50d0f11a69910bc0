"""Shared test setup. Fixture plugins live in tests/fixtures/ (one module per real service)."""

from __future__ import annotations

import os
import tempfile

# Airflow reads its configuration at import time; keep it out of the developer's ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="adb-airflow-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "False")

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.s3",
]
