"""Admission against shared capacity: an earliest-deadline-first test, tenant quotas and budgets.

``core.feasibility.assess`` judges a job alone on its own pools. When pools are shared (their GPUs
set with ``deadline-batch capacity set``, docs/tenants.md), a job is admitted only if every
admitted, unfinished job on those pools still meets its deadline with it. On one pool of ``C``
GPUs, EDF scheduling meets every deadline iff for each deadline ``d`` the work due by ``d`` fits
into the capacity until ``d``. Here "fits" keeps ``core.feasibility``'s margins: the queue and
startup lead, and the recovery reserve ``max(min_recovery_reserve_s, fraction × run)``, so

    W(d) / C + reserve(W(d) / C) <= d - now - lead        for every deadline d.

Jobs are reserved by the GPU-seconds their admitted plan needs (``run_seconds × gpus``: the
efficiency margin and expected preemption overhead included), scaled by the share of their
estimated work not yet committed. Pure functions; the store reads the rows and serializes the
admissions so that two admissions never count the same free capacity.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.feasibility import AdmissionPolicy, format_duration

__all__ = [
    "DeadlineCheck",
    "Demand",
    "EdfResult",
    "budget_refusal",
    "edf_test",
    "gpu_quota_refusals",
    "projected_cost",
    "reserved_gpu_seconds",
    "supply_seconds",
    "window_needed_s",
]


@dataclass(frozen=True, kw_only=True)
class Demand:
    """Work a job holds on shared capacity: GPU-seconds due by its deadline."""

    job_id: str
    tenant: str
    deadline: dt.datetime
    gpu_seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadline", ensure_aware(self.deadline, "deadline"))
        if not self.gpu_seconds >= 0:
            raise ValueError(f"job {self.job_id}: gpu_seconds must be >= 0, got {self.gpu_seconds}")


@dataclass(frozen=True, kw_only=True)
class DeadlineCheck:
    """One step of the EDF test: the work due by ``deadline`` against the capacity until then."""

    deadline: dt.datetime
    job_id: str
    demand_s: float
    supply_s: float

    @property
    def ok(self) -> bool:
        return self.demand_s <= self.supply_s + 1e-6

    def to_dict(self) -> dict[str, Any]:
        return {
            "deadline": _iso(self.deadline),
            "job_id": self.job_id,
            "demand_gpu_s": round(self.demand_s, 3),
            "supply_gpu_s": round(self.supply_s, 3),
            "ok": self.ok,
        }


@dataclass(frozen=True, kw_only=True)
class EdfResult:
    """The verdict of the EDF test for a new job, with what would make it feasible when it is not."""

    job_id: str
    feasible: bool
    gpus: int
    lead_s: float
    checks: tuple[DeadlineCheck, ...]
    #: the first deadline at or after the new job's that the new job's work would break
    violated: DeadlineCheck | None
    #: the earliest deadline the new job could have and still be admitted (None: none would do)
    earliest_feasible_deadline: dt.datetime | None
    #: the shared GPUs that would admit the job with its deadline (None: no number would)
    gpus_needed: int | None

    def reasons(self) -> list[str]:
        """Sentences with the numbers: the verdict, and when refused, what would work."""
        if self.feasible:
            return [
                f"shared capacity: {self.gpus} GPU(s) meet every admitted deadline with this job "
                f"({len(self.checks)} deadline(s) checked earliest first)"
            ]
        bad = self.violated
        assert bad is not None
        head = (
            f"rejected by shared capacity: by {_iso(bad.deadline)} (job {bad.job_id}) the admitted jobs and "
            f"this one need {bad.demand_s:,.0f} GPU-seconds but {self.gpus} GPU(s) give "
            f"{bad.supply_s:,.0f} after {format_duration(self.lead_s)} lead and the recovery reserve"
        )
        fixes = []
        if self.earliest_feasible_deadline is not None:
            fixes.append(f"the earliest feasible deadline is {_iso(self.earliest_feasible_deadline)}")
        if self.gpus_needed is not None:
            fixes.append(f"{self.gpus_needed} shared GPU(s) would admit it with its deadline")
        advice = "; ".join(fixes) if fixes else "no later deadline or capacity would admit it"
        return [f"{head}; {advice}"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "feasible": self.feasible,
            "gpus": self.gpus,
            "lead_seconds": self.lead_s,
            "checks": [c.to_dict() for c in self.checks],
            "violated": None if self.violated is None else self.violated.to_dict(),
            "earliest_feasible_deadline": _iso(self.earliest_feasible_deadline),
            "gpus_needed": self.gpus_needed,
        }


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def supply_seconds(gpus: int, window_s: float, policy: AdmissionPolicy) -> float:
    """GPU-seconds ``gpus`` can work in ``window_s`` while keeping the recovery reserve."""
    run = min(window_s - policy.min_recovery_reserve_s, window_s / (1.0 + policy.recovery_reserve_fraction))
    return gpus * max(0.0, run)


def window_needed_s(gpu_seconds: float, gpus: int, policy: AdmissionPolicy) -> float:
    """The shortest window in which ``gpus`` finish ``gpu_seconds`` with the recovery reserve."""
    run = gpu_seconds / gpus
    return max(run + policy.min_recovery_reserve_s, run * (1.0 + policy.recovery_reserve_fraction))


def edf_test(
    new: Demand,
    held: Iterable[Demand],
    *,
    gpus: int,
    now: dt.datetime,
    lead_s: float = 0.0,
    policy: AdmissionPolicy | None = None,
) -> EdfResult:
    """Whether ``new`` can join the ``held`` work on ``gpus`` shared GPUs, earliest deadline first.

    Held work whose deadline has passed is left out (its job expires at its deadline). Deadlines
    before the new job's are not the new job's to answer for: it adds work only from its own
    deadline on, so only those checks decide. A refusal names the earliest deadline that would
    be admitted and the capacity that would admit this one.
    """
    policy = policy or AdmissionPolicy()
    now = ensure_aware(now, "now")
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    live = sorted((d for d in held if d.deadline > now and d.job_id != new.job_id), key=lambda d: d.deadline)
    checks = _checks([*live, new], gpus, now, lead_s, policy)
    relevant = [c for c in checks if c.deadline >= new.deadline]
    violated = next((c for c in relevant if not c.ok), None)
    if violated is None:
        return EdfResult(
            job_id=new.job_id,
            feasible=True,
            gpus=gpus,
            lead_s=lead_s,
            checks=checks,
            violated=None,
            earliest_feasible_deadline=None,
            gpus_needed=None,
        )
    return EdfResult(
        job_id=new.job_id,
        feasible=False,
        gpus=gpus,
        lead_s=lead_s,
        checks=checks,
        violated=violated,
        earliest_feasible_deadline=_earliest_deadline(new, live, gpus, now, lead_s, policy),
        gpus_needed=_gpus_needed(relevant, now, lead_s, policy),
    )


def _checks(
    demands: Sequence[Demand], gpus: int, now: dt.datetime, lead_s: float, policy: AdmissionPolicy
) -> tuple[DeadlineCheck, ...]:
    ordered = sorted(demands, key=lambda d: d.deadline)
    out = []
    due = 0.0
    for i, d in enumerate(ordered):
        due += d.gpu_seconds
        if i + 1 < len(ordered) and ordered[i + 1].deadline == d.deadline:
            continue  # one check per distinct deadline, with all the work due by then
        window = (d.deadline - now).total_seconds() - lead_s
        out.append(
            DeadlineCheck(
                deadline=d.deadline,
                job_id=d.job_id,
                demand_s=due,
                supply_s=supply_seconds(gpus, window, policy),
            )
        )
    return tuple(out)


def _earliest_deadline(
    new: Demand,
    live: Sequence[Demand],
    gpus: int,
    now: dt.datetime,
    lead_s: float,
    policy: AdmissionPolicy,
) -> dt.datetime | None:
    """The least deadline ``D`` at which ``new`` passes: later than every held deadline its work breaks."""
    if gpus <= 0:
        return None
    breaks = now
    due = 0.0
    for d in live:
        due += d.gpu_seconds
        window = (d.deadline - now).total_seconds() - lead_s
        if due + new.gpu_seconds > supply_seconds(gpus, window, policy) + 1e-6:
            breaks = d.deadline
    # fixed point: the work due by D (held deadlines <= D, plus the new job) fits the window until D
    included = sum(d.gpu_seconds for d in live if d.deadline <= breaks)
    rest = [d for d in live if d.deadline > breaks]
    while True:
        needed = now + dt.timedelta(
            seconds=lead_s + window_needed_s(included + new.gpu_seconds, gpus, policy)
        )
        candidate = max(needed, breaks + dt.timedelta(seconds=1))
        joining = [d for d in rest if d.deadline <= candidate]
        if not joining:
            return _ceil_second(candidate)
        included += sum(d.gpu_seconds for d in joining)
        rest = [d for d in rest if d.deadline > candidate]


def _ceil_second(value: dt.datetime) -> dt.datetime:
    whole = value.replace(microsecond=0)
    return whole if whole == value else whole + dt.timedelta(seconds=1)


def _gpus_needed(
    checks: Sequence[DeadlineCheck], now: dt.datetime, lead_s: float, policy: AdmissionPolicy
) -> int | None:
    """The fewest GPUs that pass every check from the new job's deadline on (None: none would)."""
    needed = 0
    for c in checks:
        per_gpu = supply_seconds(1, (c.deadline - now).total_seconds() - lead_s, policy)
        if per_gpu <= 0:
            if c.demand_s > 0:
                return None
            continue
        needed = max(needed, math.ceil(c.demand_s / per_gpu - 1e-9))
    return needed


def reserved_gpu_seconds(
    admission: Mapping[str, Any] | None,
    est_work_s: float,
    remaining_work_s: float,
    policy: AdmissionPolicy,
    work_scale: float = 1.0,
) -> float:
    """GPU-seconds a job still holds: its admitted plan's (run × GPUs) times the share of work left.

    Without a plan in the report (an older job), its estimated work over the policy's efficiency.
    ``work_scale`` is the slowdown its committed microbatches measured (``JobView.work_scale``):
    a job that runs slower than estimated holds more.
    """
    chosen = (admission or {}).get("chosen") or {}
    run, gpus = chosen.get("run_seconds"), chosen.get("gpus")
    scale = work_scale if math.isfinite(work_scale) and work_scale > 0 else 1.0
    if isinstance(run, int | float) and isinstance(gpus, int) and math.isfinite(run) and est_work_s > 0:
        return float(run) * gpus * max(0.0, min(1.0, remaining_work_s / est_work_s)) * scale
    return max(0.0, remaining_work_s) / policy.efficiency * scale


def projected_cost(admission: Mapping[str, Any] | None) -> float:
    """The cost of a job's admitted plan (``cost_units``), 0 without one."""
    cost = ((admission or {}).get("chosen") or {}).get("cost_units")
    return float(cost) if isinstance(cost, int | float) and math.isfinite(cost) else 0.0


def budget_refusal(
    tenant: str, cost: float, spent: Iterable[float], budget: float | None, period_s: float | None
) -> str | None:
    """Why a job of ``cost`` breaks the tenant's budget for the period (None: it fits)."""
    if budget is None:
        return None
    used = math.fsum(spent)
    if used + cost <= budget + 1e-9:
        return None
    return (
        f"rejected by tenant {tenant}'s budget: {used:.2f} spent or reserved in the last "
        f"{format_duration(period_s or 0.0)} plus this job's projected {cost:.2f} is "
        f"{used + cost:.2f}, above the budget of {budget:.2f}; raise it with `deadline-batch quota "
        f"set {tenant} --budget`, wait for the period to roll, or shrink the job"
    )


def gpu_quota_refusals(
    tenant: str, plan_gpus: Mapping[str, int], quota: Mapping[str, int | None]
) -> list[str]:
    """Why the admitted plan's GPUs per pool kind exceed the tenant's quota (empty: within it)."""
    out = []
    for kind, n in sorted(plan_gpus.items()):
        limit = quota.get(kind)
        if limit is not None and n > limit:
            out.append(
                f"rejected by tenant {tenant}'s quota: the plan needs {n} {kind} GPU(s) at once, the "
                f"quota allows {limit}; run with fewer workers or raise the quota "
                f"(`deadline-batch quota set {tenant} --{kind.replace('_', '-')}-gpus N`)"
            )
    return out
