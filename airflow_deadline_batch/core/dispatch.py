"""Which waiting shard gets the next GPU of a shared pool: least slack first within fair shares.

Pure rule behind the store's dispatcher (``store/dispatch.py``, docs/tenants.md "Dispatch"). A
pool's slots are its ``capacity`` GPUs; one worker holds one slot. The tenants that hold or wait
for slots split the pool by weight (``share = slots × weight / Σ weights``). The next slot goes to
the waiting request with the **earliest latest start** (deadline minus the job's remaining work:
the least slack) among the tenants below their share; when no waiting tenant is below its share,
to the earliest latest start overall, so no slot idles while work waits (work-conserving).

A tenant's urgent new job thus jumps the tenant's own queue, but cannot take another tenant's
share: the other tenant's older work keeps its slots.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: a tenant without a configured weight
DEFAULT_WEIGHT = 1.0


class GrantReason(str, enum.Enum):
    """Why a request got its slot (recorded with every grant)."""

    #: its tenant held less than its weighted fair share of the pool
    BELOW_SHARE = "below_share"
    #: no waiting tenant was below its share: the least slack overall (work-conserving)
    WORK_CONSERVING = "work_conserving"


@dataclass(frozen=True, kw_only=True)
class DispatchRequest:
    """One shard waiting for one slot of a pool."""

    job_id: str
    shard_index: int
    tenant: str
    #: epoch seconds: the job's deadline minus its remaining work (earlier = less slack)
    latest_start: float
    #: epoch seconds (database clock) the request was posted
    requested_at: float

    @property
    def key(self) -> tuple[float, float, str, int]:
        """The order within the rule: least slack, then earliest requested, job ID, shard index."""
        return (self.latest_start, self.requested_at, self.job_id, self.shard_index)


@dataclass(frozen=True, kw_only=True)
class Grant:
    """A request granted a slot, and the state the rule decided on (for the audit record)."""

    request: DispatchRequest
    reason: GrantReason
    #: free slots before this grant
    free: int
    #: slots each tenant held just before this grant (tenants with waiting work included, at 0)
    held: Mapping[str, int]
    #: each competing tenant's fair share of the pool's slots
    shares: Mapping[str, float]
    #: each tenant's best waiting request just before this grant
    best: Mapping[str, DispatchRequest]


def fair_shares(slots: int, weights: Mapping[str, float], tenants: Iterable[str]) -> dict[str, float]:
    """Each tenant's weighted share of ``slots`` among ``tenants`` (a missing weight is 1)."""
    names = sorted(set(tenants))
    w = {t: weight_of(weights, t) for t in names}
    top = max(w.values(), default=1.0)
    w = {t: v / top for t, v in w.items()}  # by the largest: huge weights cannot sum to inf
    total = sum(w.values())
    return {t: slots * w[t] / total for t in names} if total > 0 else {}


def check_request(latest_start: float, ttl_s: float) -> None:
    """Refuse a request the dispatcher could not order or expire (one-line ``ValueError``)."""
    if math.isnan(latest_start):
        raise ValueError("dispatch request: latest_start must be a number, got nan")
    if not (math.isfinite(ttl_s) and ttl_s >= 0):
        raise ValueError(f"dispatch request: ttl_s must be a finite number >= 0 (the lease TTL), got {ttl_s}")


def weight_of(weights: Mapping[str, float], tenant: str) -> float:
    weight = weights.get(tenant, DEFAULT_WEIGHT)
    return weight if weight > 0 and math.isfinite(weight) else DEFAULT_WEIGHT


def next_grant(
    slots: int,
    held: Mapping[str, int],
    weights: Mapping[str, float],
    waiting: Sequence[DispatchRequest],
) -> Grant | None:
    """The next grant on a pool of ``slots`` GPUs, or None when no slot is free or nothing waits."""
    free = slots - sum(held.values())
    if free <= 0 or not waiting:
        return None
    best: dict[str, DispatchRequest] = {}
    for request in waiting:
        if request.tenant not in best or request.key < best[request.tenant].key:
            best[request.tenant] = request
    shares = fair_shares(slots, weights, [*(t for t, n in held.items() if n > 0), *best])
    below = [r for t, r in best.items() if held.get(t, 0) < shares[t]]
    reason = GrantReason.BELOW_SHARE if below else GrantReason.WORK_CONSERVING
    chosen = min(below or best.values(), key=lambda r: r.key)
    return Grant(
        request=chosen,
        reason=reason,
        free=free,
        held={t: held.get(t, 0) for t in sorted({*held, *best})},
        shares=shares,
        best=best,
    )


def plan_grants(
    slots: int,
    held: Mapping[str, int],
    weights: Mapping[str, float],
    waiting: Sequence[DispatchRequest],
) -> list[Grant]:
    """Grant free slots one at a time by :func:`next_grant`, each seeing the grants before it."""
    held_now = dict(held)
    left = list(waiting)
    grants: list[Grant] = []
    while (grant := next_grant(slots, held_now, weights, left)) is not None:
        grants.append(grant)
        left.remove(grant.request)
        held_now[grant.request.tenant] = held_now.get(grant.request.tenant, 0) + 1
    return grants
