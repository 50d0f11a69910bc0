"""SQL of tenants, the usage ledger, pool capacity and tenant quotas (docs/tenants.md).

Functions over a :class:`Connection` inside a transaction the :class:`ManifestStore` opens; what
the rows mean (earliest-deadline-first admission, budgets) is decided in ``core.admission``.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.job_view import build_job_view, pool_named, shard_done_fraction
from airflow_deadline_batch.core.pools import PoolSpec
from airflow_deadline_batch.core.states import TERMINAL_JOB_STATES, JobState, ShardState
from airflow_deadline_batch.store.leases import attempt_pool
from airflow_deadline_batch.store.rows import (
    CommitRow,
    JobRow,
    PoolCapacityRow,
    ShardRow,
    TenantQuotaRow,
    UsageRow,
)
from airflow_deadline_batch.store.schema import (
    attempts,
    commits,
    db_epoch,
    jobs,
    launch_reservations,
    pool_capacity,
    shards,
    tenant_quotas,
    usage,
)

#: pg_advisory_xact_lock key that serializes admissions against shared capacity ("adb_admi")
ADMISSION_LOCK_KEY = 0x6164625F61646D69
#: jobs that still hold capacity: admitted and not yet finished
HOLDING_JOB_STATES = (JobState.ADMITTED.value, JobState.RUNNING.value)


@dataclass(frozen=True, kw_only=True)
class HeldWork:
    """An admitted, unfinished job and the work it still holds (estimated GPU-seconds)."""

    job_id: str
    tenant: str
    deadline: dt.datetime
    pools: tuple[str, ...]
    admission: Mapping[str, Any] | None
    est_work_s: float
    remaining_work_s: float
    #: measured seconds per estimated second of work (1.0 before the job committed anything)
    work_scale: float = 1.0
    #: each of its pools' queue wait + startup, as its plan recorded them
    pool_leads: Mapping[str, float] = field(default_factory=dict)
    #: each of its pools' GPUs, as its plan declared them (admission counts those of its unmanaged
    #: pools as its own)
    pool_gpus: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class JobCost:
    """A tenant's job in the budget period: its projected cost, and its settled cost once settled
    (0 once it finished without any attempt: nothing ran, so the ledger has no row of it)."""

    job_id: str
    admission: Mapping[str, Any] | None
    settled_cost: float | None


@dataclass(frozen=True, kw_only=True)
class TenancySnapshot:
    """What admission of one tenant's job reads, in the transaction that records the job."""

    now: dt.datetime
    tenant: str
    capacity: Mapping[str, int]
    quota: TenantQuotaRow | None
    held: tuple[HeldWork, ...]
    #: the tenant's jobs created within its budget period (empty without a budget)
    period_jobs: tuple[JobCost, ...]


def lock_admissions(conn: Connection) -> None:
    """Serialize admissions: on PostgreSQL a transaction-scoped advisory lock.

    On SQLite every write transaction already runs alone (``BEGIN IMMEDIATE``). The lock is held
    until the job is recorded, so a second admission reads the first one's job and cannot count
    the same free capacity.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK_KEY})


def read_snapshot(conn: Connection, tenant: str, now: dt.datetime) -> TenancySnapshot:
    """Capacity, the tenant's quota, every holding job's remaining work, the tenant's period jobs."""
    capacity = {row.pool: row.gpus for row in list_capacity(conn)}
    quota = get_quota(conn, tenant)
    held = tuple(_held_work(conn, now)) if capacity else ()
    period: tuple[JobCost, ...] = ()
    if quota is not None and quota.budget is not None and quota.budget_period_s:
        period = tuple(_period_jobs(conn, tenant, _period_start(now, quota.budget_period_s)))
    return TenancySnapshot(
        now=now, tenant=tenant, capacity=capacity, quota=quota, held=held, period_jobs=period
    )


def _period_start(now: dt.datetime, period_s: float) -> dt.datetime:
    """``now - period_s``; a period reaching back before the calendar begins counts every job."""
    try:
        return now - dt.timedelta(seconds=period_s)
    except OverflowError:
        return dt.datetime.min.replace(tzinfo=dt.timezone.utc)


def _held_work(conn: Connection, now: dt.datetime) -> Iterable[HeldWork]:
    """Every holding job with its remaining work, re-rated by the throughput its commits measured."""
    rows = [
        JobRow.from_row(r) for r in conn.execute(sa.select(jobs).where(jobs.c.state.in_(HOLDING_JOB_STATES)))
    ]
    if not rows:
        return
    ids = [job.job_id for job in rows]
    job_shards: dict[str, list[ShardRow]] = {}
    for raw in conn.execute(sa.select(shards).where(shards.c.job_id.in_(ids))):
        shard = ShardRow.from_row(raw)
        job_shards.setdefault(shard.job_id, []).append(shard)
    job_commits: dict[str, list[CommitRow]] = {}
    measured = sa.select(commits).where(commits.c.job_id.in_(ids), commits.c.shard_index >= 0)
    for raw in conn.execute(measured):
        commit = CommitRow.from_row(raw)
        job_commits.setdefault(commit.job_id, []).append(commit)
    for job in rows:
        own = job_shards.get(job.job_id, [])
        scale = 1.0
        if job.config.get("pools") and job_commits.get(job.job_id):
            # the job view's calibrated slowdown: the rates its committed microbatches measured
            scale = build_job_view(job, own, job_commits[job.job_id], now=now).work_scale
        yield HeldWork(
            job_id=job.job_id,
            tenant=job.tenant,
            deadline=job.deadline,
            pools=tuple(str(p.get("name")) for p in job.config.get("pools") or ()),
            admission=job.admission,
            est_work_s=sum(s.est_work_s for s in own),
            remaining_work_s=sum(s.est_work_s * (1.0 - shard_done_fraction(s)) for s in own),
            work_scale=scale,
            pool_leads=_pool_leads(job.config.get("pools") or ()),
            pool_gpus=_pool_gpus(job.config.get("pools") or ()),
        )


def _pool_leads(pools: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    leads = {}
    for pool in pools:
        lead = float(pool.get("queue_wait_seconds") or 0.0) + float(pool.get("startup_seconds") or 0.0)
        leads[str(pool.get("name"))] = lead if math.isfinite(lead) and lead >= 0 else 0.0
    return leads


def _pool_gpus(pools: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    gpus = {}
    for pool in pools:
        count = pool.get("gpus", 1)
        gpus[str(pool.get("name"))] = count if isinstance(count, int) and count >= 0 else 0
    return gpus


def _period_jobs(conn: Connection, tenant: str, since: dt.datetime) -> Iterable[JobCost]:
    settled = (
        sa.select(usage.c.job_id, sa.func.sum(usage.c.cost).label("cost")).group_by(usage.c.job_id).subquery()
    )
    ran = sa.exists().where(attempts.c.job_id == jobs.c.job_id)
    query = (
        sa.select(jobs.c.job_id, jobs.c.admission, jobs.c.state, settled.c.cost, ran.label("ran"))
        .select_from(jobs.outerjoin(settled, settled.c.job_id == jobs.c.job_id))
        .where(
            jobs.c.tenant == tenant,
            jobs.c.created_at >= since,
            jobs.c.state != JobState.REJECTED.value,
        )
    )
    finished = {s.value for s in TERMINAL_JOB_STATES}
    for row in conn.execute(query):
        cost = None if row.cost is None else float(row.cost)
        if cost is None and row.state in finished and not row.ran:
            cost = 0.0  # finished before any attempt (cancelled while it waited): it spent nothing
        yield JobCost(job_id=row.job_id, admission=row.admission, settled_cost=cost)


@dataclass(frozen=True, kw_only=True)
class LiveLease:
    """A live lease of a tenant's running job: the GPU it holds, and the worker holding it."""

    job_id: str
    shard_index: int
    pool: str | None
    #: the holding attempt's worker (``host:pid`` for a local worker); its launch reservation, if
    #: any, no longer counts: the lease does
    worker: str | None
    config: Any

    @property
    def kind(self) -> str | None:
        """The pool's kind in the job's pool definitions (None: no such pool)."""
        pools = [PoolSpec.from_dict(p) for p in (self.config or {}).get("pools") or ()]
        pool = pool_named(self.pool, pools)
        return None if pool is None else pool.kind.value


def live_leases(conn: Connection, tenant: str, exclude_job: str | None) -> list[LiveLease]:
    """Every live lease of the tenant's running jobs (database clock).

    A shard's primary lease runs on its ``last_pool``; a live racing lease beside it holds a GPU
    of the racer's own pool (its attempt row's), so a racing shard counts twice.
    """
    held = [
        jobs.c.tenant == tenant,
        jobs.c.state.in_(HOLDING_JOB_STATES),
        shards.c.state == ShardState.LEASED.value,
    ]
    if exclude_job is not None:
        held.append(jobs.c.job_id != exclude_job)
    joined = shards.join(jobs, jobs.c.job_id == shards.c.job_id)
    primary = (
        sa.select(
            shards.c.job_id,
            shards.c.shard_index,
            shards.c.last_pool.label("pool"),
            _attempt_worker(shards.c.lease_attempt_id).label("worker"),
            jobs.c.config,
        )
        .select_from(joined)
        .where(*held, shards.c.lease_expires_at > db_epoch())
    )
    racing = (
        sa.select(
            shards.c.job_id,
            shards.c.shard_index,
            attempt_pool(shards.c.race_attempt_id).label("pool"),
            _attempt_worker(shards.c.race_attempt_id).label("worker"),
            jobs.c.config,
        )
        .select_from(joined)
        .where(*held, shards.c.race_attempt_id.is_not(None), shards.c.race_expires_at > db_epoch())
    )
    return [
        LiveLease(
            job_id=row.job_id,
            shard_index=row.shard_index,
            pool=row.pool,
            worker=row.worker,
            config=row.config,
        )
        for row in conn.execute(sa.union_all(primary, racing))
    ]


def _attempt_worker(attempt_id: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
    return sa.select(attempts.c.worker).where(attempts.c.attempt_id == attempt_id).scalar_subquery()


# -- launch reservations: the tenant GPU quota while jobs run -----------------------------------------
# A runner takes a reservation in the transaction that checks the quota, before it starts a worker,
# so two runners (of two jobs, or of one job) checking at once cannot both take the last GPU. The
# reservation counts until the worker's claim is visible (then its lease counts, never both) or
# the runner gives it back; a runner that dies stops renewing it and it expires.

#: pg_advisory_xact_lock key that serializes launch reservations ("adb_quot")
LAUNCH_LOCK_KEY = 0x6164625F71756F74


def gpus_held(
    conn: Connection, tenant: str, now: float, *, exclude_job: str | None = None
) -> tuple[dict[str, int], list[str]]:
    """GPUs of each pool kind the tenant holds, and the reservations whose worker has claimed.

    Every live lease counts, and so does every live reservation whose worker holds no live lease
    of its shard yet (not started, starting, or refused). A worker that claimed counts once, by
    its lease: its reservation is returned to be dropped. Both reads are under the caller's
    transaction; a claim commits its lease and makes the reservation claimed at once, so a read
    sees the worker on one side or the other.
    """
    counts: dict[str, int] = {}
    holders = set()
    for lease in live_leases(conn, tenant, exclude_job):
        holders.add((lease.job_id, lease.shard_index, lease.worker))
        kind = lease.kind
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    r = launch_reservations.c
    query = sa.select(r.reservation_id, r.kind, r.job_id, r.shard_index, r.worker).where(
        r.tenant == tenant, r.expires_at >= now
    )
    if exclude_job is not None:
        query = query.where(r.job_id != exclude_job)
    claimed = []
    for row in conn.execute(query):
        if row.worker is not None and (row.job_id, row.shard_index, row.worker) in holders:
            claimed.append(row.reservation_id)
        else:
            counts[row.kind] = counts.get(row.kind, 0) + 1
    return counts, claimed


def reserve_launch(
    conn: Connection,
    *,
    reservation_id: str,
    tenant: str,
    kind: str,
    job_id: str,
    shard_index: int,
    pool: str,
    runner: str,
    now: float,
    ttl_s: float,
) -> bool:
    """Reserve one GPU of ``kind`` for a worker the runner is about to start, if the quota allows.

    Serialized (on PostgreSQL an advisory lock held to the commit, on SQLite ``BEGIN IMMEDIATE``):
    expired reservations go, the tenant's holdings are counted and the reservation written in one
    transaction. Without a quota of that kind the reservation is written too, so a quota set
    while workers start still counts them.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": LAUNCH_LOCK_KEY})
    r = launch_reservations.c
    if conn.execute(sa.select(r.reservation_id).where(r.reservation_id == reservation_id)).first():
        return True  # a retry of a transaction whose commit was not acknowledged: it is ours already
    conn.execute(sa.delete(launch_reservations).where(r.expires_at < now))
    held, claimed = gpus_held(conn, tenant, now)
    if claimed:
        conn.execute(sa.delete(launch_reservations).where(r.reservation_id.in_(claimed)))
    quota = get_quota(conn, tenant)
    limit = None if quota is None else quota.gpus_of_kind(kind)
    if limit is not None and held.get(kind, 0) + 1 > limit:
        return False
    conn.execute(
        sa.insert(launch_reservations).values(
            reservation_id=reservation_id,
            tenant=tenant,
            kind=kind,
            job_id=job_id,
            shard_index=shard_index,
            pool=pool,
            runner=runner,
            reserved_at=now,
            expires_at=now + ttl_s,
        )
    )
    return True


def name_launch_worker(conn: Connection, reservation_id: str, worker: str) -> None:
    """The reserved worker started: its claim will be the attempt named ``worker``."""
    query = sa.update(launch_reservations).where(launch_reservations.c.reservation_id == reservation_id)
    conn.execute(query.values(worker=worker))


def renew_launches(conn: Connection, runner: str, now: float, ttl_s: float) -> None:
    """The runner is alive: push its reservations' expiry out by ``ttl_s``."""
    query = sa.update(launch_reservations).where(launch_reservations.c.runner == runner)
    conn.execute(query.values(expires_at=now + ttl_s))


def release_launches(conn: Connection, runner: str, reservation_id: str | None) -> None:
    """Give back one of the runner's reservations (its worker exited), or all of them."""
    query = sa.delete(launch_reservations).where(launch_reservations.c.runner == runner)
    if reservation_id is not None:
        query = query.where(launch_reservations.c.reservation_id == reservation_id)
    conn.execute(query)


# -- usage ledger -----------------------------------------------------------------------------------


def _insert_ignoring_duplicates(conn: Connection, table: sa.Table) -> Any:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(table).on_conflict_do_nothing()


def settle(conn: Connection, rows: Sequence[UsageRow], now: dt.datetime) -> None:
    """Insert each attempt's usage once: an attempt already settled is left as it is.

    Idempotent under a second finalizer, on both databases (``INSERT ... ON CONFLICT DO NOTHING``
    on the attempt ID); a concurrent finalizer's insert of the same attempt waits for ours.
    """
    if rows:
        values = [{**_usage_values(r), "settled_at": now} for r in rows]
        conn.execute(_insert_ignoring_duplicates(conn, usage), values)


def _usage_values(row: UsageRow) -> dict[str, Any]:
    data = {name: getattr(row, name) for name in UsageRow.__dataclass_fields__}
    data.pop("settled_at")
    return data


def job_usage(conn: Connection, job_id: str) -> list[UsageRow]:
    query = sa.select(usage).where(usage.c.job_id == job_id).order_by(usage.c.started_at, usage.c.attempt_id)
    return [UsageRow.from_row(r) for r in conn.execute(query)]


def _usage_of(query: sa.Select[Any], tenant: str | None, since: dt.datetime | None) -> sa.Select[Any]:
    if tenant is not None:
        query = query.where(usage.c.tenant == tenant)
    if since is not None:
        query = query.where(usage.c.started_at >= since)
    return query


def tenant_usage(conn: Connection, tenant: str | None, since: dt.datetime | None) -> list[UsageRow]:
    query = _usage_of(sa.select(usage), tenant, since)
    query = query.order_by(usage.c.tenant, usage.c.started_at, usage.c.attempt_id)
    return [UsageRow.from_row(r) for r in conn.execute(query)]


@dataclass(frozen=True, kw_only=True)
class PoolUsageTotal:
    """The ledger summed over one tenant's attempts on one pool (``pool`` None: not recorded)."""

    tenant: str
    pool: str | None
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    superseded_records: int
    gpu_seconds: float
    cost: float


def usage_totals(
    conn: Connection, tenant: str | None, since: dt.datetime | None
) -> tuple[list[PoolUsageTotal], dict[str, int]]:
    """The ledger summed per tenant and pool by the database, and each tenant's number of jobs.

    ``deadline-batch usage`` reads these few rows, not one per attempt: a tenant with a million
    settled attempts must not need a million rows in memory.
    """
    c = usage.c
    sums = _usage_of(
        sa.select(
            c.tenant,
            c.pool,
            sa.func.count().label("attempts"),
            sa.func.sum(c.prompt_tokens).label("prompt_tokens"),
            sa.func.sum(c.completion_tokens).label("completion_tokens"),
            sa.func.sum(c.superseded_records).label("superseded_records"),
            sa.func.sum(c.gpu_seconds).label("gpu_seconds"),
            sa.func.sum(c.cost).label("cost"),
        ),
        tenant,
        since,
    ).group_by(c.tenant, c.pool)
    totals = [
        PoolUsageTotal(
            tenant=row.tenant,
            pool=row.pool,
            attempts=int(row.attempts),
            prompt_tokens=int(row.prompt_tokens),  # PostgreSQL sums bigints as numeric
            completion_tokens=int(row.completion_tokens),
            superseded_records=int(row.superseded_records),
            gpu_seconds=float(row.gpu_seconds),
            cost=float(row.cost),
        )
        for row in conn.execute(sums)
    ]
    jobs_of = _usage_of(sa.select(c.tenant, sa.func.count(sa.distinct(c.job_id))), tenant, since)
    jobs = {row[0]: int(row[1]) for row in conn.execute(jobs_of.group_by(c.tenant))}
    return totals, jobs


# -- capacity and quotas -----------------------------------------------------------------------------


def list_capacity(conn: Connection) -> list[PoolCapacityRow]:
    query = sa.select(pool_capacity).order_by(pool_capacity.c.pool)
    return [PoolCapacityRow.from_row(r) for r in conn.execute(query)]


def set_capacity(conn: Connection, row: PoolCapacityRow, now: dt.datetime) -> None:
    conn.execute(sa.delete(pool_capacity).where(pool_capacity.c.pool == row.pool))
    conn.execute(sa.insert(pool_capacity).values(pool=row.pool, gpus=row.gpus, updated_at=now))


def delete_capacity(conn: Connection, pool: str) -> bool:
    return bool(conn.execute(sa.delete(pool_capacity).where(pool_capacity.c.pool == pool)).rowcount)


def get_quota(conn: Connection, tenant: str) -> TenantQuotaRow | None:
    row = conn.execute(sa.select(tenant_quotas).where(tenant_quotas.c.tenant == tenant)).first()
    return TenantQuotaRow.from_row(row) if row is not None else None


def list_quotas(conn: Connection) -> list[TenantQuotaRow]:
    query = sa.select(tenant_quotas).order_by(tenant_quotas.c.tenant)
    return [TenantQuotaRow.from_row(r) for r in conn.execute(query)]


def set_quota(conn: Connection, row: TenantQuotaRow, now: dt.datetime) -> None:
    conn.execute(sa.delete(tenant_quotas).where(tenant_quotas.c.tenant == row.tenant))
    conn.execute(
        sa.insert(tenant_quotas).values(
            tenant=row.tenant,
            spot_gpus=row.spot_gpus,
            on_demand_gpus=row.on_demand_gpus,
            budget=row.budget,
            budget_period_s=row.budget_period_s,
            weight=row.weight,
            updated_at=now,
        )
    )


def delete_quota(conn: Connection, tenant: str) -> bool:
    return bool(conn.execute(sa.delete(tenant_quotas).where(tenant_quotas.c.tenant == tenant)).rowcount)
