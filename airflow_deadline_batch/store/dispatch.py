"""SQL of the shared dispatcher: requests for slots of managed pools, grants, and their record.

Functions over a :class:`Connection` inside a transaction the :class:`ManifestStore` opens, after
:func:`lock_dispatch`; which request gets a slot is decided by the pure ``core.dispatch`` rule.
Times are database-clock epoch seconds (``db_epoch()``), like lease expiry. A pool is managed
when it has a ``capacity`` row; requests on any other pool are never written by the runner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.dispatch import DispatchRequest, Grant, plan_grants, weight_of
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.store.rows import DispatchGrantRow, DispatchRow
from airflow_deadline_batch.store.schema import (
    dispatch_grants,
    dispatch_requests,
    pool_capacity,
    shards,
    tenant_quotas,
)

#: pg_advisory_xact_lock key that serializes dispatch passes ("adb_disp")
DISPATCH_LOCK_KEY = 0x6164625F64697370


def lock_dispatch(conn: Connection) -> None:
    """Serialize dispatch passes: on PostgreSQL a transaction-scoped advisory lock.

    Held from the read of the held slots to the last grant written, so two runners polling at
    once cannot both hand out the same free slot. SQLite write transactions run alone already.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": DISPATCH_LOCK_KEY})


def _key(job_id: str, shard_index: int) -> sa.ColumnElement[bool]:
    return sa.and_(dispatch_requests.c.job_id == job_id, dispatch_requests.c.shard_index == shard_index)


def get_request(conn: Connection, job_id: str, shard_index: int) -> DispatchRow | None:
    row = conn.execute(sa.select(dispatch_requests).where(_key(job_id, shard_index))).first()
    return DispatchRow.from_row(row) if row is not None else None


def post_request(
    conn: Connection,
    *,
    job_id: str,
    shard_index: int,
    tenant: str,
    pool: str,
    latest_start: float,
    now: float,
    ttl_s: float,
    runner: str | None = None,
) -> None:
    """Ask for a slot of ``pool`` for a shard; a request or grant on another pool is given up.

    A live row another run of the job posted is left alone: the caller sees its ``runner``.
    """
    existing = get_request(conn, job_id, shard_index)
    if existing is not None and existing.runner != runner:
        return
    if existing is not None and existing.pool == pool:
        conn.execute(
            sa.update(dispatch_requests).where(_key(job_id, shard_index)).values(expires_at=now + ttl_s)
        )
        return
    if existing is not None:
        end_rows(conn, [existing], now, "withdrawn")
    conn.execute(
        sa.insert(dispatch_requests).values(
            job_id=job_id,
            shard_index=shard_index,
            tenant=tenant,
            pool=pool,
            latest_start=latest_start,
            requested_at=now,
            expires_at=now + ttl_s,
            runner=runner,
        )
    )


def renew(conn: Connection, job_id: str, now: float, ttl_s: float, runner: str | None = None) -> None:
    """The job's runner is alive: push its rows' expiry out by ``ttl_s`` (``runner``'s rows only)."""
    query = sa.update(dispatch_requests).where(dispatch_requests.c.job_id == job_id)
    if runner is not None:
        query = query.where(dispatch_requests.c.runner == runner)
    conn.execute(query.values(expires_at=now + ttl_s))


def job_rows(
    conn: Connection, job_id: str, shard_index: int | None = None, runner: str | None = None
) -> list[DispatchRow]:
    """The job's rows (of one shard; of one run when ``runner`` is given)."""
    query = sa.select(dispatch_requests).where(dispatch_requests.c.job_id == job_id)
    if shard_index is not None:
        query = query.where(dispatch_requests.c.shard_index == shard_index)
    if runner is not None:
        query = query.where(dispatch_requests.c.runner == runner)
    return [DispatchRow.from_row(r) for r in conn.execute(query.order_by(dispatch_requests.c.shard_index))]


def end_rows(conn: Connection, rows: Sequence[DispatchRow], now: float, how: str) -> None:
    """Delete requests and grants; a granted slot's record notes when and how it came back."""
    for row in rows:
        conn.execute(sa.delete(dispatch_requests).where(_key(row.job_id, row.shard_index)))
        if row.grant_seq is not None:
            conn.execute(
                sa.update(dispatch_grants)
                .where(dispatch_grants.c.seq == row.grant_seq, dispatch_grants.c.released_at.is_(None))
                .values(released_at=now, release=how)
            )


def expire(conn: Connection, now: float) -> None:
    """Rows their runner stopped renewing (it died or stalls): waiting ones go, held slots come back.

    A held slot whose shard a worker still leases (state ``leased``, lease not expired) stays held
    however long its runner is gone: the worker renews its lease and keeps using the GPU, so handing
    its slot out again would run the pool over capacity. It comes back once that lease ends.
    """
    live_worker = (
        sa.select(shards.c.shard_index)
        .where(
            shards.c.job_id == dispatch_requests.c.job_id,
            shards.c.shard_index == dispatch_requests.c.shard_index,
            shards.c.state == ShardState.LEASED.value,
            shards.c.lease_expires_at >= now,
        )
        .exists()
    )
    query = sa.select(dispatch_requests).where(
        dispatch_requests.c.expires_at < now,
        sa.not_(sa.and_(dispatch_requests.c.granted_at.is_not(None), live_worker)),
    )
    end_rows(conn, [DispatchRow.from_row(r) for r in conn.execute(query)], now, "expired")


def grant_free_slots(conn: Connection, now: float) -> None:
    """Grant every free slot of every managed pool by the rule, and record each grant."""
    slots = {row.pool: int(row.gpus) for row in conn.execute(sa.select(pool_capacity))}
    if not slots:
        return
    rows = [
        DispatchRow.from_row(r)
        for r in conn.execute(sa.select(dispatch_requests).where(dispatch_requests.c.pool.in_(list(slots))))
    ]
    waiting_pools = {r.pool for r in rows if not r.granted}
    if not waiting_pools:
        return
    weights = {row.tenant: float(row.weight) for row in conn.execute(sa.select(tenant_quotas))}
    seq = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(dispatch_grants.c.seq), 0))).scalar_one())
    for pool in sorted(waiting_pools):
        held: dict[str, int] = {}
        for r in rows:
            if r.pool == pool and r.granted:
                held[r.tenant] = held.get(r.tenant, 0) + 1
        waiting = [
            DispatchRequest(
                job_id=r.job_id,
                shard_index=r.shard_index,
                tenant=r.tenant,
                latest_start=r.latest_start,
                requested_at=r.requested_at,
            )
            for r in rows
            if r.pool == pool and not r.granted
        ]
        for grant in plan_grants(slots[pool], held, weights, waiting):
            seq += 1
            _write_grant(conn, seq, pool, slots[pool], grant, weights, waiting, now)
            waiting.remove(grant.request)


def _write_grant(
    conn: Connection,
    seq: int,
    pool: str,
    slots: int,
    grant: Grant,
    weights: Mapping[str, float],
    waiting: Sequence[DispatchRequest],
    now: float,
) -> None:
    request = grant.request
    conn.execute(
        sa.update(dispatch_requests)
        .where(_key(request.job_id, request.shard_index))
        .values(granted_at=now, grant_seq=seq)
    )
    conn.execute(
        sa.insert(dispatch_grants).values(
            seq=seq,
            pool=pool,
            tenant=request.tenant,
            job_id=request.job_id,
            shard_index=request.shard_index,
            latest_start=request.latest_start,
            requested_at=request.requested_at,
            granted_at=now,
            reason=grant.reason.value,
            slots=slots,
            state=_grant_state(grant, weights, waiting),
        )
    )


def _grant_state(
    grant: Grant, weights: Mapping[str, float], waiting: Sequence[DispatchRequest]
) -> dict[str, Any]:
    """What the rule saw: enough to decide the grant again from the record alone."""
    tenants: dict[str, Any] = {}
    for tenant in sorted({*grant.held, *grant.shares}):
        best = grant.best.get(tenant)
        tenants[tenant] = {
            "held": grant.held.get(tenant, 0),
            "share": grant.shares.get(tenant, 0.0),
            "weight": weight_of(weights, tenant),
            "waiting": sum(1 for r in waiting if r.tenant == tenant),
            "best": None
            if best is None
            else [best.latest_start, best.requested_at, best.job_id, best.shard_index],
        }
    return {"free": grant.free, "tenants": tenants}


def list_requests(conn: Connection, pool: str | None) -> list[DispatchRow]:
    query = sa.select(dispatch_requests)
    if pool is not None:
        query = query.where(dispatch_requests.c.pool == pool)
    query = query.order_by(dispatch_requests.c.pool, dispatch_requests.c.latest_start)
    return [DispatchRow.from_row(r) for r in conn.execute(query)]


def list_grants(conn: Connection, pool: str | None, job_id: str | None) -> list[DispatchGrantRow]:
    query = sa.select(dispatch_grants)
    if pool is not None:
        query = query.where(dispatch_grants.c.pool == pool)
    if job_id is not None:
        query = query.where(dispatch_grants.c.job_id == job_id)
    return [DispatchGrantRow.from_row(r) for r in conn.execute(query.order_by(dispatch_grants.c.seq))]
