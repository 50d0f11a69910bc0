"""The manifest store against SQLite and a real PostgreSQL server: leases, fencing, commits, progress."""

from __future__ import annotations

import dataclasses
import datetime as dt
import multiprocessing as mp
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.exceptions import (
    ConfigurationError,
    InvalidTransition,
    JobNotFound,
    LeaseLost,
    ShardNotClaimable,
    StoreError,
)
from airflow_deadline_batch.store import JobRow, Lease, ManifestStore, NewCommit, NewJob, NewShard, leases
from airflow_deadline_batch.store.engine import PING_AFTER_IDLE_S, DriverStatement, normalize_url
from airflow_deadline_batch.store.manifest_store import RACE_TRIES
from tests.fixtures.postgres import admin_execute
from tests.helpers.commits import commit
from tests.helpers.schema import head_revision

UTC = dt.timezone.utc
DEADLINE = dt.datetime(2030, 1, 1, 6, 0, tzinfo=UTC)


def new_job(
    *,
    shards: int = 2,
    microbatches: int = 2,
    records_per_shard: int = 4,
    invalid: int = 1,
    max_attempts: int = 3,
    key: str | None = None,
) -> tuple[NewJob, list[NewShard], NewCommit | None]:
    """A plan with ``shards`` shards of ``records_per_shard`` records and ``invalid`` validation errors."""
    plan = [
        NewShard(
            shard_index=i,
            byte_start=i * 100,
            byte_end=(i + 1) * 100,
            first_line=1 + i * 10,
            line_count=10,
            records=records_per_shard,
            num_microbatches=microbatches,
            input_sha256=f"{i:064x}",
            est_work_s=10.0 * microbatches,
            excluded_lines=(1 + i * 10,) if invalid else (),
        )
        for i in range(shards)
    ]
    validation = (
        NewCommit(
            uri="file:///out/validation/errors.jsonl",
            sha256="f" * 64,
            records=invalid,
            counts={"errored": invalid},
        )
        if invalid
        else None
    )
    job = NewJob(
        deadline=DEADLINE,
        input_uri="file:///in.jsonl",
        input_sha256="e" * 64,
        input_lines=shards * records_per_shard + invalid,
        input_total_lines=shards * 10 + 3,
        output_uri="file:///out",
        config={"engine": "echo", "max_attempts": max_attempts, "lease_ttl_s": 30},
        admission={"verdict": "feasible"},
        idempotency_key=key,
    )
    return job, plan, validation


def create(store: ManifestStore, **kwargs: object) -> JobRow:
    job, plan, validation = new_job(**kwargs)  # type: ignore[arg-type]
    row, created = store.create_job(job, plan, validation)
    assert created
    return row


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` until true or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)  # polling interval


pytestmark = pytest.mark.integration


def claim(
    store: ManifestStore, job: JobRow, index: int = 0, ttl_s: float = 30.0, worker: str = "w1"
) -> Lease:
    return store.claim_shard(job.job_id, index, ttl_s=ttl_s, worker=worker, pool="spot")


def expired_claim(store: ManifestStore, job: JobRow, index: int = 0) -> Lease:
    """A lease that expires on the database clock 0.2 s from now; returns once it has."""
    lease = store.claim_shard(job.job_id, index, ttl_s=0.2, worker="slow", pool="spot")
    wait_for(lambda: store.db_time() > lease.expires_at, what="the lease to expire on the DB clock")
    return lease


# -- schema and jobs --------------------------------------------------------------------------------


def test_migrate_is_idempotent_and_tables_are_prefixed(store: ManifestStore) -> None:
    store.migrate()
    store.migrate()
    assert store.schema_revision() == head_revision()
    engine = sa.create_engine(normalize_url(store_url_of(store)))
    try:
        names = set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"adb_jobs", "adb_shards", "adb_attempts", "adb_commits", "adb_alembic_version"} <= names
    assert not {n for n in names if not n.startswith("adb_")}


def test_migrations_create_every_index_the_schema_declares(tmp_path: Path) -> None:
    """The Alembic revisions and ``store.schema`` agree on indexes (the history reads rely on two)."""
    from airflow_deadline_batch.store.schema import metadata

    url = f"sqlite:///{tmp_path / 'store.db'}"
    ManifestStore.open(url).close()
    engine = sa.create_engine(url)
    try:
        inspector = sa.inspect(engine)
        for table in metadata.sorted_tables:
            created = {ix["name"]: tuple(ix["column_names"]) for ix in inspector.get_indexes(table.name)}
            for index in table.indexes:
                assert created.get(index.name) == tuple(c.name for c in index.columns), (
                    table.name,
                    index.name,
                )
    finally:
        engine.dispose()


def test_migrations_create_every_column_the_schema_declares(tmp_path: Path) -> None:
    """The Alembic revisions and ``store.schema`` agree on columns (0005 adds the racing lease)."""
    from airflow_deadline_batch.store.schema import metadata

    url = f"sqlite:///{tmp_path / 'store.db'}"
    ManifestStore.open(url).close()
    engine = sa.create_engine(url)
    try:
        inspector = sa.inspect(engine)
        for table in metadata.sorted_tables:
            created = {c["name"]: c["nullable"] for c in inspector.get_columns(table.name)}
            declared = {c.name: c.nullable for c in table.columns}
            assert created == declared, table.name
    finally:
        engine.dispose()


def store_url_of(store: ManifestStore) -> str:
    return store._engine.url.render_as_string(hide_password=False)  # test-only: the real URL


def test_unmigrated_store_error_names_the_fix(store_url: str) -> None:
    bare = ManifestStore(store_url)
    try:
        with pytest.raises(StoreError, match=r"migrate\(\)"):
            bare.get_job("j-nothing")
    finally:
        bare.close()


def test_db_clock_is_the_servers_wall_clock(store: ManifestStore) -> None:
    assert abs(store.db_time() - time.time()) < 60


def test_create_job_records_shards_and_validation(store: ManifestStore) -> None:
    job = create(store, shards=3, microbatches=2, invalid=2)
    assert job.job_id.startswith("j-") and len(job.job_id) == 22
    assert job.state is JobState.ADMITTED
    assert job.deadline == DEADLINE and job.created_at.tzinfo is not None
    assert job.config["max_attempts"] == 3 and job.admission == {"verdict": "feasible"}
    shards = store.list_shards(job.job_id)
    assert [s.shard_index for s in shards] == [0, 1, 2]
    assert all(s.state is ShardState.PENDING and s.epoch == 0 and s.cursor == 0 for s in shards)
    assert shards[1].excluded_lines == (11,) and shards[1].shard_id == "00001"
    assert store.get_shard(job.job_id, 2) == shards[2]
    [validation] = store.list_commits(job.job_id)
    assert (validation.shard_index, validation.seq, validation.attempt_id) == (-1, 0, "plan")
    assert validation.counts == {"errored": 2} and validation.shard_id == "validation"


def test_same_idempotency_key_returns_the_same_job_and_writes_nothing(store: ManifestStore) -> None:
    first, created = store.create_job(*new_job(key="nightly-2030-01-01"))
    again, created_again = store.create_job(*new_job(key="nightly-2030-01-01", shards=5))
    assert created and not created_again
    assert again == first
    assert store.get_job_by_idempotency_key("nightly-2030-01-01") == first
    assert store.get_job_by_idempotency_key("other") is None
    assert len(store.list_shards(first.job_id)) == 2
    assert [j.job_id for j in store.list_jobs()] == [first.job_id]


def test_explicit_duplicate_job_id_is_refused(store: ManifestStore) -> None:
    job, plan, validation = new_job()
    job = dataclasses.replace(job, job_id="j-fixed")
    store.create_job(job, plan, validation)
    with pytest.raises(StoreError, match="already exists"):
        store.create_job(job, plan, validation)


def test_rejected_job_is_recorded_without_shards(store: ManifestStore) -> None:
    job, _, _ = new_job()
    rejected, created = store.create_job(
        dataclasses.replace(job, state=JobState.REJECTED, admission={"verdict": "infeasible"})
    )
    assert created and rejected.state is JobState.REJECTED and rejected.completed_at is not None
    assert store.list_shards(rejected.job_id) == []
    assert store.get_job(rejected.job_id).admission == {"verdict": "infeasible"}


def test_plan_that_cannot_account_for_every_line_is_refused(store: ManifestStore) -> None:
    job, plan, validation = new_job()
    with pytest.raises(ValueError, match="input_lines"):
        store.create_job(dataclasses.replace(job, input_lines=job.input_lines + 1), plan, validation)
    with pytest.raises(ValueError, match="without gaps"):
        store.create_job(job, [plan[1]], validation)
    assert store.list_jobs() == []


def test_unknown_job_raises_job_not_found(store: ManifestStore) -> None:
    with pytest.raises(JobNotFound, match="check the job ID") as err:
        store.get_job("j-missing")
    assert err.value.exit_code == 2 and err.value.job_id == "j-missing"
    with pytest.raises(JobNotFound):
        store.claim_shard("j-missing", 0, ttl_s=1, worker="w")
    with pytest.raises(JobNotFound):
        store.progress("j-missing")


def test_list_jobs_newest_first_with_limit(store: ManifestStore) -> None:
    ids = {create(store, key=f"k{i}").job_id for i in range(3)}
    listed = store.list_jobs()
    assert {j.job_id for j in listed} == ids
    assert [j.created_at for j in listed] == sorted((j.created_at for j in listed), reverse=True)
    assert len(store.list_jobs(limit=2)) == 2


def test_job_state_compare_and_set(store: ManifestStore) -> None:
    job = create(store)
    with pytest.raises(InvalidTransition, match="not running"):
        store.set_job_state(job.job_id, JobState.FINALIZING, expected=[JobState.RUNNING])
    with pytest.raises(InvalidTransition):
        store.set_job_state(job.job_id, JobState.COMPLETED)
    running = store.set_job_state(job.job_id, "running", expected=["admitted"])
    assert running.state is JobState.RUNNING and running.updated_at >= job.updated_at
    failed = store.set_job_state(job.job_id, JobState.FAILED, error="deadline missed")
    assert failed.error == "deadline missed" and failed.completed_at is not None
    with pytest.raises(InvalidTransition):
        store.set_job_state(job.job_id, JobState.RUNNING)


def test_manifest_is_recorded_once(store: ManifestStore) -> None:
    job = create(store)
    store.set_job_state(job.job_id, JobState.FINALIZING)
    done = store.record_manifest(
        job.job_id, uri="file:///out/manifest.json", sha256="a" * 64, state="completed"
    )
    assert (done.state, done.manifest_uri, done.manifest_sha256) == (
        JobState.COMPLETED,
        "file:///out/manifest.json",
        "a" * 64,
    )
    assert (
        store.record_manifest(
            job.job_id, uri="file:///out/manifest.json", sha256="a" * 64, state=JobState.COMPLETED
        )
        == done
    )
    with pytest.raises(InvalidTransition, match="never replaced"):
        store.record_manifest(
            job.job_id, uri="file:///out/other.json", sha256="b" * 64, state=JobState.COMPLETED
        )


# -- leases, fencing and commits --------------------------------------------------------------------


def test_first_claim_runs_the_job_and_records_an_attempt(store: ManifestStore) -> None:
    job = create(store)
    before = store.db_time()
    lease = claim(store, job, ttl_s=30)
    assert lease.epoch == 1 and lease.cursor == 0 and lease.num_microbatches == 2
    assert lease.attempt_id.startswith("a-") and before + 30 <= lease.expires_at <= store.db_time() + 30
    assert store.get_job(job.job_id).state is JobState.RUNNING
    shard = store.get_shard(job.job_id, 0)
    assert (shard.state, shard.lease_attempt_id, shard.attempts, shard.last_pool) == (
        ShardState.LEASED,
        lease.attempt_id,
        1,
        "spot",
    )
    [attempt] = store.list_attempts(job.job_id)
    assert (attempt.attempt_id, attempt.outcome, attempt.worker, attempt.epoch) == (
        lease.attempt_id,
        AttemptOutcome.RUNNING,
        "w1",
        1,
    )


def test_claim_is_refused_while_a_live_lease_is_held(store: ManifestStore) -> None:
    job = create(store)
    claim(store, job, ttl_s=30)
    with pytest.raises(ShardNotClaimable) as err:
        claim(store, job, worker="w2")
    assert err.value.reason == "leased" and 0 < err.value.seconds_left <= 30
    assert len(store.list_attempts(job.job_id)) == 1


def test_fenced_attempt_cannot_heartbeat_commit_or_complete(store: ManifestStore) -> None:
    job = create(store, microbatches=2)
    a = expired_claim(store, job)
    b = claim(store, job, worker="w2")
    assert b.epoch == a.epoch + 1
    with pytest.raises(LeaseLost, match="fenced by epoch 2"):
        store.heartbeat(a, 30)
    with pytest.raises(LeaseLost):
        commit(store, a, 0)
    with pytest.raises(LeaseLost):
        store.complete_shard(a)
    assert not store.release(a, AttemptOutcome.PREEMPTED)
    commit(store, b, 0)
    commit(store, b, 1)
    store.complete_shard(b)
    attempts = {x.attempt_id: x for x in store.list_attempts(job.job_id)}
    assert attempts[a.attempt_id].outcome is AttemptOutcome.LOST_LEASE
    assert attempts[b.attempt_id].outcome is AttemptOutcome.SUCCEEDED
    shard_commits = [c for c in store.list_commits(job.job_id) if c.shard_index == 0]
    assert [(c.seq, c.attempt_id, c.epoch) for c in shard_commits] == [
        (0, b.attempt_id, 2),
        (1, b.attempt_id, 2),
    ]
    assert store.get_shard(job.job_id, 0).state is ShardState.SUCCEEDED


def test_expired_lease_refuses_writes_even_before_anyone_takes_over(store: ManifestStore) -> None:
    job = create(store)
    lease = claim(store, job, ttl_s=-1.0)
    with pytest.raises(LeaseLost, match="expired"):
        store.heartbeat(lease, 30)
    with pytest.raises(LeaseLost, match="expired"):
        commit(store, lease, 0)
    assert store.list_commits(job.job_id)[-1].shard_index == -1


def test_heartbeat_extends_the_lease_on_the_db_clock(store: ManifestStore) -> None:
    job = create(store)
    lease = claim(store, job, ttl_s=5)
    longer = store.heartbeat(lease, 120)
    assert longer.expires_at > lease.expires_at and longer.expires_at > store.db_time() + 100
    assert store.get_shard(job.job_id, 0).lease_expires_at == longer.expires_at
    assert (longer.attempt_id, longer.epoch) == (lease.attempt_id, lease.epoch)


def test_commit_extends_the_lease_by_its_ttl(store: ManifestStore) -> None:
    job = create(store)
    lease = store.heartbeat(claim(store, job, ttl_s=1), 60)
    after = commit(store, lease, 0)
    assert after.cursor == 1 and after.expires_at >= lease.expires_at


def test_commit_seq_must_be_the_cursor(store: ManifestStore) -> None:
    job = create(store, microbatches=3)
    lease = claim(store, job)
    with pytest.raises(StoreError, match="next to commit is 0") as err:
        commit(store, lease, 1)
    assert not isinstance(err.value, LeaseLost) and err.value.expected_seq == 0
    commit(store, lease, 0)
    with pytest.raises(StoreError, match="duplicate or out-of-order"):
        commit(store, lease, 0)
    commit(store, lease, 1)
    commit(store, lease, 2)
    with pytest.raises(StoreError, match="of 3"):
        commit(store, lease, 3)
    assert store.get_shard(job.job_id, 0).cursor == 3


def test_complete_requires_every_microbatch(store: ManifestStore) -> None:
    job = create(store, microbatches=2)
    lease = claim(store, job)
    commit(store, lease, 0)
    with pytest.raises(StoreError, match="1 of 2"):
        store.complete_shard(lease)
    commit(store, lease, 1)
    store.complete_shard(lease)
    with pytest.raises(ShardNotClaimable) as err:
        claim(store, job)
    assert err.value.reason == "succeeded"
    with pytest.raises(LeaseLost):
        store.heartbeat(lease, 30)


def test_new_attempt_resumes_after_the_last_commit(store: ManifestStore) -> None:
    job = create(store, microbatches=3)
    a = claim(store, job)
    commit(store, a, 0)
    assert store.release(a, AttemptOutcome.PREEMPTED, "SIGTERM")
    b = claim(store, job)
    assert (b.cursor, b.epoch) == (1, 2)
    with pytest.raises(StoreError, match="next to commit is 1"):
        commit(store, b, 0)
    commit(store, b, 1)


def test_release_frees_the_shard_for_an_immediate_retry(store: ManifestStore) -> None:
    job = create(store)
    lease = claim(store, job)
    assert store.release(lease, AttemptOutcome.FAILED_RETRYABLE, "engine OOM")
    shard = store.get_shard(job.job_id, 0)
    assert (shard.state, shard.lease_attempt_id, shard.last_error) == (
        ShardState.RETRYABLE_FAILURE,
        None,
        "engine OOM",
    )
    assert not store.release(lease, AttemptOutcome.FAILED_RETRYABLE)
    assert claim(store, job).epoch == 2
    with pytest.raises(ValueError, match="complete_shard"):
        store.release(lease, AttemptOutcome.SUCCEEDED)


def test_terminal_failure_is_never_retried(store: ManifestStore) -> None:
    job = create(store)
    assert store.release(claim(store, job), AttemptOutcome.FAILED_TERMINAL, "model digest mismatch")
    assert store.get_shard(job.job_id, 0).state is ShardState.TERMINAL_FAILURE
    with pytest.raises(ShardNotClaimable, match="model digest mismatch") as err:
        claim(store, job)
    assert err.value.reason == "exhausted"


def test_only_deterministic_failures_without_progress_spend_max_attempts(store: ManifestStore) -> None:
    """docs/design.md §6.6: preemptions, lost leases, transient failures and tries that committed
    a microbatch never spend the budget; the shard fails for good naming the real cause."""
    job = create(store, max_attempts=2)
    for _ in range(3):  # more preemptions than max_attempts
        store.release(claim(store, job), AttemptOutcome.PREEMPTED)
    expired_claim(store, job)  # a lease that ran out: taken over, not spent
    for _ in range(3):
        assert store.fail_attempt(claim(store, job), "transient", "S3 unreachable") is (
            ShardState.RETRYABLE_FAILURE
        )
    progressed = claim(store, job)
    commit(store, progressed, 0)
    assert store.fail_attempt(progressed, "deterministic", "engine crashed") is ShardState.RETRYABLE_FAILURE
    assert store.get_shard(job.job_id, 0).failures == 0
    first = store.fail_attempt(claim(store, job), "deterministic", "ValueError: poison record")
    assert first is ShardState.RETRYABLE_FAILURE
    last = store.fail_attempt(claim(store, job), "deterministic", "ValueError: poison record")
    assert last is ShardState.TERMINAL_FAILURE
    shard = store.get_shard(job.job_id, 0)
    assert (shard.state, shard.failures, shard.attempts) == (ShardState.TERMINAL_FAILURE, 2, 10)
    assert shard.last_error is not None
    assert "max_attempts=2" in shard.last_error and "ValueError: poison record" in shard.last_error
    with pytest.raises(ShardNotClaimable, match="poison record") as err:
        claim(store, job)
    assert err.value.reason == "exhausted"
    classes = [a.failure_class for a in store.list_attempts(job.job_id)]
    assert classes.count("deterministic") == 3 and classes.count("transient") == 3
    assert claim(store, job, index=1).epoch == 1


def test_a_configuration_failure_stops_the_job_with_its_cause(store: ManifestStore) -> None:
    job = create(store)
    other = claim(store, job, index=1)
    assert store.fail_attempt(claim(store, job), "configuration", "model digest mismatch") is (
        ShardState.TERMINAL_FAILURE
    )
    stopped = store.get_job(job.job_id)
    assert stopped.state is JobState.FAILED
    assert stopped.error is not None and "model digest mismatch" in stopped.error
    with pytest.raises(LeaseLost, match="job is failed"):
        store.heartbeat(other, 30)


def test_cancel_stops_heartbeats_commits_and_claims(store: ManifestStore) -> None:
    job = create(store)
    lease = claim(store, job)
    cancelled = store.cancel_job(job.job_id)
    assert cancelled.state is JobState.CANCELLED and cancelled.completed_at is not None
    with pytest.raises(LeaseLost, match="job is cancelled"):
        store.heartbeat(lease, 30)
    with pytest.raises(LeaseLost, match="job is cancelled"):
        commit(store, lease, 0)
    with pytest.raises(ShardNotClaimable) as err:
        claim(store, job, index=1)
    assert err.value.reason == "job_inactive"
    assert store.cancel_job(job.job_id) == cancelled
    # the cancellation fenced the lease (epoch bumped, attempt ended): a late release is a no-op
    assert not store.release(lease, AttemptOutcome.ABANDONED, "job cancelled")
    shard = store.get_shard(job.job_id, 0)
    assert shard.epoch == lease.epoch + 1 and shard.lease_attempt_id is None
    assert [a.outcome for a in store.list_attempts(job.job_id)] == [AttemptOutcome.LOST_LEASE]


def test_cancel_of_a_finished_job_is_refused(store: ManifestStore) -> None:
    job = create(store)
    store.set_job_state(job.job_id, JobState.FINALIZING)
    store.record_manifest(job.job_id, uri="file:///m.json", sha256="c" * 64, state=JobState.COMPLETED)
    with pytest.raises(InvalidTransition):
        store.cancel_job(job.job_id)


def test_abandon_attempt_makes_the_shard_claimable_now(store: ManifestStore) -> None:
    job = create(store)
    lease = claim(store, job, ttl_s=300)
    assert store.abandon_attempt(job.job_id, 0, lease.attempt_id, "worker killed (SIGKILL)")
    assert not store.abandon_attempt(job.job_id, 0, lease.attempt_id, "again")
    [attempt] = store.list_attempts(job.job_id)
    assert (attempt.outcome, attempt.error) == (AttemptOutcome.ABANDONED, "worker killed (SIGKILL)")
    assert attempt.ended_at is not None
    fresh = claim(store, job)
    assert fresh.epoch == 2
    assert not store.abandon_attempt(job.job_id, 0, lease.attempt_id, "late")
    assert store.get_shard(job.job_id, 0).lease_attempt_id == fresh.attempt_id
    with pytest.raises(LeaseLost):
        commit(store, lease, 0)


# -- progress ---------------------------------------------------------------------------------------


def test_progress_counts_only_commits(store: ManifestStore) -> None:
    job = create(store, shards=2, microbatches=2, records_per_shard=4, invalid=1)
    start = store.progress(job.job_id)
    assert (start.total_records, start.committed_records, start.succeeded, start.errored) == (9, 1, 0, 1)
    assert (start.shards_total, start.shards_by_state, start.attempts) == (2, {"pending": 2}, 0)
    assert (start.committed_work_s, start.remaining_work_s) == (0.0, 40.0)

    a = claim(store, job, 0)
    b = claim(store, job, 1)
    claimed = store.progress(job.job_id)
    assert claimed.committed_records == 1 and claimed.attempts == 2  # attempts are not progress

    commit(store, a, 0, records=2, counts={"succeeded": 1, "errored": 1})
    store.release(a, AttemptOutcome.PREEMPTED)
    commit(store, b, 0, records=2, counts={"succeeded": 1, "errored": 1})
    commit(store, b, 1, records=2, counts={"succeeded": 1, "errored": 1})
    store.complete_shard(b)
    now = store.progress(job.job_id)
    assert (now.committed_records, now.succeeded, now.errored) == (7, 3, 4)
    assert now.shards_by_state == {"retryable_failure": 1, "succeeded": 1}
    assert (now.committed_work_s, now.remaining_work_s) == (30.0, 10.0)
    assert (now.attempts, now.preemptions) == (2, 1)
    assert now.state is JobState.RUNNING and now.deadline == DEADLINE
    assert now.updated_at >= start.updated_at and now.fraction == pytest.approx(7 / 9)


# -- PostgreSQL single-statement hot path ----------------------------------------------------------


def _hot_backend_pid(store: ManifestStore) -> int:
    """The server process behind the connection the store keeps for its single-statement hot path."""
    raw = store._hot_conn._raw  # noqa: SLF001 - that connection is what is under test
    assert raw is not None
    return int(raw.driver_connection.info.backend_pid)  # type: ignore[union-attr]


def test_hot_path_reconnects_when_the_server_drops_its_connection(
    pg_store_url: str, postgres_url: str
) -> None:
    store = ManifestStore.open(pg_store_url)
    try:
        job = create(store, shards=1)
        lease = claim(store, job)
        pid = _hot_backend_pid(store)
        admin_execute(postgres_url, f"SELECT pg_terminate_backend({pid})")
        wait_for(lambda: _server_has_no_backend(postgres_url, pid), what=f"backend {pid} to exit")
        lease = commit(store, lease, 0)  # runs on the dead pooled connection first, then retries
        lease = commit(store, lease, 1)
        store.complete_shard(lease)
        assert store.get_shard(job.job_id, 0).state is ShardState.SUCCEEDED
        assert [c.seq for c in store.list_commits(job.job_id)] == [0, 0, 1]
        assert _hot_backend_pid(store) != pid
    finally:
        store.close()


def _server_has_no_backend(postgres_url: str, pid: int) -> bool:
    import psycopg

    with psycopg.connect(postgres_url.replace("postgresql+psycopg://", "postgresql://", 1)) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == 0


def test_hot_path_hands_pooled_connections_back_in_transaction_mode(pg_store_url: str) -> None:
    store = ManifestStore.open(pg_store_url)
    try:
        job = create(store, shards=1, microbatches=1)
        lease = claim(store, job)
        lease = store.heartbeat(lease, 30.0)
        store.complete_shard(commit(store, lease, 0))
        with pytest.raises(ShardNotClaimable) as refused:  # the slow path after a fast miss
            claim(store, job)
        assert refused.value.reason == "succeeded"
        store._hot_conn.release()  # noqa: SLF001 - as close() does before disposing of the pool
        pool = store._engine.pool  # noqa: SLF001
        held = [pool.connect() for _ in range(pool.checkedin())]
        try:
            assert held and all(r.driver_connection.autocommit is False for r in held)  # type: ignore[union-attr]
        finally:
            for raw in held:
                raw.close()
    finally:
        store.close()


def test_unreachable_postgres_is_a_store_error_that_names_the_fix() -> None:
    store = ManifestStore("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    with pytest.raises(StoreError, match="check the --store URL"):  # after its retries (~3 s)
        store.claim_shard("j", 0, ttl_s=30.0, worker="w1")


# -- URLs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
        ("sqlite:///tmp/x.db", "sqlite:///tmp/x.db"),
    ],
)
def test_store_urls_are_normalized(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


@pytest.mark.parametrize("url", ["mysql://u@h/db", "/tmp/store.db"])
def test_unsupported_store_urls_name_the_fix(url: str) -> None:
    with pytest.raises(ConfigurationError, match="sqlite:///"):
        normalize_url(url)


def test_first_claim_moves_its_own_job_to_running_whatever_other_jobs_are(store: ManifestStore) -> None:
    # regression: on SQLite the claim read the state of the first job in the table, so a job
    # planned after a cancelled one stayed `admitted` for its whole run
    first = create(store)
    store.cancel_job(first.job_id)
    second = create(store)
    claim(store, second)
    assert store.get_job(second.job_id).state is JobState.RUNNING
    assert store.get_job(first.job_id).state is JobState.CANCELLED


# -- lease operations: every refusal, and the read-only diagnosis ---------------------------------


def test_a_shard_out_of_attempts_fails_terminally_from_retryable_failure(store: ManifestStore) -> None:
    """An unclassified ``failed_retryable`` release counts as deterministic (docs/design.md §6.6)."""
    job = create(store, max_attempts=1)
    assert store.release(claim(store, job), AttemptOutcome.FAILED_RETRYABLE, "engine OOM")
    cause = "failed 1 times without progress (max_attempts=1); last error: engine OOM"
    with pytest.raises(ShardNotClaimable, match=re.escape(cause)) as err:
        claim(store, job)
    assert err.value.reason == "exhausted"
    shard = store.get_shard(job.job_id, 0)
    assert (shard.state, shard.epoch, shard.last_error) == (ShardState.TERMINAL_FAILURE, 1, cause)
    [attempt] = store.list_attempts(job.job_id)
    assert (attempt.outcome, attempt.error) == (AttemptOutcome.FAILED_RETRYABLE, "engine OOM")
    assert attempt.failure_class == "deterministic"


def test_an_expired_lease_never_spends_the_budget(store: ManifestStore) -> None:
    job = create(store, max_attempts=1)
    lease = expired_claim(store, job)
    taken = claim(store, job)
    assert taken.epoch == lease.epoch + 1
    attempts_ = {a.attempt_id: a for a in store.list_attempts(job.job_id)}
    assert attempts_[lease.attempt_id].outcome is AttemptOutcome.LOST_LEASE
    with pytest.raises(LeaseLost, match=r"fenced by epoch 2"):
        store.heartbeat(lease, 30)


def test_take_over_ends_the_expired_attempt_as_lost_lease(store: ManifestStore) -> None:
    job = create(store)
    a = expired_claim(store, job)
    b = claim(store, job, worker="w2")
    outcomes = {x.attempt_id: (x.outcome, x.error) for x in store.list_attempts(job.job_id)}
    assert outcomes == {
        a.attempt_id: (AttemptOutcome.LOST_LEASE, "lease expired; taken over at epoch 2"),
        b.attempt_id: (AttemptOutcome.RUNNING, None),
    }
    assert store.get_job(job.job_id).state is JobState.RUNNING


def test_a_finished_lease_is_refused_as_such(store: ManifestStore) -> None:
    job = create(store, microbatches=1)
    lease = claim(store, job)
    commit(store, lease, 0)
    store.complete_shard(lease)
    with pytest.raises(LeaseLost, match="shard is succeeded"):
        store.heartbeat(lease, 30)
    with pytest.raises(LeaseLost, match="shard is succeeded"):
        commit(store, lease, 1)
    with pytest.raises(LeaseLost, match="shard is succeeded"):
        store.complete_shard(lease)
    [attempt] = store.list_attempts(job.job_id)
    assert attempt.outcome is AttemptOutcome.SUCCEEDED


def test_lease_operations_on_a_missing_shard_or_job(store: ManifestStore) -> None:
    job = create(store)
    with pytest.raises(StoreError, match="has no shard 7"):
        claim(store, job, index=7)
    ghost = Lease(
        job_id=job.job_id,
        shard_index=7,
        attempt_id="a-x",
        epoch=1,
        expires_at=0.0,
        cursor=0,
        num_microbatches=1,
    )
    with pytest.raises(StoreError, match="has no shard 7"):
        store.heartbeat(ghost, 30)
    with pytest.raises(JobNotFound):
        store.complete_shard(dataclasses.replace(ghost, job_id="j-missing"))


def test_the_diagnosis_finds_no_reason_while_the_lease_is_good(store: ManifestStore) -> None:
    """The refusal functions mirror the statements' WHERE clauses: a state they would accept is no refusal."""
    job = create(store, microbatches=2)
    assert leases.claim_refusal(store._snapshot(job.job_id, 0)) is None  # noqa: SLF001 - pending
    lease = claim(store, job)
    snap = store._snapshot(job.job_id, 0)  # noqa: SLF001
    assert leases.lease_refusal(snap, lease) is None
    assert leases.commit_refusal(snap, lease, 0) is None
    assert isinstance(leases.commit_refusal(snap, lease, 1), StoreError)
    assert isinstance(leases.complete_refusal(snap, lease), StoreError)
    commit(store, lease, 0)
    commit(store, lease, 1)
    assert leases.complete_refusal(store._snapshot(job.job_id, 0), lease) is None  # noqa: SLF001
    expired = expired_claim(store, job, index=1)
    assert leases.claim_refusal(store._snapshot(job.job_id, 1)) is None  # noqa: SLF001 - expired: claimable
    assert isinstance(leases.lease_refusal(store._snapshot(job.job_id, 1), expired), LeaseLost)  # noqa: SLF001


def test_a_refusal_without_a_reason_is_retried_then_reported(
    store: ManifestStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = create(store)
    a = expired_claim(store, job)
    claim(store, job, worker="w2")
    diagnosed: list[Lease] = []

    def no_reason(snap: leases.ShardSnapshot, lease: Lease) -> None:
        diagnosed.append(lease)

    monkeypatch.setattr(leases, "lease_refusal", no_reason)
    with pytest.raises(StoreError, match="heartbeat matched nothing 3 times") as err:
        store.heartbeat(a, 30)
    assert not isinstance(err.value, LeaseLost) and len(diagnosed) == RACE_TRIES


def test_the_transaction_form_of_each_operation_runs_on_postgresql_too(
    pg_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's form (the UPDATE, then its bookkeeping in one transaction) is the same definition."""
    store = ManifestStore.open(pg_store_url)
    try:
        monkeypatch.setattr(store, "_hot_conn", None)
        job = create(store, microbatches=1, max_attempts=2)
        a = expired_claim(store, job)
        b = claim(store, job, worker="w2")
        with pytest.raises(LeaseLost, match="fenced by epoch 2"):
            commit(store, a, 0)
        store.heartbeat(b, 30)
        store.complete_shard(commit(store, b, 0))
        assert store.get_shard(job.job_id, 0).state is ShardState.SUCCEEDED
        assert [x.outcome for x in store.list_attempts(job.job_id)] == [
            AttemptOutcome.LOST_LEASE,
            AttemptOutcome.SUCCEEDED,
        ]
        assert store.release(claim(store, job, index=1), AttemptOutcome.PREEMPTED)
        assert store.release(claim(store, job, index=1), AttemptOutcome.PREEMPTED)
        claim(store, job, index=1)  # preemptions never spend the budget (docs/design.md §6.6)
        # EXHAUST: a claimable shard whose budget is already spent (say, max_attempts lowered)
        engine = sa.create_engine(pg_store_url)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE adb_shards SET failures = 2, state = 'retryable_failure' WHERE shard_index = 1"
                )
            )
        engine.dispose()
        with pytest.raises(ShardNotClaimable, match="max_attempts=2"):
            claim(store, job, index=1)
    finally:
        store.close()


# -- PostgreSQL: the held autocommit connection ----------------------------------------------------


def test_a_busy_held_connection_lends_the_call_a_pooled_one(pg_store_url: str) -> None:
    store = ManifestStore.open(pg_store_url)
    try:
        job = create(store, shards=1)
        lease = claim(store, job)
        hot = store._hot_conn  # noqa: SLF001
        assert hot is not None
        with hot._lock:  # noqa: SLF001 - as if the heartbeat thread were using it
            lease = store.heartbeat(lease, 30)
            with pytest.raises(StoreError, match="invalid input syntax"):  # and after an error
                store.heartbeat(dataclasses.replace(lease, epoch="x"), 30)  # type: ignore[arg-type]
            lease = commit(store, lease, 0)
        pool = store._engine.pool  # noqa: SLF001
        held = [pool.connect() for _ in range(pool.checkedin())]
        try:
            assert held and all(r.driver_connection.autocommit is False for r in held)  # type: ignore[union-attr]
        finally:
            for raw in held:
                raw.close()
        assert commit(store, lease, 1).cursor == 2
    finally:
        store.close()


def test_a_held_connection_that_fails_is_replaced(pg_store_url: str) -> None:
    store = ManifestStore.open(pg_store_url)
    try:
        job = create(store, shards=1)
        lease = claim(store, job)
        pid = _hot_backend_pid(store)
        with pytest.raises(StoreError, match="invalid input syntax"):  # not transient: not retried
            store.heartbeat(dataclasses.replace(lease, epoch="x"), 30)  # type: ignore[arg-type]
        assert store.heartbeat(lease, 30).epoch == lease.epoch
        assert _hot_backend_pid(store) != pid
    finally:
        store.close()


def test_an_idle_held_connection_goes_back_to_the_pool_first(pg_store_url: str) -> None:
    store = ManifestStore.open(pg_store_url)
    try:
        job = create(store, shards=1)
        lease = claim(store, job)
        hot = store._hot_conn  # noqa: SLF001
        assert hot is not None
        first = hot._raw  # noqa: SLF001
        hot._used_at -= PING_AFTER_IDLE_S + 1  # noqa: SLF001
        store.heartbeat(lease, 30)
        assert hot._raw is not None and hot._raw is not first  # noqa: SLF001 - a fresh checkout
    finally:
        store.close()


def _heartbeat_in_child(store: ManifestStore, lease: Lease) -> None:
    store.heartbeat(lease, 30)  # on its own connection, not the parent's
    store.close()


def test_a_forked_child_leaves_the_parents_held_connection_alone(pg_store_url: str) -> None:
    store = ManifestStore.open(pg_store_url)
    try:
        job = create(store, shards=1)
        lease = claim(store, job)
        pid = _hot_backend_pid(store)
        child = mp.get_context("fork").Process(target=_heartbeat_in_child, args=(store, lease))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert _hot_backend_pid(store) == pid
        assert commit(store, store.heartbeat(lease, 30), 0).cursor == 1
    finally:
        store.close()


def test_statements_that_need_rendering_per_execution_are_refused() -> None:
    from sqlalchemy.dialects import postgresql

    from airflow_deadline_batch.store.schema import jobs

    with pytest.raises(ValueError, match="per-execution"):
        DriverStatement.compile(
            sa.select(jobs.c.job_id).where(jobs.c.state.in_(["a", "b"])), postgresql.dialect()
        )
