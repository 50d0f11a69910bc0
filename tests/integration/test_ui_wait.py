"""The jobs view when the store is slow or gone: a page answers 503 within its own budget
(``plugins.progress.PAGE_BUDGET``), never the workers' minute of retries; the list reads a bounded
number of statements however many jobs it shows.

The store is a real server each time: a loopback socket that accepts TCP and never answers (what a
host that drops packets is to its client), a closed port, the PostgreSQL fixture with a lock held
by another session, a migrated SQLite file. Attempts are counted at the server (connections it
accepted) and at the client (SQLAlchemy's ``do_connect``), never timed.
"""

from __future__ import annotations

import dataclasses
import html
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from airflow_deadline_batch.exceptions import StoreError
from airflow_deadline_batch.plugins import progress
from airflow_deadline_batch.store import ManifestStore, engine
from airflow_deadline_batch.store.engine import RETRY_ATTEMPTS
from tests.helpers.commits import commit
from tests.helpers.sample_job import plan_sample_job
from tests.helpers.waiting import wait_for

#: the longest a test waits for a page held up by a lock (the old code waited for ever)
LOCK_WAIT_DEADLINE_S = 60.0


def planned_on(store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A sample job planned on the store at ``store_url``, which the view is then pointed at."""
    store = ManifestStore.open(store_url, migrate=True)
    try:
        job_id = plan_sample_job(store, "open_dag/manual__1/plan", tmp_path / "out")
    finally:
        store.close()
    monkeypatch.setenv("ADB_STORE_URL", store_url)
    return job_id


@pytest.fixture()
def client(airflow_db: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The plugin's app, logged in as ``alice``; each test points ``ADB_STORE_URL`` at its store."""
    from airflow.api_fastapi import app as airflow_app

    monkeypatch.delenv("ADB_STORE_CONN_ID", raising=False)
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER", "tests.fixtures.ui_auth_manager.DagDenyingAuthManager")
    monkeypatch.setenv("ADB_TEST_DENIED_DAGS", "alice:secret_dag")
    monkeypatch.setattr(airflow_app._AuthManagerState, "instance", None)
    airflow_app.create_auth_manager()
    progress.reset_store()
    app = progress.create_app()
    app.dependency_overrides[get_user] = lambda: SimpleAuthManagerUser(username="alice", role="viewer")
    try:
        with TestClient(app, raise_server_exceptions=False) as test_client:
            yield test_client
    finally:
        progress.reset_store()


@pytest.fixture()
def connects() -> Iterator[list[str]]:
    """The database connections SQLAlchemy tries to open while the test runs, by URL."""
    tried: list[str] = []

    def count(dialect: Any, conn_rec: Any, cargs: Any, cparams: Any) -> None:
        tried.append(f"{cparams.get('host')}:{cparams.get('port')}")

    sa.event.listen(Engine, "do_connect", count)
    try:
        yield tried
    finally:
        sa.event.remove(Engine, "do_connect", count)


class SilentServer:
    """A loopback TCP server that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # how often the accept loop looks at the stop flag
        self.port = self._listener.getsockname()[1]
        self._held: list[tuple[socket.socket, Any]] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                held = self._listener.accept()
            except TimeoutError:
                continue
            with self._changed:
                self._held.append(held)
                self._changed.notify_all()

    def accepted(self) -> int:
        """Connections accepted so far, every one made before this call included: a probe
        connection queues behind them and is waited for (the backlog is accepted in order)."""
        with socket.create_connection(("127.0.0.1", self.port)) as probe:
            me = probe.getsockname()
            with self._changed:
                if not self._changed.wait_for(lambda: any(peer == me for _, peer in self._held), timeout=10):
                    raise TimeoutError("the silent server accepted no connection in 10 s")
                return len(self._held) - 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()
        for held, _ in self._held:
            held.close()


@pytest.fixture()
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()


def check_503(response: Any, path: str, message: str) -> None:
    """503 with one line (a page, or ``{"detail": ...}`` on the JSON API), nothing internal in it."""
    assert response.status_code == 503, response.text
    assert "Traceback" not in response.text and "postgresql" not in response.text.lower()
    assert "s3cret" not in response.text
    if path.startswith("/api/"):
        assert response.json() == {"detail": message}
    else:
        assert response.headers["content-type"].startswith("text/html")
        assert html.escape(message) in response.text


@pytest.mark.parametrize("path", ["/jobs", "/api/jobs/j-any"])
def test_a_host_that_never_answers_is_a_503_after_one_short_connect(
    client: TestClient,
    silent_server: SilentServer,
    connects: list[str],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
) -> None:
    """A host that drops packets held a page for the store's connect retries: 10 s a connect,
    tried until a minute was spent (about 65 s). The view connects once, for 2 s."""
    monkeypatch.setenv("ADB_STORE_URL", f"postgresql+psycopg://adb:s3cret@127.0.0.1:{silent_server.port}/adb")
    check_503(client.get(path), path, progress.STORE_UNAVAILABLE)
    assert silent_server.accepted() == progress.PAGE_BUDGET.attempts == 1 < RETRY_ATTEMPTS
    assert connects == [f"127.0.0.1:{silent_server.port}"]


def test_a_closed_port_is_a_503_after_one_connect(
    client: TestClient, connects: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connection refused is transient to a worker (a restart): it was tried 8 times, backing off."""
    with socket.socket() as probe:  # a port that was free a moment ago: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("ADB_STORE_URL", f"postgresql+psycopg://adb:s3cret@127.0.0.1:{port}/adb")
    for path in ("/jobs", "/api/jobs"):
        check_503(client.get(path), path, progress.STORE_UNAVAILABLE)
    assert connects == [f"127.0.0.1:{port}"] * 2  # one connect a request


def test_a_workers_store_still_retries_a_closed_port(
    connects: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the view's budget is short: a store opened as the workers and the OpenAI routes open
    it rides out a restart, trying a refused connection :data:`RETRY_ATTEMPTS` times (the
    backoff between the tries shortened here: what is counted is the tries)."""
    monkeypatch.setattr(engine, "RETRY_WAIT_S", 0.001)
    monkeypatch.setattr(engine, "RETRY_MAX_WAIT_S", 0.01)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = ManifestStore(f"postgresql+psycopg://adb:s3cret@127.0.0.1:{port}/adb")
    try:
        with pytest.raises(StoreError, match="Connection refused"):
            store.list_jobs()
    finally:
        store.close()
    assert connects == [f"127.0.0.1:{port}"] * RETRY_ATTEMPTS


@pytest.mark.parametrize("path", ["/jobs", "/api/jobs"])
def test_a_read_held_up_by_a_lock_is_a_503_naming_the_statement_timeout(
    client: TestClient, pg_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Another session holds the jobs table (a migration, a long transaction): the page's read
    waited on the lock for as long as it was held. PostgreSQL cancels it at the view's statement
    timeout (1 s here), and the next read, once the lock is gone, is answered."""
    monkeypatch.setattr(
        progress, "PAGE_BUDGET", dataclasses.replace(progress.PAGE_BUDGET, statement_timeout_s=1.0)
    )
    job_id = planned_on(pg_store_url, tmp_path, monkeypatch)
    assert job_id in client.get(path).text  # the view's store is open, its connection pooled
    with (
        psycopg.connect(pg_store_url.replace("postgresql+psycopg://", "postgresql://", 1)) as locker,
        ThreadPoolExecutor(1) as pool,
    ):
        locker.execute("LOCK TABLE adb_jobs IN ACCESS EXCLUSIVE MODE")  # held until the rollback
        asked = pool.submit(client.get, path)
        try:
            response = asked.result(timeout=LOCK_WAIT_DEADLINE_S)
        finally:
            locker.rollback()
        check_503(response, path, progress.store_too_slow())
        assert "statement timeout (1 s)" in progress.store_too_slow()
    listed = client.get(path)
    assert listed.status_code == 200 and job_id in listed.text


def test_the_workers_store_has_no_statement_timeout(pg_store_url: str) -> None:
    """Only the view's connections are cut short: a store opened as the workers open it is not."""
    store = ManifestStore.open(pg_store_url, migrate=True)
    page_store = ManifestStore(pg_store_url, budget=progress.PAGE_BUDGET)
    try:
        shown = [
            s._tx(lambda conn: conn.exec_driver_sql("SHOW statement_timeout").scalar_one(), write=False)
            for s in (store, page_store)
        ]
        assert shown == ["0", "5s"]
    finally:
        store.close()
        page_store.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def listed_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return str(request.getfixturevalue("pg_store_url"))


def test_the_jobs_list_reads_the_same_statements_for_two_jobs_as_for_six(
    client: TestClient, listed_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list read each job's shards, commits and attempts in three transactions of two
    statements (six per job: 300 for 50 jobs); it reads every job's rows together."""
    store = ManifestStore.open(listed_store_url, migrate=True)
    monkeypatch.setenv("ADB_STORE_URL", listed_store_url)
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if conn.engine.url.render_as_string(hide_password=True) == store.url:  # not Airflow's own database
            statements.append(statement)

    def listed() -> tuple[list[str], int]:
        statements.clear()
        sa.event.listen(Engine, "before_cursor_execute", count)
        try:
            response = client.get("/api/jobs")
        finally:
            sa.event.remove(Engine, "before_cursor_execute", count)
        assert response.status_code == 200, response.text
        return [job["job_id"] for job in response.json()], len(statements)

    try:
        planned = [
            plan_sample_job(store, f"open_dag/manual__{i}/plan", tmp_path / f"out{i}") for i in range(6)
        ]
        lease = store.claim_shard(planned[0], 0, ttl_s=60, worker="w0", pool="local-spot")
        commit(store, lease, 0, records=4)
        client.get("/api/jobs")  # the view's store opened (its first connection's set-up not counted)
        monkeypatch.setattr(progress, "LIST_LIMIT", 2)
        two, two_statements = listed()
        monkeypatch.setattr(progress, "LIST_LIMIT", 6)
        six, six_statements = listed()
        six_json = client.get("/api/jobs").json()
        # each job's rows as the store counts them, one job at a time
        expected = {
            job_id: ((p := store.progress(job_id)).committed_records, p.total_records) for job_id in planned
        }
    finally:
        store.close()
    assert two == planned[:-3:-1] and six == planned[::-1]  # newest first
    # the jobs, then their shards, commits and attempts (and on SQLite the two transactions' BEGIN)
    assert six_statements == two_statements <= 6
    listed_counts = {job["job_id"]: (job["committed_records"], job["total_records"]) for job in six_json}
    assert listed_counts == expected and expected[planned[0]][0] > expected[planned[1]][0]


def test_a_page_that_finds_every_pooled_connection_held_up_is_a_503(
    client: TestClient, pg_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six pages wait on a lock, holding the pool's six connections: the seventh waited 30 s for
    one and then failed with a bare 500 (SQLAlchemy's pool timeout is no driver error). It waits
    the view's pool timeout and answers a 503 saying the store is busy; the six are answered once
    the lock is gone."""
    monkeypatch.setattr(
        progress,
        "PAGE_BUDGET",
        dataclasses.replace(
            progress.PAGE_BUDGET, pool_timeout_s=0.5, statement_timeout_s=LOCK_WAIT_DEADLINE_S
        ),
    )
    job_id = planned_on(pg_store_url, tmp_path, monkeypatch)
    assert job_id in client.get("/api/jobs").text
    dsn = pg_store_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with (
        psycopg.connect(dsn) as locker,
        psycopg.connect(dsn, autocommit=True) as watcher,
        ThreadPoolExecutor(7) as pool,
    ):
        locker.execute("LOCK TABLE adb_jobs IN ACCESS EXCLUSIVE MODE")
        try:
            held = [pool.submit(client.get, "/api/jobs") for _ in range(6)]

            def waiting() -> int:
                query = (
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s"
                )
                row = watcher.execute(query, ("%adb_jobs%",)).fetchone()
                return int(row[0]) if row else 0

            # every connection of the pool is waiting on the lock
            wait_for(
                lambda: waiting() >= 6, timeout_s=LOCK_WAIT_DEADLINE_S, what="six pages waiting on the lock"
            )
            seventh = pool.submit(client.get, "/api/jobs").result(timeout=LOCK_WAIT_DEADLINE_S)
        finally:
            locker.rollback()
        check_503(seventh, "/api/jobs", progress.STORE_BUSY)
        answered = [future.result(timeout=LOCK_WAIT_DEADLINE_S) for future in held]
    assert [(r.status_code, job_id in r.text) for r in answered] == [(200, True)] * 6
