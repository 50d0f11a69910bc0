"""The manifest store: jobs, shards, attempts, leases and fenced commits, on SQLite or PostgreSQL.

Every public method is one transaction; a refused lease operation is its one statement, then a
read-only transaction that names the reason (store/leases.py). Lease time comes from the database
clock (``db_epoch()``), never from the caller's. On SQLite every write transaction starts with
``BEGIN IMMEDIATE`` and so runs alone; on PostgreSQL claim, heartbeat, commit and complete are
each one statement in autocommit mode, and the other writes lock their rows ``FOR UPDATE``.

Row-lock order: lease operations and releases lock shard → attempt → job; job-state changes lock
the job, then its unfinished shards, then their attempts. The two orders meet only when the first
claim of an admitted job (shard, then job) races a state change of that job (job, then shard):
PostgreSQL then detects the deadlock and aborts one of them, which the retry wrapper
(``store/engine.py``, SQLSTATE 40P01) runs again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.calibration import PoolHistory
from airflow_deadline_batch.core.dispatch import check_request
from airflow_deadline_batch.core.failures import FailureClass, spends_budget
from airflow_deadline_batch.core.ids import (
    check_idempotency_key,
    new_attempt_id,
    new_job_id,
    released_key,
    shard_id,
)
from airflow_deadline_batch.core.job_view import shard_done_fraction
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import (
    TERMINAL_JOB_STATES,
    TERMINAL_SHARD_STATES,
    AttemptOutcome,
    JobState,
    ShardState,
    check_attempt_transition,
    check_job_transition,
    check_shard_transition,
    is_preemption,
    shard_state_after,
)
from airflow_deadline_batch.exceptions import (
    InvalidTransition,
    JobNotFound,
    LeaseLost,
    StoreError,
)
from airflow_deadline_batch.store import dispatch, leases, pool_stats, tenancy, throughput
from airflow_deadline_batch.store.engine import (
    BEGIN_MODE,
    DEFAULT_BUDGET,
    PING_AFTER_IDLE_S,
    AutocommitConnection,
    StoreBudget,
    create_store_engine,
    fork_safe,
    run_with_retry,
)
from airflow_deadline_batch.store.leases import ACTIVE_JOB_STATES
from airflow_deadline_batch.store.placement_rows import PlacementRows, read_placement_rows
from airflow_deadline_batch.store.rows import (
    DEFAULT_MAX_ATTEMPTS,
    VALIDATION_ATTEMPT_ID,
    VALIDATION_SHARD_INDEX,
    AttemptRow,
    CommitRow,
    DispatchGrantRow,
    DispatchRow,
    JobRow,
    JobRows,
    Lease,
    NewCommit,
    NewJob,
    NewShard,
    PoolCapacityRow,
    Progress,
    ShardRow,
    TenantQuotaRow,
    UsageRow,
)
from airflow_deadline_batch.store.schema import (
    attempts,
    commits,
    db_epoch,
    jobs,
    shards,
)
from airflow_deadline_batch.store.throughput import MeasuredRate

T = TypeVar("T")
UTC = dt.timezone.utc
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
#: pg_advisory_xact_lock key that serializes concurrent migrate() calls ("adb_migr")
MIGRATION_LOCK_KEY = 0x6164625F6D696772
#: job IDs one statement of ``rows_of_jobs`` names at most (SQLite's bound parameters are limited)
ROWS_OF_JOBS_CHUNK = 500
#: a refused lease operation whose read-only diagnosis finds no reason (the row changed in between)
#: is tried again, at most this many times in all
RACE_TRIES = 3
#: the attempt outcome a failure class ends a try with, unless the caller names another
OUTCOME_OF_FAILURE: Mapping[FailureClass, AttemptOutcome] = {
    FailureClass.PREEMPTED: AttemptOutcome.PREEMPTED,
    FailureClass.TRANSIENT: AttemptOutcome.FAILED_RETRYABLE,
    FailureClass.DETERMINISTIC: AttemptOutcome.FAILED_RETRYABLE,
    FailureClass.CONFIGURATION: AttemptOutcome.FAILED_TERMINAL,
}


def _granted_lease(job_id: str, shard_index: int, attempt_id: str, granted: Mapping[str, Any]) -> Lease:
    """The lease a claim (or a racing claim) returned: epoch, expiry, cursor and microbatches."""
    return Lease(
        job_id=job_id,
        shard_index=shard_index,
        attempt_id=attempt_id,
        epoch=granted["epoch"],
        expires_at=granted["lease_expires_at"],
        cursor=granted["cursor"],
        num_microbatches=granted["num_microbatches"],
    )


def _claim_params(
    job_id: str, shard_index: int, attempt_id: str, *, ttl_s: float, worker: str, pool: str | None
) -> dict[str, Any]:
    """The bound parameters of a claim (or a racing claim) of a fresh attempt."""
    return {
        "b_job": job_id,
        "b_index": shard_index,
        "b_attempt": attempt_id,
        "b_ttl": float(ttl_s),
        "b_pool": pool,
        "b_worker": worker,
    }


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {
        "b_job": lease.job_id,
        "b_index": lease.shard_index,
        "b_epoch": lease.epoch,
        "b_attempt": lease.attempt_id,
    }


def _ts(epoch_s: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, UTC)


def _shard_key(job_id: str, shard_index: int) -> sa.ColumnElement[bool]:
    return sa.and_(shards.c.job_id == job_id, shards.c.shard_index == shard_index)


def _no_such_shard(job_id: str, shard_index: int) -> StoreError:
    # a configuration error (core.failures reads ``failure``): no retry of this try can find the
    # shard, so a worker exits 1 (terminal) instead of 75
    return StoreError(
        f"job {job_id} has no shard {shard_index}; check the shard index",
        job_id=job_id,
        shard_index=shard_index,
        failure="configuration",
    )


class ManifestStore:
    """Durable job/shard/attempt state with fenced, exactly-once microbatch commits.

    ``url`` is ``sqlite:///path.db`` (the embedded default) or ``postgresql+psycopg://...``.
    Call :meth:`migrate` (or use :meth:`open`) once before use. ``budget`` bounds how long a call
    waits for the database and how often it is tried (``store/engine.py``); the default is the
    workers' and operators', which ride out a restart or a fail-over.
    """

    def __init__(self, url: str, *, budget: StoreBudget = DEFAULT_BUDGET) -> None:
        self._engine = create_store_engine(url, budget)
        self._attempts = budget.attempts
        self.url = self._engine.url.render_as_string(hide_password=True)
        self.dialect = self._engine.dialect.name
        self._writer = self._engine.execution_options(**{BEGIN_MODE: "IMMEDIATE"})
        # Reads that span several statements (progress) see one snapshot.
        self._reader = (
            self._engine.execution_options(isolation_level="REPEATABLE READ")
            if self.dialect == "postgresql"
            else self._engine
        )
        self._pid = os.getpid()
        #: PostgreSQL runs claim, heartbeat, commit and complete as single statements, on this connection
        self._hot_conn = (
            AutocommitConnection(self._engine, PING_AFTER_IDLE_S, (op.combined for op in leases.OPERATIONS))
            if self.dialect == "postgresql"
            else None
        )

    @classmethod
    def open(cls, url: str, *, migrate: bool = True) -> ManifestStore:
        """A store on ``url``, migrated to the latest schema unless ``migrate=False``."""
        store = cls(url)
        if migrate:
            store.migrate()
        return store

    def close(self) -> None:
        """Close pooled connections (the store stays usable; it reconnects on the next call)."""
        self._check_fork()
        if self._hot_conn is not None:
            self._hot_conn.release()
        self._engine.dispose()

    def __repr__(self) -> str:
        return f"ManifestStore({self.url!r})"

    # -- plumbing ---------------------------------------------------------------------------------

    def _tx(
        self,
        fn: Callable[[Connection], T],
        *,
        write: bool = True,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        self._check_fork()
        engine = self._writer if write else self._reader

        def attempt() -> T:
            with engine.begin() as conn:
                return fn(conn)

        return run_with_retry(attempt, passthrough=passthrough, url=self.url, attempts=self._attempts)

    def _check_fork(self) -> None:
        """After ``fork()`` leave the parent's connections alone and open our own."""
        if os.getpid() != self._pid:
            if self._hot_conn is not None:
                self._hot_conn.forget()
            self._pid = fork_safe(self._engine, self._pid)

    @staticmethod
    def _now(conn: Connection) -> float:
        return float(conn.execute(sa.select(db_epoch())).scalar_one())

    def db_time(self) -> float:
        """The database clock, in seconds since the Unix epoch (the clock leases are measured on)."""
        return self._tx(self._now, write=False)

    def migrate(self) -> None:
        """Upgrade the schema to the latest revision; idempotent and safe to run concurrently."""
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))

        def upgrade(conn: Connection) -> None:
            if conn.dialect.name == "postgresql":
                # Two processes migrating at once would both try CREATE TABLE; the lock queues them.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            config.attributes["connection"] = conn
            command.upgrade(config, "head")

        self._tx(upgrade)

    def schema_revision(self) -> str | None:
        """The applied Alembic revision, or None for an empty database."""
        from alembic.runtime.migration import MigrationContext

        from airflow_deadline_batch.store.schema import VERSION_TABLE

        def read(conn: Connection) -> str | None:
            return MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE}
            ).get_current_revision()

        return self._tx(read, write=False)

    # -- jobs -------------------------------------------------------------------------------------

    @staticmethod
    def _job_or_none(conn: Connection, job_id: str, *, lock: bool = False) -> JobRow | None:
        query = sa.select(jobs).where(jobs.c.job_id == job_id)
        row = conn.execute(query.with_for_update() if lock else query).first()
        return JobRow.from_row(row) if row is not None else None

    def _job(self, conn: Connection, job_id: str, *, lock: bool = False) -> JobRow:
        job = self._job_or_none(conn, job_id, lock=lock)
        if job is None:
            raise JobNotFound(
                f"no job {job_id!r} in the manifest store {self.url}; check the job ID and --store URL",
                job_id=job_id,
            )
        return job

    @staticmethod
    def _job_by_key(conn: Connection, key: str) -> JobRow | None:
        row = conn.execute(sa.select(jobs).where(jobs.c.idempotency_key == key)).first()
        return JobRow.from_row(row) if row is not None else None

    def create_job(
        self,
        job: NewJob,
        shards_: Sequence[NewShard] = (),
        validation: NewCommit | None = None,
        *,
        admit: Callable[[tenancy.TenancySnapshot], Mapping[str, Any] | None] | None = None,
    ) -> tuple[JobRow, bool]:
        """Record a job with its shards (and the planner's validation-errors object) in one transaction.

        With an ``idempotency_key`` already known, return ``(existing job, False)`` and write
        nothing, also when two submissions race (docs/design.md §4.5 invariant 6). A rejected job
        does not hold its key: it is recorded under :func:`~airflow_deadline_batch.core.ids.released_key`
        (``<key>#rejected-<job_id>``), so resubmitting the key runs admission afresh, while the unique
        index still lets only one live job have the key.

        ``admit`` decides admission against shared capacity and the tenant's quota (docs/tenants.md)
        inside this transaction, with admissions serialized: it reads the snapshot and returns None
        to record the job as planned, or the admission report of a refusal, recorded as a
        ``rejected`` job without shards (the caller sees the state of the returned job).
        """
        _check_new_job(job, shards_, validation)
        job_id = job.job_id or new_job_id()

        def insert(conn: Connection) -> tuple[JobRow, bool]:
            if admit is not None:
                tenancy.lock_admissions(conn)
            if job.idempotency_key is not None:
                existing = self._job_by_key(conn, job.idempotency_key)
                if existing is not None and existing.state is not JobState.REJECTED:
                    return existing, False
                if existing is not None:  # rejected before keys were released: release it now
                    self._release_key(conn, existing)
            now = _ts(self._now(conn))
            refusal = admit(tenancy.read_snapshot(conn, job.tenant, now)) if admit is not None else None
            if refusal is not None:
                return self._insert_job(conn, job_id, job, now, JobState.REJECTED, refusal), True
            self._insert_job(conn, job_id, job, now, job.state, job.admission)
            if shards_:
                conn.execute(sa.insert(shards), [_shard_values(job_id, s, now) for s in shards_])
            if validation is not None:
                conn.execute(
                    sa.insert(commits).values(
                        job_id=job_id,
                        shard_index=VALIDATION_SHARD_INDEX,
                        seq=0,
                        attempt_id=VALIDATION_ATTEMPT_ID,
                        epoch=0,
                        committed_at=now,
                        **_commit_values(validation),
                    )
                )
            return self._job(conn, job_id), True

        try:
            return self._tx(insert, passthrough=(sa.exc.IntegrityError,))
        except sa.exc.IntegrityError as exc:
            # A concurrent create with the same key won the unique index: return its job.
            if job.idempotency_key is not None:
                key = job.idempotency_key
                existing = self._tx(lambda conn: self._job_by_key(conn, key), write=False)
                if existing is not None:
                    return existing, False
            raise StoreError(
                f"job {job_id!r} could not be created ({str(exc.orig).splitlines()[0]}); "
                "a job with this ID already exists: omit job_id to generate one",
                job_id=job_id,
            ) from exc

    @staticmethod
    def _release_key(conn: Connection, job: JobRow) -> None:
        assert job.idempotency_key is not None
        conn.execute(
            sa.update(jobs)
            .where(jobs.c.job_id == job.job_id)
            .values(idempotency_key=released_key(job.idempotency_key, job.job_id))
        )

    def _insert_job(
        self,
        conn: Connection,
        job_id: str,
        job: NewJob,
        now: dt.datetime,
        state: JobState,
        admission: Mapping[str, Any] | None,
    ) -> JobRow:
        conn.execute(
            sa.insert(jobs).values(
                job_id=job_id,
                idempotency_key=(
                    released_key(job.idempotency_key, job_id)
                    if state is JobState.REJECTED and job.idempotency_key is not None
                    else job.idempotency_key
                ),
                state=state.value,
                created_at=now,
                updated_at=now,
                deadline=job.deadline,
                input_uri=job.input_uri,
                input_sha256=job.input_sha256,
                input_lines=job.input_lines,
                input_total_lines=job.input_total_lines,
                output_uri=job.output_uri,
                max_attempts=int(job.config.get("max_attempts") or DEFAULT_MAX_ATTEMPTS),
                config=dict(job.config),
                admission=dict(admission) if admission is not None else None,
                completed_at=now if state is JobState.REJECTED else None,
                tenant=job.tenant,
            )
        )
        return self._job(conn, job_id)

    def get_job(self, job_id: str) -> JobRow:
        """The job, or :class:`JobNotFound`."""
        return self._tx(lambda conn: self._job(conn, job_id), write=False)

    def get_job_by_idempotency_key(self, key: str) -> JobRow | None:
        """The job submitted with ``key``, or None (lets a planner skip work for a repeated submission).

        A rejected job gives its key up (``create_job``), so this finds no job rejected since keys
        are released; one rejected before may still be found.
        """
        return self._tx(lambda conn: self._job_by_key(conn, key), write=False)

    def list_jobs(self, limit: int = 50) -> list[JobRow]:
        """The most recently created jobs first."""
        query = sa.select(jobs).order_by(jobs.c.created_at.desc(), jobs.c.job_id).limit(limit)
        return self._tx(lambda conn: [JobRow.from_row(r) for r in conn.execute(query)], write=False)

    def _set_job_state(
        self,
        conn: Connection,
        job: JobRow,
        to: JobState,
        *,
        error: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> JobRow:
        check_job_transition(job.state, to, job_id=job.job_id)
        if to not in ACTIVE_JOB_STATES and job.state in ACTIVE_JOB_STATES:
            self._fence_unfinished_shards(conn, job.job_id)
        now = _ts(self._now(conn))
        values: dict[str, Any] = {"state": to.value, "updated_at": now, **(extra or {})}
        if error is not None:
            values["error"] = error
        if to in TERMINAL_JOB_STATES:
            values["completed_at"] = now
        conn.execute(sa.update(jobs).where(jobs.c.job_id == job.job_id).values(**values))
        return self._job(conn, job.job_id)

    def _fence_unfinished_shards(self, conn: Connection, job_id: str) -> None:
        """Bump the epoch of every unfinished shard, in the transaction that deactivates the job.

        A commit statement already in flight either finished before this update (and is seen by
        whoever reads the commits next) or re-checks its row after it and finds a newer epoch: a
        job that left the running state can take no late commit, on PostgreSQL's READ COMMITTED
        as on SQLite's serialized writers.
        """
        now = self._now(conn)
        rows = conn.execute(
            sa.select(
                shards.c.shard_index, shards.c.lease_attempt_id, shards.c.race_attempt_id, shards.c.state
            )
            .where(shards.c.job_id == job_id, shards.c.state != ShardState.SUCCEEDED.value)
            .with_for_update()
        ).all()
        for row in rows:
            values: dict[str, Any] = {
                "epoch": shards.c.epoch + 1,
                "lease_attempt_id": None,
                "lease_expires_at": None,
                "updated_at": _ts(now),
                **leases.NO_RACE,
            }
            if row.state == ShardState.LEASED.value:
                values["state"] = ShardState.RETRYABLE_FAILURE.value
            conn.execute(sa.update(shards).where(_shard_key(job_id, row.shard_index)).values(**values))
            for attempt_id in (row.lease_attempt_id, row.race_attempt_id):
                self._end_attempt(
                    conn, attempt_id, AttemptOutcome.LOST_LEASE, now, "fenced: the job left the running state"
                )

    def set_job_state(
        self,
        job_id: str,
        to: JobState | str,
        *,
        expected: Collection[JobState | str] | None = None,
        error: str | None = None,
    ) -> JobRow:
        """Compare-and-set the job state; :class:`InvalidTransition` if not in ``expected`` or not allowed."""
        target = JobState(to)
        wanted = None if expected is None else {JobState(s) for s in expected}

        def change(conn: Connection) -> JobRow:
            job = self._job(conn, job_id, lock=True)
            if wanted is not None and job.state not in wanted:
                raise InvalidTransition(
                    f"job {job_id} is {job.state.value}, not {' or '.join(sorted(s.value for s in wanted))};"
                    " another process changed it first: re-read the job",
                    job_id=job_id,
                    source=job.state.value,
                    target=target.value,
                )
            return self._set_job_state(conn, job, target, error=error)

        return self._tx(change)

    def cancel_job(self, job_id: str, *, reason: str | None = None) -> JobRow:
        """Cancel the job; live leases then fail on their next heartbeat or commit.

        ``reason`` (why, who asked) becomes the job's ``error``, which progress and status show.
        """

        def cancel(conn: Connection) -> JobRow:
            job = self._job(conn, job_id, lock=True)
            if job.state is JobState.CANCELLED:
                return job
            return self._set_job_state(conn, job, JobState.CANCELLED, error=reason)

        return self._tx(cancel)

    def record_manifest(self, job_id: str, *, uri: str, sha256: str, state: JobState | str) -> JobRow:
        """Record the published manifest and the job's final state, once (a repeat of the same is a no-op)."""
        final = JobState(state)

        def record(conn: Connection) -> JobRow:
            job = self._job(conn, job_id, lock=True)
            if job.manifest_uri is not None:
                if (job.manifest_uri, job.manifest_sha256, job.state) == (uri, sha256, final):
                    return job
                raise InvalidTransition(
                    f"job {job_id} already has manifest {job.manifest_uri} ({job.state.value}); "
                    "a manifest is recorded once and never replaced",
                    job_id=job_id,
                )
            extra = {"manifest_uri": uri, "manifest_sha256": sha256}
            if job.state is final and final is JobState.CANCELLED:
                # a cancelled job is already final: its manifest of cancelled outcomes is recorded
                # without a state change
                now = _ts(self._now(conn))
                conn.execute(sa.update(jobs).where(jobs.c.job_id == job_id).values(updated_at=now, **extra))
                return self._job(conn, job_id)
            return self._set_job_state(conn, job, final, extra=extra)

        return self._tx(record)

    # -- shards -----------------------------------------------------------------------------------

    def _lock_shard(self, conn: Connection, job_id: str, shard_index: int) -> tuple[ShardRow, float]:
        """The shard row, locked for this transaction, and the database clock."""
        query = sa.select(shards, db_epoch().label("db_now")).where(_shard_key(job_id, shard_index))
        row = conn.execute(query.with_for_update(of=shards)).first()
        if row is None:
            self._job(conn, job_id)
            raise _no_such_shard(job_id, shard_index)
        return ShardRow.from_row(row), float(row.db_now)

    def get_shard(self, job_id: str, shard_index: int) -> ShardRow:
        """One shard (StoreError if the job has no such shard, JobNotFound if no such job)."""

        def read(conn: Connection) -> ShardRow:
            row = conn.execute(sa.select(shards).where(_shard_key(job_id, shard_index))).first()
            if row is None:
                self._job(conn, job_id)
                raise _no_such_shard(job_id, shard_index)
            return ShardRow.from_row(row)

        return self._tx(read, write=False)

    def list_shards(self, job_id: str) -> list[ShardRow]:
        """All shards of a job by index (JobNotFound if no such job)."""

        def read(conn: Connection) -> list[ShardRow]:
            self._job(conn, job_id)
            query = sa.select(shards).where(shards.c.job_id == job_id).order_by(shards.c.shard_index)
            return [ShardRow.from_row(r) for r in conn.execute(query)]

        return self._tx(read, write=False)

    # -- leases -----------------------------------------------------------------------------------
    # Each method below is a list of steps: run the operation's one conditional statement
    # (store/leases.py); if it matched nothing, read the rows and raise the reason it names.

    def claim_shard(
        self, job_id: str, shard_index: int, *, ttl_s: float, worker: str, pool: str | None = None
    ) -> Lease:
        """Take the shard's lease with a fresh attempt and a bumped epoch (the fencing token).

        Raises :class:`ShardNotClaimable` with ``reason`` ``succeeded`` (already committed: a no-op
        success for the caller), ``leased`` (a live lease is held; ``seconds_left``), ``exhausted``
        (out of attempts, or failed terminally) or ``job_inactive``.
        """
        attempt_id = new_attempt_id()
        params = _claim_params(job_id, shard_index, attempt_id, ttl_s=ttl_s, worker=worker, pool=pool)

        def refuse() -> StoreError | None:
            # out of attempts: record the terminal failure (a refusal that writes, never a success)
            spent = self._run_lease_statement(leases.EXHAUST, params)
            if spent is not None:
                return leases.exhausted(job_id, shard_index, spent["last_error"])
            return leases.claim_refusal(self._snapshot(job_id, shard_index))

        claimed = self._fenced(
            (leases.CLAIM, leases.TAKE_OVER), params, refuse, job_id=job_id, shard_index=shard_index
        )
        return _granted_lease(job_id, shard_index, attempt_id, claimed)

    def claim_race(
        self, job_id: str, shard_index: int, *, ttl_s: float, worker: str, pool: str | None = None
    ) -> Lease:
        """A racing lease beside the shard's live lease: a speculative attempt at the tail (issue 13).

        Granted only while the shard is LEASED with a live primary lease, no live racer and
        microbatches left, in an active job; the epoch is not bumped. The racer resumes at the
        cursor; heartbeat, commit and complete take its lease as they take the primary's, and the
        first of the two to commit a microbatch wins it (:meth:`commit_microbatch`). Raises
        :class:`ShardNotClaimable` with the reason of :func:`leases.race_refusal`.
        """
        attempt_id = new_attempt_id()
        params = _claim_params(job_id, shard_index, attempt_id, ttl_s=ttl_s, worker=worker, pool=pool)
        raced = self._fenced(
            (leases.CLAIM_RACE,),
            params,
            lambda: leases.race_refusal(self._snapshot(job_id, shard_index)),
            job_id=job_id,
            shard_index=shard_index,
        )
        return _granted_lease(job_id, shard_index, attempt_id, raced)

    def heartbeat(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend the lease to ``db_now + ttl_s``; :class:`LeaseLost` if fenced, expired or job inactive."""
        params = {**_lease_params(lease), "b_ttl": float(ttl_s)}
        beat = self._fenced(
            (leases.HEARTBEAT, leases.HEARTBEAT_RACE),
            params,
            lambda: leases.lease_refusal(self._snapshot(lease.job_id, lease.shard_index), lease),
            job_id=lease.job_id,
            shard_index=lease.shard_index,
        )
        return dataclasses.replace(lease, expires_at=beat["lease_expires_at"], cursor=beat["cursor"])

    def commit_microbatch(
        self,
        lease: Lease,
        *,
        seq: int,
        uri: str,
        sha256: str,
        records: int,
        counts: dict[str, int],
        prompt_tokens: int,
        completion_tokens: int,
        elapsed_s: float,
        model_digest: str | None,
        pool: str | None = None,
    ) -> Lease:
        """Commit microbatch ``seq`` (must equal the shard's cursor) under the lease, and extend the lease.

        :class:`LeaseLost` when fenced or expired; :class:`StoreError` for a duplicate or
        out-of-order ``seq`` (``expected_seq`` the cursor: an attempt whose rival of a race
        committed ahead of it and then ended resumes there). In a race whose rival is live, a
        ``seq`` the rival committed first loses the race: the attempt ends as ``lost_race`` (no
        failure, no budget spent) and :class:`LeaseLost` with ``lost_race=True`` is raised.
        Returns the extended lease (callers may ignore it).
        """
        params = {
            **_lease_params(lease),
            "b_seq": seq,
            "b_uri": uri,
            "b_sha256": sha256,
            "b_records": records,
            "b_counts": {str(k): int(v) for k, v in counts.items()},
            "b_prompt_tokens": prompt_tokens,
            "b_completion_tokens": completion_tokens,
            "b_elapsed_s": float(elapsed_s),
            "b_model_digest": model_digest,
            "b_pool": pool,
        }

        def refuse() -> StoreError | None:
            snap = self._snapshot(lease.job_id, lease.shard_index)
            if leases.lost_race(snap, lease, seq) and self._tx(
                lambda conn: self._lose_race(conn, lease, seq)
            ):
                return LeaseLost(
                    f"shard {lease.shard_id} of job {lease.job_id}: attempt {lease.attempt_id} lost the "
                    f"race: microbatch {seq} was committed first by the other attempt; stop and exit",
                    job_id=lease.job_id,
                    shard_index=lease.shard_index,
                    attempt_id=lease.attempt_id,
                    epoch=lease.epoch,
                    lost_race=True,
                )
            return leases.commit_refusal(snap, lease, seq)

        committed = self._fenced(
            (leases.COMMIT, leases.COMMIT_RACE),
            params,
            refuse,
            job_id=lease.job_id,
            shard_index=lease.shard_index,
        )
        return dataclasses.replace(lease, expires_at=committed["lease_expires_at"], cursor=seq + 1)

    def _lose_race(self, conn: Connection, lease: Lease, seq: int) -> bool:
        """End ``lease``'s attempt as ``lost_race`` if, under the shard's row lock, it still lost it."""
        shard, now = self._lock_shard(conn, lease.job_id, lease.shard_index)
        snap = leases.ShardSnapshot(shard=shard, job_state=self._job(conn, lease.job_id).state, db_now=now)
        if not leases.lost_race(snap, lease, seq):
            return False
        rival = leases.live_rival(snap, lease)
        self._end_lease(
            conn,
            lease.job_id,
            lease.shard_index,
            lease.attempt_id,
            lease.epoch,
            AttemptOutcome.LOST_RACE,
            f"lost the race: microbatch {seq} was committed first by {rival}",
        )
        return True

    def complete_shard(self, lease: Lease) -> None:
        """Mark the shard succeeded; needs every microbatch committed and the live lease."""
        self._fenced(
            (leases.COMPLETE, leases.COMPLETE_RACED),
            _lease_params(lease),
            lambda: leases.complete_refusal(self._snapshot(lease.job_id, lease.shard_index), lease),
            job_id=lease.job_id,
            shard_index=lease.shard_index,
        )

    def _fenced(
        self,
        ops: tuple[leases.LeaseStatement, ...],
        params: Mapping[str, Any],
        refuse: Callable[[], StoreError | None],
        *,
        job_id: str,
        shard_index: int,
    ) -> Mapping[str, Any]:
        """The row of the first of ``ops`` that matches; when none does, the error ``refuse`` finds.

        ``refuse`` reads the rows after the statements, in a transaction of its own, so a row may
        have changed in between (a live lease expired, say, and the shard became claimable): then
        it finds no reason and the operation is tried again, a few times at most.
        """
        for _ in range(RACE_TRIES):
            for op in ops:
                row = self._run_lease_statement(op, params)
                if row is not None:
                    return row
            error = refuse()
            if error is not None:
                raise error
        raise StoreError(
            f"shard {shard_id(shard_index)} of job {job_id}: {ops[0].name} matched nothing {RACE_TRIES} "
            "times and yet no reason was found (the shard kept changing); retry",
            job_id=job_id,
            shard_index=shard_index,
        )

    def _run_lease_statement(
        self, op: leases.LeaseStatement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """``op`` in one transaction: on PostgreSQL one statement in autocommit mode, on SQLite its steps."""
        self._check_fork()
        hot = self._hot_conn
        if hot is not None:
            return run_with_retry(
                lambda: hot.first(op.combined, params), url=self.url, attempts=self._attempts
            )
        return self._tx(lambda conn: leases.run_steps(conn, op, params))

    def _snapshot(self, job_id: str, shard_index: int) -> leases.ShardSnapshot:
        """The shard, its job's state and the database clock, read-only."""

        def read(conn: Connection) -> leases.ShardSnapshot:
            snap = leases.read_snapshot(conn, job_id, shard_index)
            if snap is None:
                self._job(conn, job_id)
                raise _no_such_shard(job_id, shard_index)
            return snap

        return self._tx(read, write=False)

    @staticmethod
    def _end_attempt(
        conn: Connection,
        attempt_id: str | None,
        outcome: AttemptOutcome,
        now: float,
        error: str | None,
        failure: FailureClass | None = None,
    ) -> bool:
        if attempt_id is None:
            return False
        values: dict[str, Any] = {"outcome": outcome.value, "ended_at": _ts(now), "error": error}
        if failure is not None:
            values["failure_class"] = failure.value
        return bool(
            conn.execute(
                sa.update(attempts)
                .where(
                    attempts.c.attempt_id == attempt_id, attempts.c.outcome == AttemptOutcome.RUNNING.value
                )
                .values(**values)
            ).rowcount
        )

    @staticmethod
    def _report_stalled(conn: Connection, attempt_id: str, epoch: int, error: str | None) -> bool:
        """The worker of an attempt the store ended ``lost_lease`` reports back alive: ``stalled``.

        Under the attempt's own identity (its ID and epoch, the lease it was granted) and only from
        ``lost_lease``: the attempt row alone changes (outcome and error, the store's reason kept
        first; not its end, its failure class or its commits). The shard, its epoch and its lease
        are not touched, so no lease comes back to life and fencing is as before.
        """
        check_attempt_transition(AttemptOutcome.LOST_LEASE, AttemptOutcome.STALLED)
        said = f"; its worker reported back alive: {error or 'stalled'}"
        return bool(
            conn.execute(
                sa.update(attempts)
                .where(
                    attempts.c.attempt_id == attempt_id,
                    attempts.c.epoch == epoch,
                    attempts.c.outcome == AttemptOutcome.LOST_LEASE.value,
                )
                .values(
                    outcome=AttemptOutcome.STALLED.value,
                    error=sa.func.substr(
                        sa.func.coalesce(attempts.c.error, AttemptOutcome.LOST_LEASE.value) + said, 1, 4000
                    ),
                )
            ).rowcount
        )

    def _end_lease(
        self,
        conn: Connection,
        job_id: str,
        shard_index: int,
        attempt_id: str,
        epoch: int | None,
        outcome: AttemptOutcome,
        error: str | None,
        failure: FailureClass | None = None,
    ) -> ShardState | None:
        """End an attempt; if it still holds the shard's lease, free the shard for the next attempt.

        In a race (docs/internals.md, "Racing leases") the shard is not freed: a racer that ends
        leaves the primary lease as it is; a primary that ends while its racer's lease is live
        hands the shard to the racer (promoted to the primary lease, same epoch); neither spends
        the budget. Both return ``leased``.

        Returns the shard's state afterwards, or None when the attempt no longer held the lease.
        With a ``failure`` class (docs/design.md §6.6): a deterministic failure of an attempt that
        committed nothing spends one unit of the budget, and the shard fails for good once
        ``max_attempts`` are spent, its error naming the last cause; a configuration failure
        stops the whole job (``failed``, the cause as the job's error) in the same transaction.
        """
        shard, now = self._lock_shard(conn, job_id, shard_index)
        ended = self._end_attempt(conn, attempt_id, outcome, now, error, failure)
        if not ended and outcome is AttemptOutcome.STALLED and epoch is not None:
            self._report_stalled(conn, attempt_id, epoch, error)
        leased = shard.state is ShardState.LEASED and (epoch is None or shard.epoch == epoch)
        holds = leased and shard.lease_attempt_id == attempt_id
        races = leased and shard.race_attempt_id == attempt_id
        racer_live = shard.race_attempt_id is not None and (shard.race_expires_at or 0.0) > now
        if races or (holds and racer_live):
            self._leave_race(conn, shard, promote=not races, now=now)
            if failure is FailureClass.CONFIGURATION:
                self._stop_for_configuration(conn, job_id, shard.shard_id, error)
            return ShardState.LEASED
        if not holds:
            if failure is FailureClass.CONFIGURATION:
                self._stop_for_configuration(conn, job_id, shard.shard_id, error)
            return None
        if outcome is AttemptOutcome.LOST_RACE:
            raise ValueError("an attempt without a live rival cannot lose a race")
        # a dead racer (its lease expired) goes with the primary lease
        self._end_attempt(conn, shard.race_attempt_id, AttemptOutcome.LOST_LEASE, now, "racing lease expired")
        after = shard_state_after(outcome)
        message = error or outcome.value
        failures = shard.failures
        if failure is not None and after is not ShardState.TERMINAL_FAILURE:
            progressed = (
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(commits)
                    .where(
                        commits.c.job_id == job_id,
                        commits.c.shard_index == shard_index,
                        commits.c.attempt_id == attempt_id,
                    )
                ).scalar_one()
                > 0
            )
            if spends_budget(failure, progressed=progressed):
                failures += 1
                budget = self._job(conn, job_id).max_attempts
                if failures >= budget:
                    after = ShardState.TERMINAL_FAILURE
                    message = (
                        f"failed {failures} times without progress (max_attempts={budget}); "
                        f"last error: {message}"
                    )
        check_shard_transition(shard.state, after, shard_id=shard.shard_id)
        conn.execute(
            sa.update(shards)
            .where(_shard_key(job_id, shard_index))
            .values(
                state=after.value,
                lease_attempt_id=None,
                lease_expires_at=None,
                failures=failures,
                last_error=message[:4000],
                updated_at=_ts(now),
                **leases.NO_RACE,
            )
        )
        if failure is FailureClass.CONFIGURATION:
            self._stop_for_configuration(conn, job_id, shard.shard_id, error)
        return after

    @staticmethod
    def _leave_race(conn: Connection, shard: ShardRow, *, promote: bool, now: float) -> None:
        """One attempt of a race ends: the racer goes, or (``promote``) the racer takes the primary lease.

        A promoted racer's pool becomes the shard's ``last_pool`` (the UI and pool usage read it).
        """
        values: dict[str, Any] = {**leases.NO_RACE, "updated_at": _ts(now)}
        if promote:
            values.update(
                lease_attempt_id=shards.c.race_attempt_id,
                lease_expires_at=shards.c.race_expires_at,
                lease_ttl_s=shards.c.race_ttl_s,
                last_pool=leases.attempt_pool(shards.c.race_attempt_id),
            )
        conn.execute(sa.update(shards).where(_shard_key(shard.job_id, shard.shard_index)).values(**values))

    def _stop_for_configuration(
        self, conn: Connection, job_id: str, shard_id_: str, error: str | None
    ) -> None:
        """A configuration failure stops the job at once, with the cause (docs/design.md §6.6)."""
        job = self._job(conn, job_id, lock=True)
        if job.state not in ACTIVE_JOB_STATES:
            return
        cause = f"configuration error (shard {shard_id_}): {error or 'see the worker log'}"
        self._set_job_state(conn, job, JobState.FAILED, error=cause[:4000])

    def release(self, lease: Lease, outcome: AttemptOutcome | str, error: str | None = None) -> bool:
        """End the attempt as ``outcome``; free the shard at once if the attempt still held it.

        Returns False (and raises nothing) when the attempt was already fenced.
        """
        outcome = AttemptOutcome(outcome)
        if outcome in (AttemptOutcome.RUNNING, AttemptOutcome.SUCCEEDED):
            raise ValueError(
                f"release() ends a failed attempt; use complete_shard() for success, not {outcome.value}"
            )
        # an unclassified failure is taken for one that may repeat (docs/design.md §6.6)
        failure = FailureClass.DETERMINISTIC if outcome is AttemptOutcome.FAILED_RETRYABLE else None
        return (
            self._tx(
                lambda conn: self._end_lease(
                    conn,
                    lease.job_id,
                    lease.shard_index,
                    lease.attempt_id,
                    lease.epoch,
                    outcome,
                    error,
                    failure,
                )
            )
            is not None
        )

    def fail_attempt(
        self,
        lease: Lease,
        failure: FailureClass | str,
        error: str,
        *,
        outcome: AttemptOutcome | str | None = None,
    ) -> ShardState | None:
        """End a failed try with its class (docs/design.md §6.6); the shard's state afterwards.

        ``outcome`` defaults to the class's: preempted → ``preempted``, transient and
        deterministic → ``failed_retryable``, configuration → ``failed_terminal``. None when the
        attempt no longer held the lease (a configuration failure still stops the job).
        """
        failure = FailureClass(failure)
        ended = AttemptOutcome(outcome) if outcome is not None else OUTCOME_OF_FAILURE[failure]
        if ended in (AttemptOutcome.RUNNING, AttemptOutcome.SUCCEEDED):
            raise ValueError(f"fail_attempt() ends a failed attempt, not {ended.value}")
        return self._tx(
            lambda conn: self._end_lease(
                conn, lease.job_id, lease.shard_index, lease.attempt_id, lease.epoch, ended, error, failure
            )
        )

    def abandon_attempt(
        self,
        job_id: str,
        shard_index: int,
        attempt_id: str,
        reason: str,
        *,
        failure: FailureClass | str | None = None,
    ) -> bool:
        """The launcher saw the attempt's process die (the pod operator: its pod end): end it
        ``abandoned``, make the shard claimable now.

        ``failure`` is the launcher's class for the death: ``preempted`` when it sent the kill
        itself, ``deterministic`` for a crash (which spends the budget if nothing was committed,
        and is no preemption of the pool: :func:`core.states.is_preemption`).
        """
        cls = FailureClass(failure) if failure is not None else None
        return (
            self._tx(
                lambda conn: self._end_lease(
                    conn, job_id, shard_index, attempt_id, None, AttemptOutcome.ABANDONED, reason, cls
                )
            )
            is not None
        )

    # -- reports ----------------------------------------------------------------------------------

    def list_commits(self, job_id: str) -> list[CommitRow]:
        """Every committed object of the job, by (shard_index, seq); the validation object first."""

        def read(conn: Connection) -> list[CommitRow]:
            self._job(conn, job_id)
            query = (
                sa.select(commits)
                .where(commits.c.job_id == job_id)
                .order_by(commits.c.shard_index, commits.c.seq)
            )
            return [CommitRow.from_row(r) for r in conn.execute(query)]

        return self._tx(read, write=False)

    def list_attempts(self, job_id: str) -> list[AttemptRow]:
        """Every attempt of the job, in the order they started."""

        def read(conn: Connection) -> list[AttemptRow]:
            self._job(conn, job_id)
            query = (
                sa.select(attempts)
                .where(attempts.c.job_id == job_id)
                .order_by(attempts.c.started_at, attempts.c.shard_index, attempts.c.epoch)
            )
            return [AttemptRow.from_row(r) for r in conn.execute(query)]

        return self._tx(read, write=False)

    def rows_of_jobs(self, job_ids: Collection[str]) -> dict[str, JobRows]:
        """The shards, commits and attempts of each of ``job_ids``, in one read-only transaction of
        three statements per :data:`ROWS_OF_JOBS_CHUNK` jobs (a list of jobs reads them together,
        not three transactions per job). Each job's rows are ordered as :meth:`list_shards`,
        :meth:`list_commits` and :meth:`list_attempts` order them; a job with no rows, or no such
        job, maps to empty ones (the caller read the jobs themselves already).
        """
        wanted = list(dict.fromkeys(job_ids))

        def read(conn: Connection) -> dict[str, JobRows]:
            found: dict[str, tuple[list[ShardRow], list[CommitRow], list[AttemptRow]]] = {
                job_id: ([], [], []) for job_id in wanted
            }
            for start in range(0, len(wanted), ROWS_OF_JOBS_CHUNK):
                chunk = wanted[start : start + ROWS_OF_JOBS_CHUNK]
                for row in conn.execute(
                    sa.select(shards).where(shards.c.job_id.in_(chunk)).order_by(shards.c.shard_index)
                ):
                    found[row.job_id][0].append(ShardRow.from_row(row))
                for row in conn.execute(
                    sa.select(commits)
                    .where(commits.c.job_id.in_(chunk))
                    .order_by(commits.c.shard_index, commits.c.seq)
                ):
                    found[row.job_id][1].append(CommitRow.from_row(row))
                for row in conn.execute(
                    sa.select(attempts)
                    .where(attempts.c.job_id.in_(chunk))
                    .order_by(attempts.c.started_at, attempts.c.shard_index, attempts.c.epoch)
                ):
                    found[row.job_id][2].append(AttemptRow.from_row(row))
            return {
                job_id: JobRows(shards=tuple(s), commits=tuple(c), attempts=tuple(a))
                for job_id, (s, c, a) in found.items()
            }

        return self._tx(read, write=False) if wanted else {}

    def lease_holders(self, job_id: str, shard_index: int) -> list[AttemptRow]:
        """The shard's running attempts that hold its lease or its racing lease (at most two).

        One read, so a pod operator that saw a pod end can find the attempts that ran in it
        (by ``worker``) without reading every attempt of the job.
        """

        def read(conn: Connection) -> list[AttemptRow]:
            shard = conn.execute(
                sa.select(shards.c.lease_attempt_id, shards.c.race_attempt_id).where(
                    _shard_key(job_id, shard_index)
                )
            ).first()
            if shard is None:
                self._job(conn, job_id)
                raise _no_such_shard(job_id, shard_index)
            held = [a for a in (shard.lease_attempt_id, shard.race_attempt_id) if a is not None]
            if not held:
                return []
            query = (
                sa.select(attempts)
                .where(
                    attempts.c.job_id == job_id,
                    attempts.c.attempt_id.in_(held),
                    attempts.c.outcome == AttemptOutcome.RUNNING.value,
                )
                .order_by(attempts.c.started_at)
            )
            return [AttemptRow.from_row(r) for r in conn.execute(query)]

        return self._tx(read, write=False)

    def progress(self, job_id: str) -> Progress:
        """Progress counted from commits only (docs/design.md §4.5 invariant 4).

        Work estimates are pro rata per committed microbatch (``core.job_view.shard_done_fraction``).
        """

        def read(conn: Connection) -> Progress:
            job = self._job(conn, job_id)
            shard_rows = [
                ShardRow.from_row(r) for r in conn.execute(sa.select(shards).where(shards.c.job_id == job_id))
            ]
            commit_rows = conn.execute(
                sa.select(commits.c.records, commits.c.counts, commits.c.committed_at).where(
                    commits.c.job_id == job_id
                )
            ).all()
            # by outcome and class: a preemption is told by both (core.states.is_preemption)
            tried = conn.execute(
                sa.select(attempts.c.outcome, attempts.c.failure_class, sa.func.count())
                .where(attempts.c.job_id == job_id)
                .group_by(attempts.c.outcome, attempts.c.failure_class)
            ).all()
            by_state: dict[str, int] = {}
            committed_work = remaining_work = 0.0
            for shard in shard_rows:
                by_state[shard.state.value] = by_state.get(shard.state.value, 0) + 1
                done = shard_done_fraction(shard)
                committed_work += shard.est_work_s * done
                remaining_work += shard.est_work_s * (1.0 - done)
            stamps = [
                job.updated_at,
                *(s.updated_at for s in shard_rows),
                *(c.committed_at for c in commit_rows),
            ]
            return Progress(
                job_id=job_id,
                state=job.state,
                deadline=job.deadline,
                total_records=job.input_lines,
                committed_records=sum(c.records for c in commit_rows),
                succeeded=sum(int((c.counts or {}).get("succeeded", 0)) for c in commit_rows),
                errored=sum(int((c.counts or {}).get("errored", 0)) for c in commit_rows),
                shards_total=len(shard_rows),
                shards_by_state=by_state,
                attempts=sum(int(n) for _, _, n in tried),
                preemptions=sum(int(n) for outcome, cls, n in tried if is_preemption(outcome, cls)),
                committed_work_s=committed_work,
                remaining_work_s=remaining_work,
                updated_at=max(stamps),
                error=job.error,
            )

        return self._tx(read, write=False)

    # -- tenants: usage ledger, capacity, quotas (store/tenancy.py) --------------------------------

    def settle_usage(self, job_id: str, rows: Sequence[UsageRow]) -> list[UsageRow]:
        """Record each attempt's usage once (a settled attempt is left as it is); the job's ledger."""

        def write(conn: Connection) -> list[UsageRow]:
            self._job(conn, job_id)
            tenancy.settle(conn, rows, _ts(self._now(conn)))
            return tenancy.job_usage(conn, job_id)

        return self._tx(write)

    def job_usage(self, job_id: str) -> list[UsageRow]:
        """The job's settled usage, one row per attempt (empty until the job is finalized)."""
        return self._tx(lambda conn: tenancy.job_usage(conn, job_id), write=False)

    def usage(self, *, tenant: str | None = None, since: dt.datetime | None = None) -> list[UsageRow]:
        """Settled usage of attempts started at or after ``since``, of one tenant or of all."""
        return self._tx(lambda conn: tenancy.tenant_usage(conn, tenant, since), write=False)

    def usage_totals(
        self, *, tenant: str | None = None, since: dt.datetime | None = None
    ) -> tuple[list[tenancy.PoolUsageTotal], dict[str, int]]:
        """:meth:`usage` summed per tenant and pool by the database, and each tenant's job count."""
        return self._tx(lambda conn: tenancy.usage_totals(conn, tenant, since), write=False)

    def explain_rejection(self, job_id: str, admission: Mapping[str, Any]) -> JobRow:
        """Replace a rejected job's admission report by the fuller one searched after the lock.

        Only a ``rejected`` job's report changes (a refusal is final; the report only gains what
        would have admitted it); returns the job as it now is.
        """

        def update(conn: Connection) -> JobRow:
            conn.execute(
                sa.update(jobs)
                .where(jobs.c.job_id == job_id, jobs.c.state == JobState.REJECTED.value)
                .values(admission=dict(admission))
            )
            return self._job(conn, job_id)

        return self._tx(update)

    def admission_snapshot(self, tenant: str) -> tenancy.TenancySnapshot:
        """What admission of ``tenant``'s next job would read (read-only; ``deadline-batch capacity``)."""
        return self._tx(lambda conn: tenancy.read_snapshot(conn, tenant, _ts(self._now(conn))), write=False)

    def tenant_gpus_in_use(self, tenant: str, *, exclude_job: str | None = None) -> dict[str, int]:
        """GPUs the tenant holds by pool kind (``spot`` / ``on_demand``): live leases of its running
        jobs, and launch reservations whose worker has not claimed yet (each worker once)."""

        def read(conn: Connection) -> dict[str, int]:
            return tenancy.gpus_held(conn, tenant, self._now(conn), exclude_job=exclude_job)[0]

        return self._tx(read, write=False)

    # -- launch reservations: the tenant GPU quota while jobs run (store/tenancy.py) ----------------

    def reserve_launch(
        self,
        job_id: str,
        shard_index: int,
        *,
        tenant: str,
        kind: PoolKind | str,
        pool: str,
        runner: str,
        ttl_s: float,
    ) -> str | None:
        """Reserve a GPU of the tenant's ``kind`` quota for a worker ``runner`` is about to start.

        The reservation's ID, or None when the tenant already holds its quota (leases and other
        reservations, of every job and every run). Checked and written in one serialized
        transaction; it expires ``ttl_s`` after its last renewal (database clock), so a runner that
        dies leaks nothing for longer than that.
        """
        _check_reservation_ttl(ttl_s)
        kind = PoolKind(kind).value
        reservation_id = "r-" + uuid.uuid4().hex

        def write(conn: Connection) -> bool:
            return tenancy.reserve_launch(
                conn,
                reservation_id=reservation_id,
                tenant=tenant,
                kind=kind,
                job_id=job_id,
                shard_index=shard_index,
                pool=pool,
                runner=runner,
                now=self._now(conn),
                ttl_s=ttl_s,
            )

        return reservation_id if self._tx(write) else None

    def launch_started(self, reservation_id: str, worker: str) -> None:
        """The reserved worker runs as ``worker`` (its attempts' name): its claim ends the reservation."""
        self._tx(lambda conn: tenancy.name_launch_worker(conn, reservation_id, worker))

    def renew_launches(self, runner: str, ttl_s: float) -> None:
        """``runner`` is alive: its reservations expire ``ttl_s`` from now (database clock)."""
        _check_reservation_ttl(ttl_s)
        self._tx(lambda conn: tenancy.renew_launches(conn, runner, self._now(conn), ttl_s))

    def release_launches(self, runner: str, reservation_id: str | None = None) -> None:
        """Give back one of ``runner``'s reservations (its worker exited), or all of them (it stops)."""
        self._tx(lambda conn: tenancy.release_launches(conn, runner, reservation_id))

    def list_capacity(self) -> list[PoolCapacityRow]:
        """Pools whose GPUs are shared under admission control (docs/tenants.md)."""
        return self._tx(tenancy.list_capacity, write=False)

    def set_capacity(self, pool: str, gpus: int) -> PoolCapacityRow:
        """Set a pool's shared GPU capacity (a new row, or a replaced one)."""
        row = PoolCapacityRow(pool=pool, gpus=gpus)

        def write(conn: Connection) -> PoolCapacityRow:
            tenancy.lock_admissions(conn)  # an admission in flight sees the old or the new capacity
            tenancy.set_capacity(conn, row, _ts(self._now(conn)))
            return next(r for r in tenancy.list_capacity(conn) if r.pool == pool)

        return self._tx(write)

    def delete_capacity(self, pool: str) -> bool:
        """Stop managing a pool's capacity; False when it was not managed."""

        def write(conn: Connection) -> bool:
            tenancy.lock_admissions(conn)
            return tenancy.delete_capacity(conn, pool)

        return self._tx(write)

    def pool_history(
        self,
        pools: Sequence[str],
        *,
        exclude_job: str | None = None,
        days: float = pool_stats.HISTORY_DAYS,
        limit: int = pool_stats.HISTORY_LIMIT,
    ) -> dict[str, PoolHistory]:
        """Other jobs' finished tries on each named pool in the last ``days`` (placement's prior)."""

        def read(conn: Connection) -> dict[str, PoolHistory]:
            since = _ts(self._now(conn) - days * 86400.0)
            return pool_stats.spot_history(conn, pools, since=since, exclude_job=exclude_job, limit=limit)

        return self._tx(read, write=False)

    def placement_rows(self, job_id: str, *, spot_pools: Sequence[str] | None = None) -> PlacementRows:
        """The job's row, shards, commits and attempts and its Spot pools' history, for one placement
        decision, in one read transaction (:mod:`store.placement_rows`; JobNotFound if no such job).

        ``spot_pools``: the Spot pools whose earlier jobs' tries to read (:meth:`pool_history`);
        None: the Spot pools of the job's config.
        """

        def read(conn: Connection) -> PlacementRows:
            job = self._job(conn, job_id)
            names = spot_pools
            if names is None:
                specs = (PoolSpec.from_dict(p) for p in job.config.get("pools") or ())
                names = [p.name for p in specs if p.kind is PoolKind.SPOT]
            since = _ts(self._now(conn) - pool_stats.HISTORY_DAYS * 86400.0)
            return read_placement_rows(conn, job, names, since=since)

        return self._tx(read, write=False)

    def record_unschedulable(
        self,
        job_id: str,
        shard_index: int,
        *,
        pool: str,
        worker: str,
        created_at: dt.datetime,
        error: str,
        scheduled_at: dt.datetime | None = None,
    ) -> str:
        """Record a Spot try's pod that waited for capacity since ``created_at``: until
        ``scheduled_at``, else until now, when the try gave up.

        The pool's availability evidence (``store.pool_stats.record_unschedulable``); returns the
        attempt ID of the ``unschedulable`` row.
        """

        def write(conn: Connection) -> str:
            return pool_stats.record_unschedulable(
                conn,
                job_id=job_id,
                shard_index=shard_index,
                pool=pool,
                worker=worker,
                created_at=created_at,
                now=_ts(self._now(conn)),
                error=error,
                scheduled_at=scheduled_at,
            )

        return self._tx(write)

    def measured_rates(
        self,
        pools: Sequence[str],
        *,
        engine: str,
        model: str | None,
        exclude_job: str | None = None,
        days: float = throughput.HISTORY_DAYS,
        limit: int = throughput.HISTORY_LIMIT,
    ) -> dict[str, MeasuredRate]:
        """Earlier jobs' committed microbatches of one model on each named pool (a new job's rates)."""

        def read(conn: Connection) -> dict[str, MeasuredRate]:
            since = _ts(self._now(conn) - days * 86400.0)
            return throughput.measured_rates(
                conn, pools, engine=engine, model=model, since=since, exclude_job=exclude_job, limit=limit
            )

        return self._tx(read, write=False)

    def pool_models(
        self, pool: str, *, days: float = throughput.HISTORY_DAYS, limit: int = throughput.HISTORY_LIMIT
    ) -> list[tuple[str, str | None]]:
        """The (engine, model) pairs whose microbatches committed on ``pool`` lately (``capacity list``)."""

        def read(conn: Connection) -> list[tuple[str, str | None]]:
            since = _ts(self._now(conn) - days * 86400.0)
            return throughput.models_seen(conn, pool, since=since, limit=limit)

        return self._tx(read, write=False)

    def get_quota(self, tenant: str) -> TenantQuotaRow | None:
        """The tenant's quota, or None (no limits)."""
        return self._tx(lambda conn: tenancy.get_quota(conn, tenant), write=False)

    def list_quotas(self) -> list[TenantQuotaRow]:
        return self._tx(tenancy.list_quotas, write=False)

    def set_quota(self, quota: TenantQuotaRow) -> TenantQuotaRow:
        """Set (replace) a tenant's GPU quotas and budget."""

        def write(conn: Connection) -> TenantQuotaRow:
            tenancy.lock_admissions(conn)
            tenancy.set_quota(conn, quota, _ts(self._now(conn)))
            found = tenancy.get_quota(conn, quota.tenant)
            assert found is not None
            return found

        return self._tx(write)

    def delete_quota(self, tenant: str) -> bool:
        def write(conn: Connection) -> bool:
            tenancy.lock_admissions(conn)
            return tenancy.delete_quota(conn, tenant)

        return self._tx(write)

    # -- dispatch: slots of managed pools, least slack first within fair shares (store/dispatch.py) --
    # Every write below is one serialized dispatch pass: lock, expire dead runners' rows, change
    # the caller's rows, grant every free slot by the rule (core.dispatch), so a slot freed or a
    # request posted by any runner is granted at once, to whichever runner's request it is due.

    def _dispatch_pass(self, change: Callable[[Connection, float], T]) -> T:
        def write(conn: Connection) -> T:
            dispatch.lock_dispatch(conn)
            now = self._now(conn)
            dispatch.expire(conn, now)
            result = change(conn, now)
            dispatch.grant_free_slots(conn, now)
            return result

        return self._tx(write)

    def request_dispatch(
        self,
        job_id: str,
        shard_index: int,
        *,
        tenant: str,
        pool: str,
        latest_start: float,
        ttl_s: float,
        runner: str | None = None,
    ) -> DispatchRow | None:
        """Ask for a slot of managed ``pool`` (one on another pool is given up); the row after the pass.

        ``runner`` names the asking run: a live row of another run of the job is left alone, and
        returned (its ``runner`` differs) so the caller knows the shard is in that run's hands.
        """
        check_request(latest_start, ttl_s)

        def change(conn: Connection, now: float) -> None:
            dispatch.post_request(
                conn,
                job_id=job_id,
                shard_index=shard_index,
                tenant=tenant,
                pool=pool,
                latest_start=latest_start,
                now=now,
                ttl_s=ttl_s,
                runner=runner,
            )

        self._dispatch_pass(change)
        return self._tx(lambda conn: dispatch.get_request(conn, job_id, shard_index), write=False)

    def poll_dispatch(
        self, job_id: str, ttl_s: float, *, runner: str | None = None
    ) -> dict[int, DispatchRow]:
        """Renew the job's requests and grants (``runner``'s only, when given) for ``ttl_s``, grant
        free slots; all the job's rows by shard (``runner`` says whose each is)."""
        check_request(0.0, ttl_s)

        def change(conn: Connection, now: float) -> None:
            dispatch.renew(conn, job_id, now, ttl_s, runner)

        self._dispatch_pass(change)
        rows = self._tx(lambda conn: dispatch.job_rows(conn, job_id), write=False)
        return {row.shard_index: row for row in rows}

    def release_dispatch(
        self, job_id: str, shard_index: int | None = None, *, how: str = "released", runner: str | None = None
    ) -> None:
        """Give back a shard's request or slot (all of the job's when ``shard_index`` is None; only
        ``runner``'s when given, so a run never gives back another run's slot)."""

        def change(conn: Connection, now: float) -> None:
            dispatch.end_rows(conn, dispatch.job_rows(conn, job_id, shard_index, runner), now, how)

        self._dispatch_pass(change)

    def dispatch_requests(self, pool: str | None = None) -> list[DispatchRow]:
        """Requests waiting for and holding slots of managed pools, least slack first per pool."""
        return self._tx(lambda conn: dispatch.list_requests(conn, pool), write=False)

    def dispatch_grants(
        self, *, pool: str | None = None, job_id: str | None = None
    ) -> list[DispatchGrantRow]:
        """The audit record of grants, in grant order."""
        return self._tx(lambda conn: dispatch.list_grants(conn, pool, job_id), write=False)

    def fail_shard(self, job_id: str, shard_index: int, reason: str) -> ShardState:
        """Fail an unfinished shard for good because what runs it gave up (its Airflow task failed
        with no retry left): the shard's state afterwards.

        The store is the truth for records: a ``succeeded`` shard stays succeeded (its commit
        landed before its runner was lost), a ``terminal_failure`` stays as it is, and so does
        every shard of a job that is no longer admitted or running. Otherwise the shard becomes
        ``terminal_failure`` with ``reason`` as its ``last_error`` (finalization then gives its
        uncommitted records ``errored`` / ``shard_failed`` outcomes); its epoch is bumped and a
        lease still held is ended ``lost_lease``, so a worker its runner left behind can commit
        nothing more.
        """

        def change(conn: Connection) -> ShardState:
            shard, now = self._lock_shard(conn, job_id, shard_index)
            if shard.state in TERMINAL_SHARD_STATES or self._job(conn, job_id).state not in ACTIVE_JOB_STATES:
                return shard.state
            check_shard_transition(shard.state, ShardState.TERMINAL_FAILURE, shard_id=shard.shard_id)
            for attempt_id in (shard.lease_attempt_id, shard.race_attempt_id):
                self._end_attempt(conn, attempt_id, AttemptOutcome.LOST_LEASE, now, f"fenced: {reason}")
            conn.execute(
                sa.update(shards)
                .where(_shard_key(job_id, shard_index))
                .values(
                    state=ShardState.TERMINAL_FAILURE.value,
                    epoch=shards.c.epoch + 1,
                    lease_attempt_id=None,
                    lease_expires_at=None,
                    last_error=reason[:4000],
                    updated_at=_ts(now),
                    **leases.NO_RACE,
                )
            )
            return ShardState.TERMINAL_FAILURE

        return self._tx(change)


def _check_reservation_ttl(ttl_s: float) -> None:
    """Refuse a reservation that would never expire, or expire at once (one-line ``ValueError``)."""
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(
            f"launch reservation: ttl_s must be a finite number > 0 (the lease TTL), got {ttl_s}"
        )


def _shard_values(job_id: str, shard: NewShard, now: dt.datetime) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "shard_index": shard.shard_index,
        "state": ShardState.PENDING.value,
        "epoch": 0,
        "lease_attempt_id": None,
        "lease_expires_at": None,
        "lease_ttl_s": None,
        "attempts": 0,
        "failures": 0,
        "byte_start": shard.byte_start,
        "byte_end": shard.byte_end,
        "first_line": shard.first_line,
        "line_count": shard.line_count,
        "records": shard.records,
        "excluded_lines": list(shard.excluded_lines),
        "input_sha256": shard.input_sha256,
        "est_work_s": float(shard.est_work_s),
        "num_microbatches": shard.num_microbatches,
        "cursor": 0,
        "last_pool": None,
        "last_error": None,
        "updated_at": now,
    }


def _commit_values(commit: NewCommit) -> dict[str, Any]:
    return {
        "uri": commit.uri,
        "sha256": commit.sha256,
        "records": commit.records,
        "counts": {str(k): int(v) for k, v in commit.counts.items()},
        "prompt_tokens": commit.prompt_tokens,
        "completion_tokens": commit.completion_tokens,
        "elapsed_s": float(commit.elapsed_s),
        "model_digest": commit.model_digest,
        "pool": commit.pool,
    }


def _check_new_job(job: NewJob, shards_: Sequence[NewShard], validation: NewCommit | None) -> None:
    """Refuse a plan that could not yield one outcome per input line (docs/design.md §4.5 invariant 1)."""
    if job.idempotency_key is not None:
        check_idempotency_key(job.idempotency_key)
    if job.state is JobState.REJECTED:
        if shards_:
            raise ValueError("a rejected job is recorded without shards")
        return
    indexes = sorted(s.shard_index for s in shards_)
    if indexes != list(range(len(shards_))):
        raise ValueError(
            f"shard indexes must be 0..{len(shards_) - 1} without gaps or repeats, got {indexes}"
        )
    expected = sum(s.records for s in shards_) + (validation.records if validation is not None else 0)
    if expected != job.input_lines:
        raise ValueError(
            f"shards ({sum(s.records for s in shards_)} records) and validation errors "
            f"({validation.records if validation else 0}) must add up to input_lines ({job.input_lines})"
        )
