"""SIGINT to a ``deadline-batch`` command other than ``run`` (docs/design.md §8): one line saying what is
true for that command, exit 130, and a rerun that is as safe as the line says.

Each command is held where it is interrupted by a real lock: a PostgreSQL transaction holds a table
the command needs, and the signal is sent once the server reports the command's backend waiting on
that transaction (no sleeps). Before, every command said "no job was recorded; rerun the command
to start it", which is wrong for all of them.
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from airflow_deadline_batch import cli
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import cli_argv, cli_env
from tests.helpers.inputs import mixed_input
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _dsn(store_url: str) -> str:
    return store_url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextmanager
def _locked(store_url: str, table: str) -> Iterator[int]:
    """Hold ``table`` (ACCESS EXCLUSIVE) in an open transaction; yields the holder's backend PID."""
    with psycopg.connect(_dsn(store_url)) as conn:
        conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE".encode())
        pid = conn.execute(b"SELECT pg_backend_pid()").fetchone()
        assert pid is not None
        try:
            yield int(pid[0])
        finally:
            conn.rollback()


def _interrupt_while_blocked(store_url: str, holder: int, args: list[str], cwd: Path) -> tuple[int, str]:
    """Start ``deadline-batch ARGS``, wait until its backend waits on ``holder``'s lock, send SIGINT;
    its exit code and stderr."""
    proc = subprocess.Popen(
        cli_argv(*args), cwd=cwd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with psycopg.connect(_dsn(store_url), autocommit=True) as watch:

            def blocked() -> bool:
                assert proc.poll() is None, "the command ended before it was interrupted"
                row = watch.execute(
                    b"SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (holder,)
                ).fetchone()
                return bool(row and row[0])

            wait_for(blocked, timeout_s=60, what=f"`{' '.join(args[:2])}` waiting on the lock")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, stderr


@pytest.fixture
def job(pg_store_url: str, tmp_path: Path) -> str:
    """A planned job of the echo engine, nothing run yet."""
    path = mixed_input(6, seed=2, bad_fraction=0.0).write(tmp_path / "in.jsonl")
    store = ManifestStore.open(pg_store_url)
    try:
        request = PlanRequest(
            input_uri=str(path), deadline=dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
            output_uri=str(tmp_path / "out"), engine="echo", pools=default_local_pools("echo"), workers=1,
        )  # fmt: skip
        return plan_job(store, request).job_id
    finally:
        store.close()


def test_interrupted_status_and_cancel_say_what_happened_and_the_rerun_finishes_the_cancel(
    job: str, pg_store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store_args = ["--store", pg_store_url]
    with _locked(pg_store_url, "adb_jobs") as holder:
        code, err = _interrupt_while_blocked(pg_store_url, holder, ["status", job, *store_args], tmp_path)
    assert (code, err) == (130, "deadline-batch: status stopped by SIGINT; it changes nothing; rerun it\n")

    store = ManifestStore.open(pg_store_url)
    try:
        # held after its cancellation committed, while publishing reads the commits (before it
        # committed the line says the job "may or may not be cancelled": one subprocess less for CI)
        with _locked(pg_store_url, "adb_commits") as holder:
            code, err = _interrupt_while_blocked(pg_store_url, holder, ["cancel", job, *store_args], tmp_path)
        assert code == 130 and err.count("\n") == 1, err
        assert f"job {job} is cancelled but its manifest may not be published" in err and "is safe" in err, (
            err
        )
        stopped = store.get_job(job)
        assert (stopped.state.value, stopped.manifest_uri) == ("cancelled", None)
        # the rerun the line calls safe finishes it
        assert cli.main(["cancel", job, *store_args]) == 0, capsys.readouterr()
        assert store.get_job(job).manifest_uri
    finally:
        store.close()
