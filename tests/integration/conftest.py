"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def airflow_db() -> None:
    """Airflow's metadata database (SQLite under the session's ``AIRFLOW_HOME``), migrated once a
    module, for the tests that run Airflow's API routes in process."""
    from airflow.utils.db import initdb

    initdb()
