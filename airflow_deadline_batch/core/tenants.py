"""Tenants: the team a job belongs to (docs/tenants.md).

A tenant name is a DNS-1123 label: shard pods carry it as a label value and it names the tenant's
Kueue LocalQueue, so it is checked once, here, against the stricter of those rules.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_TENANT", "check_tenant", "kueue_queue_name"]

#: the tenant of a job submitted without one (and of every job recorded before tenants existed)
DEFAULT_TENANT = "default"
#: a DNS-1123 label: valid as a label value and as the name of the tenant's Kueue LocalQueue
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def check_tenant(name: str | None) -> str:
    """``name`` as a tenant (``default`` when empty); ValueError when it is not a DNS-1123 label."""
    tenant = (name or "").strip() or DEFAULT_TENANT
    if not _NAME.match(tenant):
        raise ValueError(
            f"tenant {tenant!r} is not a valid name: use at most 63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit (a Kubernetes DNS label)"
        )
    return tenant


def kueue_queue_name(tenant: str) -> str:
    """The Kueue LocalQueue a tenant's shard pods are submitted to (docs/kubernetes.md)."""
    return check_tenant(tenant)
