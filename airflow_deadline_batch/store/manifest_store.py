"""The manifest store: jobs, shards, attempts, leases and fenced commits, on SQLite or PostgreSQL.

Every public method is one transaction. Lease time comes from the database clock (``db_epoch()``),
never from the caller's. Row-lock order is always shard → attempt → job (or job alone), so two
operations never wait on each other in a cycle. On SQLite every write transaction starts with
``BEGIN IMMEDIATE`` and so runs alone; on PostgreSQL the shard row is locked ``FOR UPDATE``.
On PostgreSQL, claim, heartbeat, commit and complete first try one self-contained statement in
autocommit mode (``pg_fast``); only when it matches nothing does the slow path's transaction run.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.ids import new_attempt_id, new_job_id, shard_id
from airflow_deadline_batch.core.states import (
    TERMINAL_JOB_STATES,
    AttemptOutcome,
    JobState,
    ShardState,
    check_job_transition,
    check_shard_transition,
    shard_state_after,
)
from airflow_deadline_batch.exceptions import (
    InvalidTransition,
    JobNotFound,
    LeaseLost,
    ShardNotClaimable,
    StoreError,
)
from airflow_deadline_batch.store import pg_fast
from airflow_deadline_batch.store.engine import (
    BEGIN_MODE,
    PING_AFTER_IDLE_S,
    create_store_engine,
    fork_safe,
    run_with_retry,
)
from airflow_deadline_batch.store.rows import (
    DEFAULT_MAX_ATTEMPTS,
    VALIDATION_ATTEMPT_ID,
    VALIDATION_SHARD_INDEX,
    AttemptRow,
    CommitRow,
    JobRow,
    Lease,
    NewCommit,
    NewJob,
    NewShard,
    Progress,
    ShardRow,
)
from airflow_deadline_batch.store.schema import (
    JSONType,
    attempts,
    commits,
    db_epoch,
    db_timestamp,
    jobs,
    shards,
)

T = TypeVar("T")
UTC = dt.timezone.utc
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
#: pg_advisory_xact_lock key that serializes concurrent migrate() calls ("adb_migr")
MIGRATION_LOCK_KEY = 0x6164625F6D696772
#: jobs in these states accept claims, heartbeats and commits
ACTIVE_JOB_STATES = frozenset({JobState.ADMITTED, JobState.RUNNING})
#: attempt outcomes counted as preemptions in progress reports
PREEMPTION_OUTCOMES = frozenset({AttemptOutcome.PREEMPTED.value, AttemptOutcome.ABANDONED.value})


# -- hot-path statements -----------------------------------------------------------------------------
# Claim, heartbeat, commit and complete each try one conditional UPDATE ... RETURNING first; it
# encodes the whole precondition (fencing token, live lease on the DB clock, active job) in its
# WHERE clause, so the common case is one locked row and one or two statements. Only when it
# matches nothing does the slow path lock the row and work out why (to raise the right error).
_B = sa.bindparam
_TTL: sa.BindParameter[float] = _B("b_ttl", type_=sa.Double())
_SEQ: sa.BindParameter[int] = _B("b_seq", type_=sa.Integer())
_ACTIVE = sorted(s.value for s in ACTIVE_JOB_STATES)
_KEY = sa.and_(shards.c.job_id == _B("b_job"), shards.c.shard_index == _B("b_index"))
_HOLDS_LIVE_LEASE = sa.and_(
    _KEY,
    shards.c.state == ShardState.LEASED.value,
    shards.c.epoch == _B("b_epoch"),
    shards.c.lease_attempt_id == _B("b_attempt"),
    shards.c.lease_expires_at > db_epoch(),
    sa.exists().where(jobs.c.job_id == shards.c.job_id, jobs.c.state.in_(_ACTIVE)),
)
_CLAIM = (
    sa.update(shards)
    .where(
        _KEY,
        shards.c.state.in_([ShardState.PENDING.value, ShardState.RETRYABLE_FAILURE.value]),
        sa.exists().where(
            jobs.c.job_id == shards.c.job_id,
            jobs.c.state.in_(_ACTIVE),
            shards.c.attempts < jobs.c.max_attempts,
        ),
    )
    .values(
        state=ShardState.LEASED.value,
        epoch=shards.c.epoch + 1,
        lease_attempt_id=_B("b_attempt"),
        lease_expires_at=db_epoch() + _TTL,
        lease_ttl_s=_TTL,
        attempts=shards.c.attempts + 1,
        last_pool=_B("b_pool"),
        updated_at=db_timestamp(),
    )
    .returning(
        shards.c.epoch,
        shards.c.lease_expires_at,
        shards.c.cursor,
        shards.c.num_microbatches,
        # keyed by the bound job ID, not a correlation: SQLite renders RETURNING columns without
        # their table, and ``job_id = job_id`` would read whichever job comes first
        sa.select(jobs.c.state).where(jobs.c.job_id == _B("b_job")).scalar_subquery().label("job_state"),
    )
)
_INSERT_ATTEMPT = sa.insert(attempts).values(
    attempt_id=_B("b_attempt"),
    job_id=_B("b_job"),
    shard_index=_B("b_index"),
    epoch=_B("b_epoch"),
    worker=_B("b_worker"),
    pool=_B("b_pool"),
    started_at=db_timestamp(),
    outcome=AttemptOutcome.RUNNING.value,
    heartbeat_at=db_timestamp(),
)
_RUN_JOB = (
    sa.update(jobs)
    .where(jobs.c.job_id == _B("b_job"), jobs.c.state == JobState.ADMITTED.value)
    .values(state=JobState.RUNNING.value, updated_at=db_timestamp())
)
_HEARTBEAT = (
    sa.update(shards)
    .where(_HOLDS_LIVE_LEASE)
    .values(lease_expires_at=db_epoch() + _TTL, lease_ttl_s=_TTL, updated_at=db_timestamp())
    .returning(shards.c.lease_expires_at, shards.c.cursor)
)
_ATTEMPT_HEARTBEAT = (
    sa.update(attempts).where(attempts.c.attempt_id == _B("b_attempt")).values(heartbeat_at=db_timestamp())
)
_TTL_FROM_NOW = db_epoch() + sa.func.coalesce(shards.c.lease_ttl_s, 0.0)
_COMMIT = (
    sa.update(shards)
    .where(_HOLDS_LIVE_LEASE, shards.c.cursor == _SEQ, shards.c.cursor < shards.c.num_microbatches)
    .values(
        cursor=shards.c.cursor + 1,
        lease_expires_at=sa.case(
            (shards.c.lease_expires_at > _TTL_FROM_NOW, shards.c.lease_expires_at), else_=_TTL_FROM_NOW
        ),
        updated_at=db_timestamp(),
    )
    .returning(shards.c.lease_expires_at)
)
_INSERT_COMMIT = sa.insert(commits).values(
    job_id=_B("b_job"),
    shard_index=_B("b_index"),
    seq=_SEQ,
    attempt_id=_B("b_attempt"),
    epoch=_B("b_epoch"),
    uri=_B("b_uri"),
    sha256=_B("b_sha256"),
    records=_B("b_records"),
    counts=_B("b_counts", type_=JSONType),
    prompt_tokens=_B("b_prompt_tokens"),
    completion_tokens=_B("b_completion_tokens"),
    elapsed_s=_B("b_elapsed_s", type_=sa.Double()),
    model_digest=_B("b_model_digest", type_=sa.String()),
    pool=_B("b_pool", type_=sa.String()),
    committed_at=db_timestamp(),
)
_COMPLETE = (
    sa.update(shards)
    .where(_HOLDS_LIVE_LEASE, shards.c.cursor == shards.c.num_microbatches)
    .values(
        state=ShardState.SUCCEEDED.value, lease_expires_at=None, last_error=None, updated_at=db_timestamp()
    )
    .returning(shards.c.epoch)
)
_ATTEMPT_SUCCEEDED = (
    sa.update(attempts)
    .where(attempts.c.attempt_id == _B("b_attempt"), attempts.c.outcome == AttemptOutcome.RUNNING.value)
    .values(outcome=AttemptOutcome.SUCCEEDED.value, ended_at=db_timestamp(), error=None)
)


def _lease_params(lease: Lease) -> dict[str, Any]:
    return {
        "b_job": lease.job_id,
        "b_index": lease.shard_index,
        "b_epoch": lease.epoch,
        "b_attempt": lease.attempt_id,
    }


def _pg_lease_params(lease: Lease) -> dict[str, Any]:
    return {
        "job": lease.job_id,
        "index": lease.shard_index,
        "epoch": lease.epoch,
        "attempt": lease.attempt_id,
    }


def _ts(epoch_s: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, UTC)


def _shard_key(job_id: str, shard_index: int) -> sa.ColumnElement[bool]:
    return sa.and_(shards.c.job_id == job_id, shards.c.shard_index == shard_index)


class ManifestStore:
    """Durable job/shard/attempt state with fenced, exactly-once microbatch commits.

    ``url`` is ``sqlite:///path.db`` (the embedded default) or ``postgresql+psycopg://...``.
    Call :meth:`migrate` (or use :meth:`open`) once before use.
    """

    def __init__(self, url: str) -> None:
        self._engine = create_store_engine(url)
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
        #: PostgreSQL runs claim/heartbeat/commit/complete as single autocommit statements (pg_fast)
        self._pg = self.dialect == "postgresql"
        self._hot_conn = pg_fast.HotConnection(self._engine, PING_AFTER_IDLE_S)

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

        return run_with_retry(attempt, passthrough=passthrough, url=self.url)

    def _hot(
        self,
        sql: str,
        params: dict[str, Any],
        done: Callable[[tuple[Any, ...]], T],
        slow: Callable[[Connection], T],
    ) -> T:
        """PostgreSQL: ``sql`` alone, in one round trip; if it matches nothing, ``slow`` in a transaction.

        ``sql`` (see ``pg_fast``) writes everything or nothing, so the slow path, which locks the
        shard row and re-checks every precondition, runs as if the fast statement had not been tried.
        """
        self._check_fork()

        def attempt() -> T:
            row = self._hot_conn.run(sql, params)
            if row is not None:
                return done(row)
            with self._writer.begin() as conn:
                return slow(conn)

        return run_with_retry(attempt, url=self.url)

    def _check_fork(self) -> None:
        """After ``fork()`` leave the parent's connections alone and open our own."""
        if os.getpid() != self._pid:
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
        self, job: NewJob, shards_: Sequence[NewShard] = (), validation: NewCommit | None = None
    ) -> tuple[JobRow, bool]:
        """Record a job with its shards (and the planner's validation-errors object) in one transaction.

        With an ``idempotency_key`` already known, return ``(existing job, False)`` and write
        nothing, also when two submissions race (invariant 6).
        """
        _check_new_job(job, shards_, validation)
        job_id = job.job_id or new_job_id()

        def insert(conn: Connection) -> tuple[JobRow, bool]:
            if job.idempotency_key is not None:
                existing = self._job_by_key(conn, job.idempotency_key)
                if existing is not None:
                    return existing, False
            now = _ts(self._now(conn))
            conn.execute(
                sa.insert(jobs).values(
                    job_id=job_id,
                    idempotency_key=job.idempotency_key,
                    state=job.state.value,
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
                    admission=dict(job.admission) if job.admission is not None else None,
                    completed_at=now if job.state is JobState.REJECTED else None,
                )
            )
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

    def get_job(self, job_id: str) -> JobRow:
        """The job, or :class:`JobNotFound`."""
        return self._tx(lambda conn: self._job(conn, job_id), write=False)

    def get_job_by_idempotency_key(self, key: str) -> JobRow | None:
        """The job submitted with ``key``, or None (lets a planner skip work for a repeated submission)."""
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
            sa.select(shards.c.shard_index, shards.c.lease_attempt_id, shards.c.state)
            .where(shards.c.job_id == job_id, shards.c.state != ShardState.SUCCEEDED.value)
            .with_for_update()
        ).all()
        for row in rows:
            values: dict[str, Any] = {
                "epoch": shards.c.epoch + 1,
                "lease_attempt_id": None,
                "lease_expires_at": None,
                "updated_at": _ts(now),
            }
            if row.state == ShardState.LEASED.value:
                values["state"] = ShardState.RETRYABLE_FAILURE.value
            conn.execute(sa.update(shards).where(_shard_key(job_id, row.shard_index)).values(**values))
            self._end_attempt(
                conn,
                row.lease_attempt_id,
                AttemptOutcome.LOST_LEASE,
                now,
                "fenced: the job left the running state",
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

    def cancel_job(self, job_id: str) -> JobRow:
        """Cancel the job; live leases then fail on their next heartbeat or commit."""

        def cancel(conn: Connection) -> JobRow:
            job = self._job(conn, job_id, lock=True)
            if job.state is JobState.CANCELLED:
                return job
            return self._set_job_state(conn, job, JobState.CANCELLED)

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
            raise StoreError(
                f"job {job_id} has no shard {shard_index}; check the shard index",
                job_id=job_id,
                shard_index=shard_index,
            )
        return ShardRow.from_row(row), float(row.db_now)

    def get_shard(self, job_id: str, shard_index: int) -> ShardRow:
        """One shard (StoreError if the job has no such shard, JobNotFound if no such job)."""

        def read(conn: Connection) -> ShardRow:
            row = conn.execute(sa.select(shards).where(_shard_key(job_id, shard_index))).first()
            if row is None:
                self._job(conn, job_id)
                raise StoreError(
                    f"job {job_id} has no shard {shard_index}; check the shard index",
                    job_id=job_id,
                    shard_index=shard_index,
                )
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

    def claim_shard(
        self, job_id: str, shard_index: int, *, ttl_s: float, worker: str, pool: str | None = None
    ) -> Lease:
        """Take the shard's lease with a fresh attempt and a bumped epoch (the fencing token).

        Raises :class:`ShardNotClaimable` with ``reason`` ``succeeded`` (already committed: a no-op
        success for the caller), ``leased`` (a live lease is held; ``seconds_left``), ``exhausted``
        (out of attempts, or failed terminally) or ``job_inactive``.
        """
        attempt_id = new_attempt_id()
        sid = shard_id(shard_index)

        def claim(conn: Connection) -> Lease | ShardNotClaimable:
            params = {
                "b_job": job_id,
                "b_index": shard_index,
                "b_attempt": attempt_id,
                "b_ttl": ttl_s,
                "b_pool": pool,
                "b_worker": worker,
            }
            fast = conn.execute(_CLAIM, params).first()
            if fast is not None:
                conn.execute(_INSERT_ATTEMPT, {**params, "b_epoch": fast.epoch})
                if fast.job_state == JobState.ADMITTED.value:
                    conn.execute(_RUN_JOB, params)
                return Lease(
                    job_id=job_id,
                    shard_index=shard_index,
                    attempt_id=attempt_id,
                    epoch=fast.epoch,
                    expires_at=fast.lease_expires_at,
                    cursor=fast.cursor,
                    num_microbatches=fast.num_microbatches,
                )
            return slow_claim(conn)

        def slow_claim(conn: Connection) -> Lease | ShardNotClaimable:
            job = self._job(conn, job_id)
            shard, now = self._lock_shard(conn, job_id, shard_index)
            if shard.state is ShardState.SUCCEEDED:
                return ShardNotClaimable(
                    f"shard {sid} of job {job_id} is already committed; nothing to do",
                    reason="succeeded",
                    job_id=job_id,
                    shard_index=shard_index,
                )
            if job.state not in ACTIVE_JOB_STATES:
                return ShardNotClaimable(
                    f"job {job_id} is {job.state.value}; its shards take no new attempts",
                    reason="job_inactive",
                    job_id=job_id,
                    shard_index=shard_index,
                )
            if shard.state is ShardState.TERMINAL_FAILURE:
                return ShardNotClaimable(
                    f"shard {sid} of job {job_id} failed terminally ({shard.last_error}); it is not retried",
                    reason="exhausted",
                    job_id=job_id,
                    shard_index=shard_index,
                )
            if shard.state is ShardState.LEASED:
                left = (shard.lease_expires_at or 0.0) - now
                if left > 0:
                    return ShardNotClaimable(
                        f"shard {sid} of job {job_id} is leased by {shard.lease_attempt_id} "
                        f"for {left:.1f}s more",
                        reason="leased",
                        seconds_left=left,
                        job_id=job_id,
                        shard_index=shard_index,
                    )
                self._end_attempt(
                    conn,
                    shard.lease_attempt_id,
                    AttemptOutcome.LOST_LEASE,
                    now,
                    f"lease expired; taken over at epoch {shard.epoch + 1}",
                )
            if shard.attempts >= job.max_attempts:
                error = f"exhausted after {shard.attempts} attempts (max_attempts={job.max_attempts})"
                check_shard_transition(shard.state, ShardState.TERMINAL_FAILURE, shard_id=sid)
                conn.execute(
                    sa.update(shards)
                    .where(_shard_key(job_id, shard_index))
                    .values(
                        state=ShardState.TERMINAL_FAILURE.value,
                        lease_attempt_id=None,
                        lease_expires_at=None,
                        last_error=error,
                        updated_at=_ts(now),
                    )
                )
                return ShardNotClaimable(
                    f"shard {sid} of job {job_id} is {error}",
                    reason="exhausted",
                    job_id=job_id,
                    shard_index=shard_index,
                )
            check_shard_transition(shard.state, ShardState.LEASED, shard_id=sid)
            expires = now + ttl_s
            done = conn.execute(
                sa.update(shards)
                .where(_shard_key(job_id, shard_index), shards.c.epoch == shard.epoch)
                .values(
                    state=ShardState.LEASED.value,
                    epoch=shard.epoch + 1,
                    lease_attempt_id=attempt_id,
                    lease_expires_at=expires,
                    lease_ttl_s=ttl_s,
                    attempts=shard.attempts + 1,
                    last_pool=pool,
                    updated_at=_ts(now),
                )
            ).rowcount
            if done != 1:  # cannot happen under the row lock; refuse rather than double-lease
                raise StoreError(f"shard {sid} of job {job_id} changed during claim; retry the claim")
            conn.execute(
                sa.insert(attempts).values(
                    attempt_id=attempt_id,
                    job_id=job_id,
                    shard_index=shard_index,
                    epoch=shard.epoch + 1,
                    worker=worker,
                    pool=pool,
                    started_at=_ts(now),
                    outcome=AttemptOutcome.RUNNING.value,
                    heartbeat_at=_ts(now),
                )
            )
            if job.state is JobState.ADMITTED:
                conn.execute(
                    sa.update(jobs)
                    .where(jobs.c.job_id == job_id, jobs.c.state == JobState.ADMITTED.value)
                    .values(state=JobState.RUNNING.value, updated_at=_ts(now))
                )
            return Lease(
                job_id=job_id,
                shard_index=shard_index,
                attempt_id=attempt_id,
                epoch=shard.epoch + 1,
                expires_at=expires,
                cursor=shard.cursor,
                num_microbatches=shard.num_microbatches,
            )

        if self._pg:
            pg_params = {
                "job": job_id,
                "index": shard_index,
                "attempt": attempt_id,
                "ttl": float(ttl_s),
                "pool": pool,
                "worker": worker,
            }

            def claimed(row: tuple[Any, ...]) -> Lease:
                return Lease(
                    job_id=job_id,
                    shard_index=shard_index,
                    attempt_id=attempt_id,
                    epoch=row[0],
                    expires_at=row[1],
                    cursor=row[2],
                    num_microbatches=row[3],
                )

            result: Lease | ShardNotClaimable = self._hot(pg_fast.CLAIM, pg_params, claimed, slow_claim)
        else:
            result = self._tx(claim)
        if isinstance(result, ShardNotClaimable):
            raise result  # raised after the transaction, so its bookkeeping (exhausted, lost_lease) commits
        return result

    def _check_lease(self, conn: Connection, shard: ShardRow, now: float, lease: Lease) -> None:
        """Raise :class:`LeaseLost` unless ``lease`` is the shard's current, live lease of an active job."""
        where = (
            f"shard {lease.shard_id} of job {lease.job_id}: attempt {lease.attempt_id} (epoch {lease.epoch})"
        )
        state = conn.execute(sa.select(jobs.c.state).where(jobs.c.job_id == lease.job_id)).scalar_one()
        if state not in {s.value for s in ACTIVE_JOB_STATES}:
            reason = f"job is {state}"  # checked first: it is the reason a user can act on
        elif shard.epoch != lease.epoch or shard.lease_attempt_id != lease.attempt_id:
            reason = f"fenced by epoch {shard.epoch} ({shard.lease_attempt_id})"
        elif shard.state is not ShardState.LEASED:
            reason = f"shard is {shard.state.value}"
        elif (shard.lease_expires_at or 0.0) <= now:
            reason = f"lease expired {now - (shard.lease_expires_at or 0.0):.2f}s ago"
        else:
            return
        raise LeaseLost(
            f"{where} lost its lease: {reason}; stop and exit retryable",
            job_id=lease.job_id,
            shard_index=lease.shard_index,
            attempt_id=lease.attempt_id,
            epoch=lease.epoch,
        )

    def heartbeat(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend the lease to ``db_now + ttl_s``; :class:`LeaseLost` if fenced, expired or job inactive."""

        def beat(conn: Connection) -> Lease:
            params = {**_lease_params(lease), "b_ttl": ttl_s}
            fast = conn.execute(_HEARTBEAT, params).first()
            if fast is not None:
                conn.execute(_ATTEMPT_HEARTBEAT, params)
                return dataclasses.replace(lease, expires_at=fast.lease_expires_at, cursor=fast.cursor)
            return slow_beat(conn)

        def slow_beat(conn: Connection) -> Lease:
            shard, now = self._lock_shard(conn, lease.job_id, lease.shard_index)
            self._check_lease(conn, shard, now, lease)
            expires = now + ttl_s
            conn.execute(
                sa.update(shards)
                .where(_shard_key(lease.job_id, lease.shard_index))
                .values(lease_expires_at=expires, lease_ttl_s=ttl_s, updated_at=_ts(now))
            )
            conn.execute(
                sa.update(attempts)
                .where(attempts.c.attempt_id == lease.attempt_id)
                .values(heartbeat_at=_ts(now))
            )
            return dataclasses.replace(lease, expires_at=expires, cursor=shard.cursor)

        if self._pg:
            return self._hot(
                pg_fast.HEARTBEAT,
                {**_pg_lease_params(lease), "ttl": float(ttl_s)},
                lambda row: dataclasses.replace(lease, expires_at=row[0], cursor=row[1]),
                slow_beat,
            )
        return self._tx(beat)

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
        out-of-order ``seq``. Returns the extended lease (callers may ignore it).
        """

        def commit(conn: Connection) -> Lease:
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
            fast = conn.execute(_COMMIT, params).first()
            if fast is not None:
                conn.execute(_INSERT_COMMIT, params)
                return dataclasses.replace(lease, expires_at=fast.lease_expires_at, cursor=seq + 1)
            return slow_commit(conn)

        def slow_commit(conn: Connection) -> Lease:
            shard, now = self._lock_shard(conn, lease.job_id, lease.shard_index)
            self._check_lease(conn, shard, now, lease)
            if seq != shard.cursor or seq >= shard.num_microbatches:
                raise StoreError(
                    f"shard {lease.shard_id} of job {lease.job_id}: microbatch {seq} refused; "
                    f"the next to commit is {shard.cursor} of {shard.num_microbatches} "
                    "(duplicate or out-of-order commit)",
                    job_id=lease.job_id,
                    shard_index=lease.shard_index,
                    seq=seq,
                    expected_seq=shard.cursor,
                )
            conn.execute(
                sa.insert(commits).values(
                    job_id=lease.job_id,
                    shard_index=lease.shard_index,
                    seq=seq,
                    attempt_id=lease.attempt_id,
                    epoch=lease.epoch,
                    committed_at=_ts(now),
                    **_commit_values(
                        NewCommit(
                            uri=uri,
                            sha256=sha256,
                            records=records,
                            counts=counts,
                            prompt_tokens=prompt_tokens,
                            completion_tokens=completion_tokens,
                            elapsed_s=elapsed_s,
                            model_digest=model_digest,
                            pool=pool,
                        )
                    ),
                )
            )
            expires = max(shard.lease_expires_at or 0.0, now + (shard.lease_ttl_s or 0.0))
            conn.execute(
                sa.update(shards)
                .where(
                    _shard_key(lease.job_id, lease.shard_index),
                    shards.c.epoch == lease.epoch,
                    shards.c.cursor == seq,
                )
                .values(cursor=seq + 1, lease_expires_at=expires, updated_at=_ts(now))
            )
            return dataclasses.replace(lease, expires_at=expires, cursor=seq + 1)

        if self._pg:
            pg_params = {
                **_pg_lease_params(lease),
                "seq": seq,
                "uri": uri,
                "sha256": sha256,
                "records": records,
                "counts": pg_fast.jsonb({str(k): int(v) for k, v in counts.items()}),
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "elapsed_s": float(elapsed_s),
                "model_digest": model_digest,
                "pool": pool,
            }
            return self._hot(
                pg_fast.COMMIT,
                pg_params,
                lambda row: dataclasses.replace(lease, expires_at=row[0], cursor=seq + 1),
                slow_commit,
            )
        return self._tx(commit)

    def complete_shard(self, lease: Lease) -> None:
        """Mark the shard succeeded; needs every microbatch committed and the live lease."""

        def complete(conn: Connection) -> None:
            params = _lease_params(lease)
            if conn.execute(_COMPLETE, params).first() is not None:
                conn.execute(_ATTEMPT_SUCCEEDED, params)
                return
            slow_complete(conn)

        def slow_complete(conn: Connection) -> None:
            shard, now = self._lock_shard(conn, lease.job_id, lease.shard_index)
            self._check_lease(conn, shard, now, lease)
            if shard.cursor != shard.num_microbatches:
                raise StoreError(
                    f"shard {lease.shard_id} of job {lease.job_id} has {shard.cursor} of "
                    f"{shard.num_microbatches} microbatches committed; commit the rest before completing it",
                    job_id=lease.job_id,
                    shard_index=lease.shard_index,
                )
            check_shard_transition(shard.state, ShardState.SUCCEEDED, shard_id=lease.shard_id)
            conn.execute(
                sa.update(shards)
                .where(_shard_key(lease.job_id, lease.shard_index))
                .values(
                    state=ShardState.SUCCEEDED.value,
                    lease_expires_at=None,
                    last_error=None,
                    updated_at=_ts(now),
                )
            )
            self._end_attempt(conn, lease.attempt_id, AttemptOutcome.SUCCEEDED, now, None)

        if self._pg:
            self._hot(pg_fast.COMPLETE, _pg_lease_params(lease), lambda _row: None, slow_complete)
        else:
            self._tx(complete)

    @staticmethod
    def _end_attempt(
        conn: Connection, attempt_id: str | None, outcome: AttemptOutcome, now: float, error: str | None
    ) -> bool:
        if attempt_id is None:
            return False
        return bool(
            conn.execute(
                sa.update(attempts)
                .where(
                    attempts.c.attempt_id == attempt_id, attempts.c.outcome == AttemptOutcome.RUNNING.value
                )
                .values(outcome=outcome.value, ended_at=_ts(now), error=error)
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
    ) -> bool:
        """End an attempt; if it still holds the shard's lease, free the shard for the next attempt."""
        shard, now = self._lock_shard(conn, job_id, shard_index)
        self._end_attempt(conn, attempt_id, outcome, now, error)
        holds = (
            shard.state is ShardState.LEASED
            and shard.lease_attempt_id == attempt_id
            and (epoch is None or shard.epoch == epoch)
        )
        if holds:
            after = shard_state_after(outcome)
            check_shard_transition(shard.state, after, shard_id=shard.shard_id)
            conn.execute(
                sa.update(shards)
                .where(_shard_key(job_id, shard_index))
                .values(
                    state=after.value,
                    lease_attempt_id=None,
                    lease_expires_at=None,
                    last_error=error or outcome.value,
                    updated_at=_ts(now),
                )
            )
        return holds

    def release(self, lease: Lease, outcome: AttemptOutcome | str, error: str | None = None) -> bool:
        """End the attempt as ``outcome``; free the shard at once if the attempt still held it.

        Returns False (and raises nothing) when the attempt was already fenced.
        """
        outcome = AttemptOutcome(outcome)
        if outcome in (AttemptOutcome.RUNNING, AttemptOutcome.SUCCEEDED):
            raise ValueError(
                f"release() ends a failed attempt; use complete_shard() for success, not {outcome.value}"
            )
        return self._tx(
            lambda conn: self._end_lease(
                conn, lease.job_id, lease.shard_index, lease.attempt_id, lease.epoch, outcome, error
            )
        )

    def abandon_attempt(self, job_id: str, shard_index: int, attempt_id: str, reason: str) -> bool:
        """The launcher saw the attempt's process die: end it ``abandoned``, make the shard claimable now."""
        return self._tx(
            lambda conn: self._end_lease(
                conn, job_id, shard_index, attempt_id, None, AttemptOutcome.ABANDONED, reason
            )
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

    def progress(self, job_id: str) -> Progress:
        """Progress counted from commits only (invariant 4); work estimates pro rata per microbatch."""

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
            outcome_counts: dict[str, int] = dict(
                conn.execute(
                    sa.select(attempts.c.outcome, sa.func.count())
                    .where(attempts.c.job_id == job_id)
                    .group_by(attempts.c.outcome)
                )
                .tuples()
                .all()
            )
            by_state: dict[str, int] = {}
            committed_work = remaining_work = 0.0
            for shard in shard_rows:
                by_state[shard.state.value] = by_state.get(shard.state.value, 0) + 1
                done = (
                    1.0
                    if shard.num_microbatches == 0
                    else min(shard.cursor, shard.num_microbatches) / shard.num_microbatches
                )
                if shard.state is ShardState.SUCCEEDED:
                    done = 1.0
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
                attempts=sum(outcome_counts.values()),
                preemptions=sum(n for outcome, n in outcome_counts.items() if outcome in PREEMPTION_OUTCOMES),
                committed_work_s=committed_work,
                remaining_work_s=remaining_work,
                updated_at=max(stamps),
            )

        return self._tx(read, write=False)


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
    """Refuse a plan that could not yield exactly one outcome per input line (invariant 1)."""
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
