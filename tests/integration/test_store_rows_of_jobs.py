"""``ManifestStore.rows_of_jobs``: the shards, commits and attempts of many jobs in one read, each
job's exactly as ``list_shards``, ``list_commits`` and ``list_attempts`` give them, on SQLite and
PostgreSQL (what the jobs list reads instead of three transactions per job)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.store import JobRows, ManifestStore, manifest_store
from tests.helpers.commits import commit
from tests.integration.test_store import new_job

pytestmark = [pytest.mark.integration]


def busy_jobs(store: ManifestStore, count: int) -> list[str]:
    """``count`` jobs with commits (the validation object among them) and attempts, ended and running."""
    job_ids = []
    for i in range(count):
        job, _ = store.create_job(*new_job(shards=2, key=f"dag/run_{i}/plan"))
        lease = store.claim_shard(job.job_id, 1, ttl_s=600, worker=f"w{i}", pool="spot")
        lease = commit(store, lease, 0, records=2)
        store.release(lease, AttemptOutcome.PREEMPTED, "spot notice")
        store.claim_shard(job.job_id, 1, ttl_s=600, worker=f"w{i}-again", pool="on-demand")
        if i % 2:
            store.claim_shard(job.job_id, 0, ttl_s=600, worker=f"w{i}-0", pool="spot")
        job_ids.append(job.job_id)
    return job_ids


def one_at_a_time(store: ManifestStore, job_id: str) -> JobRows:
    return JobRows(
        shards=tuple(store.list_shards(job_id)),
        commits=tuple(store.list_commits(job_id)),
        attempts=tuple(store.list_attempts(job_id)),
    )


def test_the_rows_of_many_jobs_are_each_jobs_own(store: ManifestStore) -> None:
    job_ids = busy_jobs(store, 3)
    rows = store.rows_of_jobs([*reversed(job_ids), job_ids[0], "j-nosuchjob"])
    assert list(rows) == [*reversed(job_ids), "j-nosuchjob"]  # asked order, each once
    for job_id in job_ids:
        assert rows[job_id] == one_at_a_time(store, job_id)
        assert rows[job_id].commits and len(rows[job_id].attempts) >= 2  # not a vacuous comparison
    assert rows["j-nosuchjob"] == JobRows()
    assert store.rows_of_jobs([]) == {}


def test_the_rows_of_many_jobs_take_three_statements_a_chunk(
    store: ManifestStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three statements for every :data:`ROWS_OF_JOBS_CHUNK` jobs, whatever their rows (SQLite
    bounds a statement's parameters), and the rows the same across chunks."""
    job_ids = busy_jobs(store, 5)
    whole = store.rows_of_jobs(job_ids)
    selects: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            selects.append(statement)

    monkeypatch.setattr(manifest_store, "ROWS_OF_JOBS_CHUNK", 2)
    sa.event.listen(Engine, "before_cursor_execute", count)
    try:
        chunked = store.rows_of_jobs(job_ids)
    finally:
        sa.event.remove(Engine, "before_cursor_execute", count)
    assert chunked == whole and len(selects) == 3 * 3  # chunks of 2, 2 and 1 jobs
