"""A tenant's GPU quota while its jobs run (docs/tenants.md): may one more worker start?

A launch takes its GPU with ``ManifestStore.reserve_launch`` (the check and the reservation in one
serialized transaction); :func:`quota_allows_launch` is the read-only question a shard asks before
it queues for a dispatcher slot, so that it does not wait for a slot it could not use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_deadline_batch.core.pools import PoolKind

if TYPE_CHECKING:
    from airflow_deadline_batch.store import ManifestStore


def quota_allows_launch(store: ManifestStore, tenant: str, kind: PoolKind) -> bool:
    """Whether the tenant's quota of ``kind`` has room for one more worker now.

    Counts every GPU the tenant holds, across its jobs and across the runs of each job: live
    leases, and the reservations of workers started but not claimed yet (each worker once).
    """
    quota = store.get_quota(tenant)
    limit = None if quota is None else quota.gpus_of_kind(kind.value)
    if limit is None:
        return True
    return store.tenant_gpus_in_use(tenant).get(kind.value, 0) + 1 <= limit
