"""Tenants: the team a job belongs to (docs/tenants.md).

A tenant name is a DNS-1123 label: shard pods carry it as a label value and it names the tenant's
Kueue LocalQueue, so it is checked once, here, against the stricter of those rules.
"""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_TENANT",
    "KUEUE_PRIORITY_LABEL",
    "KUEUE_QUEUE_LABEL",
    "PRIORITY_BANDS",
    "check_tenant",
    "kueue_labels",
    "kueue_queue_name",
    "priority_class_for_slack",
]

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


#: the label Kueue's pod integration queues a pod by (its value names a LocalQueue)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: the label naming the pod's Kueue WorkloadPriorityClass (queue order, not kube preemption)
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
#: WorkloadPriorityClasses by the job's slack at the try: (slack below, class, value), urgent first;
#: docs/kubernetes.md defines the three objects with these values
PRIORITY_BANDS: tuple[tuple[float, str, int], ...] = (
    (3600.0, "deadline-batch-urgent", 1000),
    (6 * 3600.0, "deadline-batch-normal", 500),
    (float("inf"), "deadline-batch-relaxed", 100),
)


def priority_class_for_slack(slack_s: float) -> str:
    """The WorkloadPriorityClass of a try: less slack, higher priority (negative slack is urgent)."""
    return next((name for bound, name, _ in PRIORITY_BANDS if slack_s < bound), PRIORITY_BANDS[-1][1])


def kueue_labels(tenant: str, slack_s: float) -> dict[str, str]:
    """The pod labels Kueue queues a shard pod by: the tenant's LocalQueue and the slack's priority."""
    return {
        KUEUE_QUEUE_LABEL: kueue_queue_name(tenant),
        KUEUE_PRIORITY_LABEL: priority_class_for_slack(slack_s),
    }
