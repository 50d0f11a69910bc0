"""The jobs view's routes against a hostile user and a hostile store, through the FastAPI app.

The app is the plugin's own (:func:`plugins.progress.create_app`) with Airflow's login answered by
a fixed user (``alice``, who may not read ``secret_dag``, as in the browser test's auth manager);
the store is a migrated SQLite file with jobs planned by real DAG-run keys, the committed objects
real local files.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.plugins import progress
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore

SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"
UTC = dt.timezone.utc
EVIL = "</style><script>alert(1)</script>\"'"


@dataclass
class View:
    client: TestClient
    store: ManifestStore
    tmp: Path

    def plan(self, key: str) -> str:
        """A job planned by the DAG run of ``key`` (``dag/run/task``), a deadline an hour away."""
        return plan_job(
            self.store,
            PlanRequest(
                input_uri=str(SAMPLE),
                deadline=dt.datetime.now(UTC) + dt.timedelta(hours=1),
                output_uri=str(self.tmp / "out"),
                engine="echo",
                pools=default_local_pools("echo"),
                workers=2,
                microbatch_size=4,
                idempotency_key=key,
            ),
        ).job_id


@pytest.fixture()
def view(airflow_db: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[View]:
    from airflow.api_fastapi import app as airflow_app

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(store_url, migrate=True)
    monkeypatch.setenv("ADB_STORE_URL", store_url)
    monkeypatch.delenv("ADB_STORE_CONN_ID", raising=False)
    progress.reset_store()
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER", "tests.fixtures.ui_auth_manager.DagDenyingAuthManager")
    monkeypatch.setenv("ADB_TEST_DENIED_DAGS", "alice:secret_dag")
    monkeypatch.setattr(airflow_app._AuthManagerState, "instance", None)
    airflow_app.create_auth_manager()
    app = progress.create_app()
    app.dependency_overrides[get_user] = lambda: SimpleAuthManagerUser(username="alice", role="viewer")
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield View(client, store, tmp_path)
    finally:
        store.close()
        progress.reset_store()


def one_line_without_internals(text: str) -> None:
    assert "Traceback" not in text and "sqlite" not in text.lower() and 'File "' not in text


@pytest.mark.parametrize("path", ["/jobs", "/api/jobs", "/jobs/j-nothere", "/runs/open_dag/manual__1"])
def test_a_store_without_its_tables_answers_503_naming_the_fix(
    view: View, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The store URL names a file that is not a migrated store (a typo, a missing volume)."""
    monkeypatch.setenv("ADB_STORE_URL", f"sqlite:///{view.tmp / 'missing' / 'store.db'}")
    response = view.client.get(path)
    assert response.status_code == 503, response.text
    assert "ADB_STORE_URL" in response.text
    one_line_without_internals(response.text)
    if path.startswith("/api/"):
        assert response.json() == {"detail": progress.STORE_UNAVAILABLE}
    else:
        assert response.headers["content-type"].startswith("text/html")


def test_a_missing_store_connection_answers_503(view: View, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADB_STORE_URL")
    monkeypatch.setenv("ADB_STORE_CONN_ID", "adb_no_such_connection")
    response = view.client.get("/api/jobs")
    assert response.status_code == 503 and response.json() == {"detail": progress.STORE_UNAVAILABLE}
