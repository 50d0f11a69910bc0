"""The OpenAI Batch routes (docs/openai.md) in a bare FastAPI app, for the tests that drive them
through a files store they wrap (``tests/integration/test_openai_batches.py``, ``..._sidecars.py``).

Airflow's login is answered by a fixed user (``alice``, who may not read ``secret_dag``), the
manifest store is a migrated SQLite file of the test's own, and the routes read the files store the
test gives them. Airflow's metadata database must be migrated first (the ``airflow_db`` fixture of
``tests/integration/conftest.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi import FastAPI
from fastapi.testclient import TestClient

from airflow_deadline_batch.api import openai_batches
from airflow_deadline_batch.plugins import progress
from airflow_deadline_batch.storage.base import ObjectStorage


class StorageWrapper:
    """The real storage behind a test's wrapper: whatever the wrapper does not define itself (to
    count or hold some calls) goes to ``inner`` unchanged."""

    def __init__(self, inner: ObjectStorage) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def batches_client(
    files: ObjectStorage | StorageWrapper, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str
) -> Iterator[TestClient]:
    """A client of the routes under ``/openai/v1``, logged in as ``alice`` with ``role``, on the
    files store ``files`` and a fresh manifest store in ``tmp_path``."""
    from airflow.api_fastapi import app as airflow_app

    from airflow_deadline_batch.store import ManifestStore

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    ManifestStore.open(store_url, migrate=True).close()
    monkeypatch.setenv("ADB_STORE_URL", store_url)
    monkeypatch.delenv("ADB_STORE_CONN_ID", raising=False)
    progress.reset_store()  # this test's store, not the last one's
    monkeypatch.setattr(openai_batches, "_files", lambda: files)
    # SimpleAuthManager's roles, minus the DAGs ADB_TEST_DENIED_DAGS names for a user
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER", "tests.fixtures.ui_auth_manager.DagDenyingAuthManager")
    monkeypatch.setenv("ADB_TEST_DENIED_DAGS", "alice:secret_dag")
    monkeypatch.setattr(airflow_app._AuthManagerState, "instance", None)
    airflow_app.create_auth_manager()
    app = FastAPI()
    app.include_router(openai_batches.create_router(), prefix="/openai/v1")
    app.dependency_overrides[get_user] = lambda: SimpleAuthManagerUser(username="alice", role=role)
    try:
        with TestClient(app) as test_client:
            yield test_client
    finally:
        progress.reset_store()
