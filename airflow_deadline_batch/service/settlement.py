"""Usage settlement: every attempt's usage into the ledger once, the job's total into its manifest.

The finalizer calls :func:`settle_job` after the job is fenced (no attempt can commit any more)
and before garbage collection deletes uncommitted attempt objects, whose records carry the tokens
of output that was superseded. Each attempt is one ledger row keyed by its attempt ID, inserted
with ``ON CONFLICT DO NOTHING``: a second finalizer, a resumed finalization or a retry settles
nothing twice, and the manifest's totals are summed from the ledger rows as stored.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from airflow_deadline_batch.core.job_view import pool_named
from airflow_deadline_batch.core.pools import PoolSpec
from airflow_deadline_batch.core.results import SettledUsage
from airflow_deadline_batch.core.states import UNRUN_ATTEMPT_OUTCOMES, AttemptOutcome
from airflow_deadline_batch.exceptions import ObjectNotFound

if TYPE_CHECKING:
    from airflow_deadline_batch.storage.base import ObjectStorage
    from airflow_deadline_batch.store import AttemptRow, CommitRow, JobRow, ManifestStore, UsageRow
    from airflow_deadline_batch.store.tenancy import PoolUsageTotal

#: ``attempts/<attempt_id>/shard-<index>-mb-<seq>.jsonl`` (docs/internals.md, object keys)
_ATTEMPT_KEY = re.compile(r"^attempts/(?P<attempt>[^/]+)/shard-\d+-mb-\d+\.jsonl$")
#: outcomes the worker did not report itself: it may have died long before the attempt was ended
#: (an attempt no worker ran has no heartbeat, so it bills no GPU time)
_UNREPORTED = frozenset(
    {AttemptOutcome.LOST_LEASE, AttemptOutcome.ABANDONED, AttemptOutcome.RUNNING, *UNRUN_ATTEMPT_OUTCOMES}
)


@dataclass(frozen=True)
class _Tokens:
    prompt: int = 0
    completion: int = 0
    records: int = 0

    def __add__(self, other: _Tokens) -> _Tokens:
        return _Tokens(
            self.prompt + other.prompt, self.completion + other.completion, self.records + other.records
        )


def settle_job(store: ManifestStore, job: JobRow, output: ObjectStorage) -> SettledUsage:
    """Settle every attempt of ``job`` (idempotent) and return the job's totals from the ledger."""
    commits = [c for c in store.list_commits(job.job_id) if c.shard_index >= 0]
    superseded = superseded_tokens(output, {c.uri for c in commits})
    pools = tuple(PoolSpec.from_dict(p) for p in job.config.get("pools") or ())
    rows = attempt_usage(job, store.list_attempts(job.job_id), commits, superseded, pools)
    return totals(job.tenant, store.settle_usage(job.job_id, rows))


def superseded_tokens(output: ObjectStorage, committed_uris: set[str]) -> dict[str, _Tokens]:
    """Tokens of the attempt objects that were written but never committed, by attempt ID."""
    found: dict[str, _Tokens] = {}
    for key in output.list_keys("attempts/"):
        match = _ATTEMPT_KEY.match(key)
        if match is None or output.uri(key) in committed_uris:
            continue
        try:
            data = output.get_bytes(key)
        except ObjectNotFound:
            continue  # deleted meanwhile by another finalizer's garbage collection: it settled first
        attempt = match.group("attempt")
        found[attempt] = found.get(attempt, _Tokens()) + _object_tokens(data)
    return found


def _object_tokens(data: bytes) -> _Tokens:
    prompt = completion = records = 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            usage = orjson.loads(line).get("usage") or {}
        except orjson.JSONDecodeError:
            continue  # a torn write of a killed worker: its complete lines still count
        prompt += int(usage.get("prompt_tokens") or 0)
        completion += int(usage.get("completion_tokens") or 0)
        records += 1
    return _Tokens(prompt, completion, records)


def attempt_usage(
    job: JobRow,
    attempts: Iterable[AttemptRow],
    commits: Sequence[CommitRow],
    superseded: Mapping[str, _Tokens],
    pools: Sequence[PoolSpec],
) -> list[UsageRow]:
    """One ledger row per attempt: committed and superseded tokens, GPU-seconds, pool and price.

    GPU-seconds run from the attempt's start to its end; for an attempt the worker did not end
    itself (lost lease, abandoned) to its last sign of life (heartbeat or commit), since the
    worker may have died well before the store noticed.
    """
    from airflow_deadline_batch.store import UsageRow

    committed: dict[str, _Tokens] = {}
    last_commit: dict[str, dt.datetime] = {}
    for c in commits:
        committed[c.attempt_id] = committed.get(c.attempt_id, _Tokens()) + _Tokens(
            c.prompt_tokens, c.completion_tokens, c.records
        )
        last_commit[c.attempt_id] = max(c.committed_at, last_commit.get(c.attempt_id, c.committed_at))
    rows = []
    for a in attempts:
        pool = pool_named(a.pool, pools)
        price = pool.price_per_gpu_hour if pool is not None else 0.0
        end = a.ended_at
        if a.outcome in _UNREPORTED:
            alive = [t for t in (a.heartbeat_at, last_commit.get(a.attempt_id)) if t is not None]
            seen = max(alive, default=a.started_at)
            end = seen if end is None else min(end, seen)
        gpu_s = max(0.0, ((end or a.started_at) - a.started_at).total_seconds())
        kept = committed.get(a.attempt_id, _Tokens())
        lost = superseded.get(a.attempt_id, _Tokens())
        rows.append(
            UsageRow(
                attempt_id=a.attempt_id,
                job_id=job.job_id,
                tenant=job.tenant,
                shard_index=a.shard_index,
                pool=a.pool,
                pool_kind=pool.kind.value if pool is not None else None,
                price_per_gpu_hour=price,
                outcome=a.outcome.value,
                prompt_tokens=kept.prompt + lost.prompt,
                completion_tokens=kept.completion + lost.completion,
                committed_records=kept.records,
                superseded_records=lost.records,
                gpu_seconds=gpu_s,
                cost=gpu_s * price / 3600.0,
                started_at=a.started_at,
                ended_at=a.ended_at,
            )
        )
    return rows


def totals(tenant: str, rows: Sequence[UsageRow]) -> SettledUsage:
    """The job's settled usage: the sums of its ledger rows."""
    return SettledUsage(
        tenant=tenant,
        attempts=len(rows),
        prompt_tokens=sum(r.prompt_tokens for r in rows),
        completion_tokens=sum(r.completion_tokens for r in rows),
        superseded_records=sum(r.superseded_records for r in rows),
        gpu_seconds=math.fsum(r.gpu_seconds for r in rows),
        cost=math.fsum(r.cost for r in rows),
    )


@dataclass(frozen=True)
class PoolUsage:
    """One pool's share of a tenant's settled usage."""

    attempts: int
    gpu_seconds: float
    cost: float


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's settled usage (``deadline-batch usage``): totals, jobs, and each pool's share."""

    usage: SettledUsage
    jobs: int
    pools: Mapping[str, PoolUsage]

    def to_dict(self) -> dict[str, object]:
        return {
            **self.usage.model_dump(),
            "jobs": self.jobs,
            "pools": {name: dataclasses.asdict(p) for name, p in self.pools.items()},
        }


def usage_by_tenant(pools: Iterable[PoolUsageTotal], jobs: Mapping[str, int]) -> list[TenantUsage]:
    """The ledger's sums per tenant and pool (``ManifestStore.usage_totals``) as a report, by tenant."""
    tenants: dict[str, dict[str, list[PoolUsageTotal]]] = {}
    for total in pools:
        tenants.setdefault(total.tenant, {}).setdefault(total.pool or "unknown", []).append(total)
    report = []
    for tenant, own in sorted(tenants.items()):
        parts = [t for p in own.values() for t in p]
        report.append(
            TenantUsage(
                usage=SettledUsage(
                    tenant=tenant,
                    attempts=sum(t.attempts for t in parts),
                    prompt_tokens=sum(t.prompt_tokens for t in parts),
                    completion_tokens=sum(t.completion_tokens for t in parts),
                    superseded_records=sum(t.superseded_records for t in parts),
                    gpu_seconds=math.fsum(t.gpu_seconds for t in parts),
                    cost=math.fsum(t.cost for t in parts),
                ),
                jobs=jobs.get(tenant, 0),
                pools={
                    name: PoolUsage(
                        attempts=sum(t.attempts for t in p),
                        gpu_seconds=math.fsum(t.gpu_seconds for t in p),
                        cost=math.fsum(t.cost for t in p),
                    )
                    for name, p in sorted(own.items())
                },
            )
        )
    return report
