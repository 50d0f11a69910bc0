"""Fresh ``AIRFLOW_HOME`` folders for the tests that run Airflow in a subprocess, their metadata
database already migrated.

Migrating a fresh SQLite metadata database (``airflow db migrate``) costs a few seconds of every
subprocess that starts on a new home. The tests run on a copy of one database migrated once per
test run instead (the same Airflow, so the same schema); the subprocess still runs Airflow's own
migration, which finds the copy at its head and changes nothing. The template lives beside the
test run's temporary folders: pytest-xdist's workers share one, made by the first that needs it
(under a file lock), and it goes when pytest cleans up its temporary folders.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DB_FILE = "airflow.db"

MIGRATE = "from airflow.utils.db import upgradedb; upgradedb()"


def _template_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder this test run's processes share: under pytest-xdist, its workers' common parent."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test run's migrated metadata database, made by the first process that asks for it."""
    root = _template_root(tmp_path_factory) / "adb-airflow-template"
    root.mkdir(exist_ok=True)
    template = root / DB_FILE
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the one migrating
        if not template.exists():
            home = root / "home"
            home.mkdir(exist_ok=True)
            env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
            proc = subprocess.run(
                [sys.executable, "-c", MIGRATE], env=env, capture_output=True, text=True, timeout=300
            )
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
            os.replace(home / DB_FILE, template)  # whole or absent: a worker killed midway leaves none
    return template


def airflow_home(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Make ``home`` (a new folder) an ``AIRFLOW_HOME`` whose metadata database is migrated."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(migrated_template(tmp_path_factory), home / DB_FILE)
    return home
