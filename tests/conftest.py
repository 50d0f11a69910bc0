"""Shared test setup. Fixture plugins live in tests/fixtures/ (one module per real service)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Airflow reads its configuration at import time; keep it out of the developer's ~/airflow. The
# folder is made once, by the process that starts the run (pytest-xdist's workers inherit it), and
# removed when that process ends.
if "AIRFLOW_HOME" not in os.environ:
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="adb-airflow-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], True)
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "False")

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.s3",
]
