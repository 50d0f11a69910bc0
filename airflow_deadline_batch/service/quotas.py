"""A tenant's GPU quota while its jobs run (docs/tenants.md): may one more worker start?"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_deadline_batch.core.pools import PoolKind

if TYPE_CHECKING:
    from airflow_deadline_batch.store import ManifestStore


def quota_allows_launch(store: ManifestStore, job_id: str, tenant: str, kind: PoolKind, own: int) -> bool:
    """Whether one more worker of ``job_id`` on a ``kind`` pool stays within the tenant's quota.

    ``own`` counts the job's workers of that kind already started (a worker holds its GPU before
    its claim reaches the store); the tenant's other jobs count by their live leases.
    """
    quota = store.get_quota(tenant)
    limit = None if quota is None else quota.gpus_of_kind(kind.value)
    if limit is None:
        return True
    others = store.tenant_gpus_in_use(tenant, exclude_job=job_id).get(kind.value, 0)
    return others + own + 1 <= limit
