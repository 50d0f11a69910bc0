"""The manifest store's tables (SQLAlchemy Core) and the two SQL constructs the store needs.

Table names carry the ``adb_`` prefix so the store can share a database with Airflow's own tables;
Alembic's version table is ``adb_alembic_version`` for the same reason. The migrations under
``migrations/versions`` create exactly these tables; change both together.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import expression
from sqlalchemy.sql.compiler import SQLCompiler

VERSION_TABLE = "adb_alembic_version"
UTC = dt.timezone.utc

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(sa.TypeDecorator[dt.datetime]):
    """Aware UTC datetimes in and out on every dialect (SQLite stores them naive, in UTC)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: sa.Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
            raise ValueError(f"the manifest store takes timezone-aware datetimes only, got {value!r}")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: sa.Dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


class db_epoch(expression.FunctionElement[float]):  # noqa: N801 - reads as a SQL function
    """The database server's clock as float seconds since the Unix epoch.

    Lease expiry is always computed from this clock, never the caller's, so clock skew between
    workers cannot lengthen or shorten a lease.
    """

    type = sa.Double()
    name = "db_epoch"
    inherit_cache = True


@compiles(db_epoch)
def _db_epoch_sqlite(element: db_epoch, compiler: SQLCompiler, **kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


@compiles(db_epoch, "postgresql")
def _db_epoch_postgresql(element: db_epoch, compiler: SQLCompiler, **kw: Any) -> str:
    # clock_timestamp(), not now(): now() is frozen at the start of the transaction.
    return "CAST(extract(epoch from clock_timestamp()) AS double precision)"


class db_timestamp(expression.FunctionElement[dt.datetime]):  # noqa: N801 - reads as a SQL function
    """The database server's clock as a timestamp, for row stamps written in the same statement."""

    type = UTCDateTime()
    name = "db_timestamp"
    inherit_cache = True


@compiles(db_timestamp)
def _db_timestamp_sqlite(element: db_timestamp, compiler: SQLCompiler, **kw: Any) -> str:
    return "strftime('%Y-%m-%d %H:%M:%f', 'now')"


@compiles(db_timestamp, "postgresql")
def _db_timestamp_postgresql(element: db_timestamp, compiler: SQLCompiler, **kw: Any) -> str:
    return "clock_timestamp()"


jobs = sa.Table(
    "adb_jobs",
    metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("idempotency_key", sa.String(255), nullable=True, unique=True),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    sa.Column("deadline", UTCDateTime(), nullable=False),
    sa.Column("input_uri", sa.Text(), nullable=False),
    sa.Column("input_sha256", sa.String(64), nullable=False),
    sa.Column("input_lines", sa.Integer(), nullable=False),
    sa.Column("input_total_lines", sa.Integer(), nullable=False),
    sa.Column("output_uri", sa.Text(), nullable=False),
    sa.Column("config", JSONType, nullable=False),
    # copied from config so that a claim can check it in SQL, in the same statement that claims
    sa.Column("max_attempts", sa.Integer(), nullable=False),
    sa.Column("admission", JSONType, nullable=True),
    sa.Column("manifest_uri", sa.Text(), nullable=True),
    sa.Column("manifest_sha256", sa.String(64), nullable=True),
    sa.Column("completed_at", UTCDateTime(), nullable=True),
    sa.Column("error", sa.Text(), nullable=True),
    # core.tenants: the team the job belongs to (revision 0003; older jobs are "default")
    sa.Column("tenant", sa.String(63), nullable=False, server_default="default"),
    sa.Index("ix_adb_jobs_tenant_created_at", "tenant", "created_at"),
)

shards = sa.Table(
    "adb_shards",
    metadata,
    sa.Column(
        "job_id", sa.String(64), sa.ForeignKey("adb_jobs.job_id", ondelete="CASCADE"), primary_key=True
    ),
    sa.Column("shard_index", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("epoch", sa.Integer(), nullable=False),
    sa.Column("lease_attempt_id", sa.String(64), nullable=True),
    sa.Column("lease_expires_at", sa.Double(), nullable=True),
    sa.Column("lease_ttl_s", sa.Double(), nullable=True),
    sa.Column("attempts", sa.Integer(), nullable=False),
    # tries that spent the max_attempts budget: deterministic failures without a commit (§6.6)
    sa.Column("failures", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("byte_start", sa.BigInteger(), nullable=False),
    sa.Column("byte_end", sa.BigInteger(), nullable=False),
    sa.Column("first_line", sa.Integer(), nullable=False),
    sa.Column("line_count", sa.Integer(), nullable=False),
    sa.Column("records", sa.Integer(), nullable=False),
    sa.Column("excluded_lines", JSONType, nullable=False),
    sa.Column("input_sha256", sa.String(64), nullable=False),
    sa.Column("est_work_s", sa.Double(), nullable=False),
    sa.Column("num_microbatches", sa.Integer(), nullable=False),
    sa.Column("cursor", sa.Integer(), nullable=False),
    sa.Column("last_pool", sa.String(128), nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    # the tail race (revision 0005): at most one speculative attempt beside the lease's, fenced by
    # its own attempt ID and race_epoch (== epoch while it races); None when no racer
    sa.Column("race_attempt_id", sa.String(64), nullable=True),
    sa.Column("race_epoch", sa.Integer(), nullable=True),
    sa.Column("race_expires_at", sa.Double(), nullable=True),
    sa.Column("race_ttl_s", sa.Double(), nullable=True),
)

attempts = sa.Table(
    "adb_attempts",
    metadata,
    sa.Column("attempt_id", sa.String(64), primary_key=True),
    sa.Column("job_id", sa.String(64), nullable=False),
    sa.Column("shard_index", sa.Integer(), nullable=False),
    sa.Column("epoch", sa.Integer(), nullable=False),
    sa.Column("worker", sa.String(255), nullable=False),
    sa.Column("pool", sa.String(128), nullable=True),
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("ended_at", UTCDateTime(), nullable=True),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("error", sa.Text(), nullable=True),
    sa.Column("heartbeat_at", UTCDateTime(), nullable=True),
    # core.failures.FailureClass of a failed try (None: running, succeeded, or not classified)
    sa.Column("failure_class", sa.String(32), nullable=True),
    # a speculative duplicate started beside a live lease (the tail race, revision 0005)
    sa.Column("speculative", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.ForeignKeyConstraint(
        ["job_id", "shard_index"], ["adb_shards.job_id", "adb_shards.shard_index"], ondelete="CASCADE"
    ),
    sa.Index("ix_adb_attempts_job_id_shard_index", "job_id", "shard_index"),
    # earlier jobs' tries on a pool, newest first (store/pool_stats.py)
    sa.Index("ix_adb_attempts_pool_ended_at", "pool", "ended_at"),
)

commits = sa.Table(
    "adb_commits",
    metadata,
    # No foreign keys: -1 is the planner's validation-errors object, which belongs to no shard, and
    # a key to adb_jobs would make every commit share-lock the one job row (on PostgreSQL a
    # MultiXact per commit under concurrency). create_job and the fenced UPDATE guard integrity.
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("shard_index", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("attempt_id", sa.String(64), nullable=False),
    sa.Column("epoch", sa.Integer(), nullable=False),
    sa.Column("uri", sa.Text(), nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("records", sa.Integer(), nullable=False),
    sa.Column("counts", JSONType, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
    sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
    sa.Column("elapsed_s", sa.Double(), nullable=False),
    sa.Column("model_digest", sa.String(128), nullable=True),
    sa.Column("pool", sa.String(128), nullable=True),
    sa.Column("committed_at", UTCDateTime(), nullable=False),
    # earlier jobs' measured rates on a pool, newest first (store/throughput.py)
    sa.Index("ix_adb_commits_pool_committed_at", "pool", "committed_at"),
)

usage = sa.Table(
    "adb_usage",
    metadata,
    # One row per attempt, settled once by the finalizer (store.usage): what the attempt consumed,
    # whether or not its output was kept. The primary key makes a second settlement a no-op.
    sa.Column("attempt_id", sa.String(64), primary_key=True),
    sa.Column("job_id", sa.String(64), nullable=False, index=True),
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("shard_index", sa.Integer(), nullable=False),
    sa.Column("pool", sa.String(128), nullable=True),
    sa.Column("pool_kind", sa.String(32), nullable=True),
    sa.Column("price_per_gpu_hour", sa.Double(), nullable=False),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
    sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
    sa.Column("committed_records", sa.Integer(), nullable=False),
    sa.Column("superseded_records", sa.Integer(), nullable=False),
    sa.Column("gpu_seconds", sa.Double(), nullable=False),
    sa.Column("cost", sa.Double(), nullable=False),
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("ended_at", UTCDateTime(), nullable=True),
    sa.Column("settled_at", UTCDateTime(), nullable=False),
    sa.Index("ix_adb_usage_tenant_started_at", "tenant", "started_at"),
)

pool_capacity = sa.Table(
    "adb_pool_capacity",
    metadata,
    # GPUs of a pool shared by every tenant's jobs (`deadline-batch capacity set`); a pool without
    # a row is not managed: its jobs are admitted alone, as before revision 0003
    sa.Column("pool", sa.String(128), primary_key=True),
    sa.Column("gpus", sa.Integer(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
)

tenant_quotas = sa.Table(
    "adb_tenant_quotas",
    metadata,
    # `deadline-batch quota set`: None is no limit
    sa.Column("tenant", sa.String(63), primary_key=True),
    sa.Column("spot_gpus", sa.Integer(), nullable=True),
    sa.Column("on_demand_gpus", sa.Integer(), nullable=True),
    sa.Column("budget", sa.Double(), nullable=True),
    sa.Column("budget_period_s", sa.Double(), nullable=True),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    # core.dispatch: the tenant's weight in fair shares of managed pools (revision 0004)
    sa.Column("weight", sa.Double(), nullable=False, server_default="1"),
)

dispatch_requests = sa.Table(
    "adb_dispatch",
    metadata,
    # store/dispatch.py: one row per shard that waits for, or holds, a slot of a managed pool; the
    # runner renews its rows (expires_at), and a dead runner's rows expire so its slots come back.
    # Times are database-clock epoch seconds, like lease expiry.
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("shard_index", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("pool", sa.String(128), nullable=False),
    sa.Column("latest_start", sa.Double(), nullable=False),
    sa.Column("requested_at", sa.Double(), nullable=False),
    sa.Column("expires_at", sa.Double(), nullable=False),
    sa.Column("granted_at", sa.Double(), nullable=True),
    sa.Column("grant_seq", sa.Integer(), nullable=True),
    # the run that posted the row: only it renews, launches on or gives back the row (two runs of
    # one job must not release each other's slots); NULL for callers that name no run
    sa.Column("runner", sa.String(64), nullable=True),
    sa.Index("ix_adb_dispatch_pool", "pool"),
)

dispatch_grants = sa.Table(
    "adb_dispatch_grants",
    metadata,
    # the append-only audit record of grants: what the rule saw (state) and chose, in grant order;
    # released_at/release are filled once, when the slot comes back
    sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("pool", sa.String(128), nullable=False),
    sa.Column("tenant", sa.String(63), nullable=False),
    sa.Column("job_id", sa.String(64), nullable=False),
    sa.Column("shard_index", sa.Integer(), nullable=False),
    sa.Column("latest_start", sa.Double(), nullable=False),
    sa.Column("requested_at", sa.Double(), nullable=False),
    sa.Column("granted_at", sa.Double(), nullable=False),
    sa.Column("reason", sa.String(32), nullable=False),
    sa.Column("slots", sa.Integer(), nullable=False),
    sa.Column("state", JSONType, nullable=False),
    sa.Column("released_at", sa.Double(), nullable=True),
    sa.Column("release", sa.String(32), nullable=True),
    sa.Index("ix_adb_dispatch_grants_job_id", "job_id"),
)

launch_reservations = sa.Table(
    "adb_launch_reservations",
    metadata,
    # store/tenancy.py: a GPU of a tenant's quota taken by a runner for a worker it is starting,
    # counted until the worker's claim is visible (its lease counts from then on) or the worker
    # exits; the runner renews it (expires_at), so a dead runner's reservation expires by itself.
    # Times are database-clock epoch seconds, like lease expiry (revision 0006).
    sa.Column("reservation_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(63), nullable=False),
    # core.pools.PoolKind: the quota the GPU counts against
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("job_id", sa.String(64), nullable=False),
    sa.Column("shard_index", sa.Integer(), nullable=False),
    sa.Column("pool", sa.String(128), nullable=False),
    # the run that reserved it: only it renews it, names its worker and gives it back
    sa.Column("runner", sa.String(64), nullable=False),
    # the worker's name (``host:pid``) once started: its claim is the attempt of that name
    sa.Column("worker", sa.String(255), nullable=True),
    sa.Column("reserved_at", sa.Double(), nullable=False),
    sa.Column("expires_at", sa.Double(), nullable=False),
    sa.Index("ix_adb_launch_reservations_tenant", "tenant"),
)
