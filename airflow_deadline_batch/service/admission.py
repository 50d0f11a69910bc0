"""Admission of a planned job against shared capacity, its tenant's GPU quota and budget.

``service.planning`` asks :func:`shared_admission` for the check the store runs inside the
transaction that records the job (``ManifestStore.create_job(admit=...)``), with admissions
serialized, so two jobs admitted at the same moment never both count the same free capacity.
With no pool capacity and no quota configured the check admits everything: each job is then
judged alone by ``core.feasibility``, as before tenants existed (docs/tenants.md).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.core.admission import (
    Demand,
    SharedPool,
    budget_refusal,
    edf_test,
    gpu_quota_refusals,
    projected_cost,
    reserved_gpu_seconds,
    supply_seconds,
)
from airflow_deadline_batch.core.feasibility import AdmissionPolicy, AdmissionReport
from airflow_deadline_batch.core.pools import PoolSpec

if TYPE_CHECKING:
    from airflow_deadline_batch.store.tenancy import HeldWork, TenancySnapshot

#: the admission report's verdict when shared capacity, a quota or a budget refuses the job
REJECTED_SHARED = "rejected_shared"


@dataclass
class SharedAdmission:
    """The check ``create_job`` runs (call it: None admits, a report of plain values rejects).

    Under the admission lock a refusal says only what is short (the minimum cut). What would admit
    the job (the earliest feasible deadline, the GPUs needed) takes some 20 to 40 more flows, which
    :meth:`explained` computes afterwards from the same snapshot, so other submissions do not wait
    for them; the caller records that fuller report on the rejected job.
    """

    job_id: str
    report: AdmissionReport
    pools: tuple[PoolSpec, ...]
    policy: AdmissionPolicy
    #: skip shared capacity's deadline test (the quota and the budget still hold)
    deadline_waived: bool = False
    #: the snapshot of the last refusal (a retried transaction refuses again on a fresh one)
    refused_on: TenancySnapshot | None = None

    def __call__(self, snapshot: TenancySnapshot) -> Mapping[str, Any] | None:
        self.refused_on = None
        rejection = self._rejection(snapshot, explain=False)
        if rejection is not None:
            self.refused_on = snapshot
        return rejection

    def explained(self) -> Mapping[str, Any] | None:
        """The last refusal's report with what would admit the job (None if nothing was refused)."""
        if self.refused_on is None:
            return None
        return self._rejection(self.refused_on, explain=True)

    def _rejection(self, snapshot: TenancySnapshot, *, explain: bool) -> Mapping[str, Any] | None:
        reasons, details = _refusals(
            self.job_id, self.report, self.pools, snapshot, self.policy, explain, not self.deadline_waived
        )
        if not reasons:
            return None
        data = self.report.to_dict()
        return {
            **data,
            "verdict": REJECTED_SHARED,
            "feasible": False,
            "reasons": [*data["reasons"], *reasons],
            "shared": details,
        }


def shared_admission(
    job_id: str,
    report: AdmissionReport,
    pools: tuple[PoolSpec, ...],
    *,
    policy: AdmissionPolicy | None = None,
    deadline_waived: bool = False,
) -> SharedAdmission:
    """The check ``create_job`` runs: None admits, a report (plain values) rejects.

    ``deadline_waived`` (``PlanRequest.allow_infeasible``): shared capacity's deadline test is
    skipped, as the job's own deadline verdict is; its tenant's GPU quota and budget still hold."""
    return SharedAdmission(job_id, report, pools, policy or AdmissionPolicy(), deadline_waived)


def _refusals(
    job_id: str,
    report: AdmissionReport,
    pools: tuple[PoolSpec, ...],
    snapshot: TenancySnapshot,
    policy: AdmissionPolicy,
    explain: bool = True,
    deadline: bool = True,
) -> tuple[list[str], dict[str, Any]]:
    reasons: list[str] = []
    details: dict[str, Any] = {"tenant": snapshot.tenant}
    chosen = report.chosen
    quota = snapshot.quota
    if quota is not None and chosen is not None:
        by_name = {p.name: p for p in pools}
        plan_gpus: dict[str, int] = {}
        left = chosen.gpus
        for name in chosen.pools:  # the plan fills its pools in order, as core.feasibility does
            take = min(by_name[name].gpus, left)
            kind = by_name[name].kind.value
            plan_gpus[kind] = plan_gpus.get(kind, 0) + take
            left -= take
        limits = {"spot": quota.spot_gpus, "on_demand": quota.on_demand_gpus}
        reasons += gpu_quota_refusals(snapshot.tenant, plan_gpus, limits)
        cost = float(chosen.cost_units)  # as planned: a budget refuses a cost that is no amount
        spent = [
            j.settled_cost if j.settled_cost is not None else projected_cost(j.admission)
            for j in snapshot.period_jobs
        ]
        refusal = budget_refusal(snapshot.tenant, cost, spent, quota.budget, quota.budget_period_s)
        if refusal is not None:
            reasons.append(refusal)
        details["projected_cost"] = cost if math.isfinite(cost) else None
    if deadline and chosen is not None and any(p.name in snapshot.capacity for p in pools):
        new = Demand(
            job_id=job_id,
            tenant=snapshot.tenant,
            deadline=report.deadline,
            gpu_seconds=chosen.run_seconds * chosen.gpus,
            pools=frozenset(p.name for p in pools),
        )
        result = edf_test(
            new,
            held_demands(snapshot, policy),
            pools=[*shared_pools(snapshot, pools), *private_pools(snapshot, pools)],
            now=snapshot.now,
            policy=policy,
            explain=explain,
        )
        details["edf"] = result.to_dict()
        if not result.feasible:
            reasons += result.reasons()
    return reasons, details


def held_demands(snapshot: TenancySnapshot, policy: AdmissionPolicy) -> list[Demand]:
    """The work each admitted, unfinished job holds on the managed pools it may use and its own."""
    out = []
    for h in snapshot.held:
        managed = frozenset(h.pools).intersection(snapshot.capacity)
        if managed:
            out.append(
                Demand(
                    job_id=h.job_id,
                    tenant=h.tenant,
                    deadline=h.deadline,
                    gpu_seconds=reserved_gpu_seconds(
                        h.admission, h.est_work_s, h.remaining_work_s, policy, h.work_scale
                    ),
                    pools=managed | {p.name for p in _own_pools(h, snapshot)},
                )
            )
    return out


def own_pool_name(pool: str, job_id: str) -> str:
    """A held job's unmanaged pool in the flow: a name of its own, so no other job reaches it."""
    return f"{pool} of {job_id}"


def _own_pools(held: HeldWork, snapshot: TenancySnapshot) -> list[SharedPool]:
    return [
        SharedPool(name=own_pool_name(name, held.job_id), gpus=gpus, lead_s=held.pool_leads.get(name, 0.0))
        for name, gpus in sorted(held.pool_gpus.items())
        if name not in snapshot.capacity and gpus > 0
    ]


def shared_pools(snapshot: TenancySnapshot, pools: tuple[PoolSpec, ...]) -> list[SharedPool]:
    """Every managed pool with its GPUs and lead: the new job's pool spec, else a held job's, else none."""
    leads = {name: lead for h in snapshot.held for name, lead in h.pool_leads.items()}
    leads.update({p.name: p.queue_wait_seconds + p.startup_seconds for p in pools})
    return [
        SharedPool(name=name, gpus=gpus, lead_s=leads.get(name, 0.0))
        for name, gpus in sorted(snapshot.capacity.items())
    ]


def private_pools(snapshot: TenancySnapshot, pools: tuple[PoolSpec, ...]) -> list[SharedPool]:
    """Unmanaged pools, each usable only by the job that declares it: the GPUs it declares are its own.

    A job that may also run on a pool with no capacity row (say, on-demand beside a managed Spot
    pool) is admitted when its work fits on the managed pools and its own GPUs together, not refused
    because the managed pools are full. The same holds for held jobs (their unmanaged pools named
    :func:`own_pool_name`, so no other job reaches them): the work their own GPUs can carry by their
    deadlines is not reserved on the managed pools, where it would refuse later jobs for nothing.
    """
    new = [
        SharedPool(name=p.name, gpus=p.gpus, lead_s=p.queue_wait_seconds + p.startup_seconds)
        for p in pools
        if p.name not in snapshot.capacity
    ]
    held = [
        pool
        for h in snapshot.held
        if set(h.pools) & set(snapshot.capacity)
        for pool in _own_pools(h, snapshot)
    ]
    return [*new, *held]


@dataclass(frozen=True, kw_only=True)
class Reservation:
    """Work an admitted, unfinished job holds on a pool (split evenly over its managed pools)."""

    job_id: str
    tenant: str
    deadline: dt.datetime
    reserved_gpu_s: float


@dataclass(frozen=True, kw_only=True)
class PoolCapacity:
    """``deadline-batch capacity list``: a managed pool's GPUs, reservations and free capacity."""

    pool: str
    gpus: int
    reservations: tuple[Reservation, ...]
    until: dt.datetime
    #: GPU-seconds the pool can still take until ``until`` (recovery reserve kept) after the
    #: reservations due by then
    free_gpu_s: float

    @property
    def reserved_gpu_s(self) -> float:
        return sum(r.reserved_gpu_s for r in self.reservations)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "gpus": self.gpus,
            "reserved_gpu_s": round(self.reserved_gpu_s, 3),
            "free_gpu_s_until": round(self.free_gpu_s, 3),
            "until": self.until.isoformat(),
            "reservations": [
                {
                    "job_id": r.job_id,
                    "tenant": r.tenant,
                    "deadline": r.deadline.isoformat(),
                    "reserved_gpu_s": round(r.reserved_gpu_s, 3),
                }
                for r in self.reservations
            ],
        }


def capacity_view(
    snapshot: TenancySnapshot, until: dt.datetime, policy: AdmissionPolicy | None = None
) -> list[PoolCapacity]:
    """Each managed pool with the work admitted jobs hold on it and its free capacity until ``until``.

    A job whose deadline has passed holds nothing, as in admission (it expires at its deadline).
    """
    policy = policy or AdmissionPolicy()
    window = (until - snapshot.now).total_seconds()
    live = [held for held in snapshot.held if held.deadline > snapshot.now]
    out = []
    for pool, gpus in sorted(snapshot.capacity.items()):
        reservations = []
        for held in live:
            managed = [p for p in held.pools if p in snapshot.capacity]
            if pool in managed:
                share = reserved_gpu_seconds(
                    held.admission, held.est_work_s, held.remaining_work_s, policy, held.work_scale
                )
                reservations.append(
                    Reservation(
                        job_id=held.job_id,
                        tenant=held.tenant,
                        deadline=held.deadline,
                        reserved_gpu_s=share / len(managed),
                    )
                )
        due = sum(r.reserved_gpu_s for r in reservations if r.deadline <= until)
        out.append(
            PoolCapacity(
                pool=pool,
                gpus=gpus,
                reservations=tuple(reservations),
                until=until,
                free_gpu_s=supply_seconds(gpus, window, policy) - due,
            )
        )
    return out
