"""The jobs view's routes against a hostile user and a hostile store, through the FastAPI app.

The app is the plugin's own (:func:`plugins.progress.create_app`) with Airflow's login answered by
a fixed user (``alice``, who may not read ``secret_dag``, as in the browser test's auth manager);
the store is a migrated SQLite file with jobs planned by real DAG-run keys, the committed objects
real local files.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_deadline_batch.plugins import progress
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.ui import model
from tests.helpers.commits import commit
from tests.helpers.sample_job import plan_sample_job

UTC = dt.timezone.utc
EVIL = "</style><script>alert(1)</script>\"'"


@dataclass
class View:
    client: TestClient
    store: ManifestStore
    tmp: Path

    def plan(self, key: str) -> str:
        """A job planned by the DAG run of ``key`` (``dag/run/task``), a deadline an hour away."""
        return plan_sample_job(self.store, key, self.tmp / "out")


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
    assert "Traceback" not in text and 'File "' not in text
    assert "sqlite" not in text.lower() and "postgresql" not in text.lower() and "s3cret" not in text


@pytest.mark.parametrize("path", ["/jobs", "/api/jobs", "/jobs/j-nothere", "/runs/open_dag/manual__1"])
def test_a_store_without_its_tables_answers_503_naming_the_fix(
    view: View, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The store URL names a file that is not a migrated store (a typo, a missing volume)."""
    monkeypatch.setenv("ADB_STORE_URL", f"sqlite:///{view.tmp / 'missing' / 'store.db'}")
    check_503(view, path)


def test_a_database_that_is_down_answers_503(view: View, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens where the PostgreSQL store should be: the store's retries end, then 503."""
    with socket.socket() as probe:  # a port that was free a moment ago: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("ADB_STORE_URL", f"postgresql+psycopg://adb:s3cret@127.0.0.1:{port}/adb")
    check_503(view, "/jobs")  # one route: each waits out the store's retries (seconds)


def check_503(view: View, path: str) -> None:
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


def errored_object(path: Path, *messages: str) -> str:
    """A committed object whose records errored with ``messages`` (JSON-escaped as a worker writes them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"line": i, "error": {"code": "engine_error", "message": message}})
        for i, message in enumerate(messages)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="ascii")  # json.dumps escapes what is not ASCII
    return path.as_uri()


def test_an_error_message_that_is_not_unicode_text_still_renders_the_page(view: View) -> None:
    """``\\ud800`` is valid JSON but a lone surrogate in Python: it cannot be encoded as UTF-8. An
    engine that echoes a hostile prompt in its error put one on the page, and the page was a 500
    for every user from then on. So was any C0 control character, a NUL included, a nuisance only."""
    job_id = view.plan("open_dag/manual__1/plan")
    lease = view.store.claim_shard(job_id, 0, ttl_s=60, worker="w0", pool="local-spot")
    long = "x" * 60_000  # within the sample's read of the object
    uri = errored_object(
        view.tmp / "objects" / "mb0.jsonl", "bad \ud800 byte " + EVIL, "nul \x00 bell \x07", long
    )
    commit(view.store, lease, 0, uri=uri, records=3, counts={"errored": 3})
    response = view.client.get(f"/jobs/{job_id}")
    assert response.status_code == 200, response.text
    text = response.text
    assert "bad \ufffd byte &lt;/style&gt;&lt;script&gt;" in text and "nul \ufffd bell \ufffd" in text
    assert "<script>" not in text and "\x00" not in text
    # a 60 KB message is cut to its first characters: the sample stays a sample
    assert "line 2: engine_error: xxx" in text and "x" * model.SAMPLE_LINE_CHARS not in text


def test_a_manifest_larger_than_a_read_limit_is_served_whole(view: View) -> None:
    """A job of many microbatches lists each object in its manifest: tens of megabytes. The API read
    the first 16 MiB and parsed them as JSON, a 500 for every such job."""
    job_id = view.plan("open_dag/manual__1/plan")
    view.store.cancel_job(job_id, reason="test")
    path = view.tmp / "out" / job_id / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    shards = [
        {"shard_id": f"s{i:06d}", "seq": 0, "uri": f"file:///out/{i:0200d}.jsonl"} for i in range(80_000)
    ]
    path.write_text(json.dumps({"job_id": job_id, "outcomes": {"cancelled": 45}, "shards": shards}, indent=2))
    assert path.stat().st_size > 17 * 1024 * 1024
    view.store.record_manifest(job_id, uri=path.as_uri(), sha256="a" * 64, state="cancelled")
    response = view.client.get(f"/api/jobs/{job_id}/manifest")
    assert response.status_code == 200, response.text[:300]
    assert response.headers["content-type"] == "application/json"
    assert response.content == path.read_bytes()


def test_an_unreadable_manifest_answers_502_naming_it(view: View) -> None:
    job_id = view.plan("open_dag/manual__1/plan")
    view.store.cancel_job(job_id, reason="test")
    uri = (view.tmp / "gone" / "manifest.json").as_uri()
    view.store.record_manifest(job_id, uri=uri, sha256="a" * 64, state="cancelled")
    response = view.client.get(f"/api/jobs/{job_id}/manifest")
    assert response.status_code == 502 and "gone/manifest.json" in response.json()["detail"]


def test_a_user_reads_no_job_of_a_dag_they_may_not_read_by_any_route(view: View) -> None:
    secret = view.plan("secret_dag/manual__1/plan")
    mine = view.plan("open_dag/manual__1/plan")
    for path in (
        f"/jobs/{secret}",
        f"/api/jobs/{secret}",
        f"/api/jobs/{secret}/manifest",
        "/runs/secret_dag/manual__1",
    ):
        response = view.client.get(path)
        assert response.status_code == 403, (path, response.status_code)
        assert secret not in response.text
    listed = view.client.get("/jobs")
    assert listed.status_code == 200 and mine in listed.text and secret not in listed.text
    assert "1 job(s) of DAGs you may not read are not shown" in listed.text
    assert [job["job_id"] for job in view.client.get("/api/jobs").json()] == [mine]
    # a run ID that climbs out of its path, percent-encoded or not, is just a run without jobs
    for path in ("/runs/open_dag/..%2F..%2Fsecret_dag%2Fmanual__1", "/runs/open_dag/../secret_dag/manual__1"):
        response = view.client.get(path)
        assert response.status_code in (200, 403, 404) and secret not in response.text


def test_pages_forbid_script_and_foreign_framing(view: View, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages need no script: a Content-Security-Policy says so, so that a value that ever got
    past the escaping still runs nothing, and only Airflow's own UI (same origin) frames them."""
    job_id = view.plan("open_dag/manual__1/plan")
    for path in ("/jobs", f"/jobs/{job_id}", "/runs/open_dag/manual__1", "/runs/open_dag/none"):
        response = view.client.get(path)
        assert response.status_code == 200
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'self'" in csp and "script-src" not in csp
        assert "<script" not in response.text
    assert view.client.get(f"/api/jobs/{job_id}").headers["x-content-type-options"] == "nosniff"
    monkeypatch.setenv("ADB_STORE_URL", f"sqlite:///{view.tmp / 'missing' / 'store.db'}")
    assert "default-src 'none'" in view.client.get("/jobs").headers["content-security-policy"]


def test_the_history_of_a_job_of_many_rows_replays_fewer_instants(
    view: View, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each instant replays the job view over every row: a job of 100,000 commits at 120 instants
    took longer than the page's refresh. The instants share a budget of rows instead."""
    job_id = view.plan("open_dag/manual__1/plan")
    lease = view.store.claim_shard(job_id, 0, ttl_s=60, worker="w0", pool="local-spot")
    for seq in range(lease.num_microbatches):
        lease = commit(view.store, lease, seq, records=1)
    full = model.read_job_page(view.store, job_id, now=dt.datetime.now(UTC))
    rows = sum(
        len(read(job_id))
        for read in (view.store.list_shards, view.store.list_commits, view.store.list_attempts)
    )
    assert len(full.history) > 2  # the start, a commit instant or more, now
    monkeypatch.setattr(model, "MIN_POINTS", 2)
    monkeypatch.setattr(model, "HISTORY_ROW_BUDGET", rows * 2)  # room for two instants
    thinned = model.read_job_page(view.store, job_id, now=dt.datetime.now(UTC))
    assert len(thinned.history) == 2
    assert thinned.history[0].at == full.history[0].at and thinned.history[-1].remaining_records == (
        full.history[-1].remaining_records
    )


def test_a_job_whose_rows_the_view_refuses_leaves_the_others_listed(view: View) -> None:
    """A job row whose config the job view refuses (written by an older release, or edited by
    hand) made the list a 500 for every user, and its own page one too."""
    import sqlalchemy as sa

    from airflow_deadline_batch.store.schema import jobs

    good = view.plan("open_dag/manual__1/plan")
    bad = view.plan("open_dag/manual__2/plan")
    config = {k: v for k, v in view.store.get_job(bad).config.items() if k != "pools"}
    with sa.create_engine(os.environ["ADB_STORE_URL"]).begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.job_id == bad).values(config=config))
    listed = view.client.get("/jobs")
    assert listed.status_code == 200 and good in listed.text and bad not in listed.text
    assert "1 job(s) could not be shown" in listed.text
    assert [job["job_id"] for job in view.client.get("/api/jobs").json()] == [good]
    for path in (f"/jobs/{bad}", f"/api/jobs/{bad}", "/runs/open_dag/manual__2"):
        response = view.client.get(path)
        assert response.status_code == 500, (path, response.status_code)
        assert f"job {bad} cannot be shown: no pools" in response.text and "Traceback" not in response.text
    assert view.client.get(f"/jobs/{good}").status_code == 200


def test_a_runs_tab_of_many_jobs_lists_as_many_as_the_jobs_list(
    view: View, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that planned hundreds of jobs (a mapped plan task) cost three reads and a view each."""
    monkeypatch.setattr(progress, "LIST_LIMIT", 2)
    planned = [view.plan(f"open_dag/manual__1/plan_{i}") for i in range(3)]
    response = view.client.get("/runs/open_dag/manual__1")
    assert response.status_code == 200
    assert [job for job in planned if job in response.text] == planned[1:]  # the newest two
    assert "1 older job(s) are not listed" in response.text


def test_a_manifest_too_large_to_count_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest over the page's read limit failed to parse at every page view, each a read of
    the limit's 64 MiB; it stays too large (published manifests are immutable), so once is enough."""
    monkeypatch.setattr(model, "MANIFEST_MAX_BYTES", 200)
    manifest = tmp_path / "manifest.json"
    shards = [{"uri": f"file:///out/{i}.jsonl"} for i in range(20)]
    manifest.write_text(json.dumps({"outcomes": {"succeeded": 20}, "shards": shards}))
    uri = manifest.as_uri()
    assert model.published_outcomes(uri) is None
    manifest.write_text('{"outcomes": {"succeeded": 20}}')  # never happens to a published one
    assert model.published_outcomes(uri) is None  # not read again
