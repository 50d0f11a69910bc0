"""Admission: is the deadline feasible, under which plan, and with how much slack (docs/design.md §5).

``slack = deadline − now − (queue wait + remaining work / (ready GPUs × efficiency) + recovery
reserve)``. Plans on Spot capacity also pay the expected cost of preemptions (a restart plus
half a shard of redone work each). Admission never admits silently: every verdict comes with
sentences that carry the numbers, and an infeasible one says which plan would work, if any.
"""

from __future__ import annotations

import datetime as dt
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.estimate import WorkModel, WorkSummary
from airflow_deadline_batch.core.packing import target_shard_seconds
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.exceptions import AdmissionRejected, ConfigurationError

__all__ = [
    "AdmissionPolicy",
    "AdmissionReport",
    "PlanOption",
    "Verdict",
    "assess",
    "format_duration",
    "preemption_loss_fraction",
    "work_seconds_on",
]


class Verdict(str, enum.Enum):
    """Outcome of admission."""

    FEASIBLE = "feasible"
    FEASIBLE_WITH_ON_DEMAND = "feasible_with_on_demand"
    INFEASIBLE = "infeasible"
    REJECTED_INVALID = "rejected_invalid"


@dataclass(frozen=True, kw_only=True)
class AdmissionPolicy:
    """How conservative admission is.

    ``efficiency`` is the observed end-to-end fraction of GPU time that does useful work
    (startup, packing, variable lengths, writes). The recovery reserve is
    ``max(min_recovery_reserve_s, recovery_reserve_fraction × run time)``.
    ``checkpoint_cost_s`` sizes the default shard (and so the redo cost of a preemption).
    """

    efficiency: float = 0.8
    recovery_reserve_fraction: float = 0.1
    min_recovery_reserve_s: float = 60.0
    max_invalid_fraction: float = 0.1
    allow_on_demand: bool = True
    checkpoint_cost_s: float = 10.0
    per_record_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if not 0.0 <= self.max_invalid_fraction <= 1.0:
            raise ValueError(f"max_invalid_fraction must be in [0, 1], got {self.max_invalid_fraction}")
        for name in (
            "recovery_reserve_fraction",
            "min_recovery_reserve_s",
            "checkpoint_cost_s",
            "per_record_overhead_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def recovery_reserve(self, run_seconds: float) -> float:
        """Seconds kept free for failures and restores before the deadline."""
        return max(self.min_recovery_reserve_s, self.recovery_reserve_fraction * run_seconds)


@dataclass(frozen=True, kw_only=True)
class PlanOption:
    """One way to run the job: which pools, how many GPUs, when it would finish, at what cost.

    ``predicted_finish`` is the expected end of the work; ``slack_seconds`` is what remains
    before the deadline after also keeping the recovery reserve. ``cost_units`` are GPU-hours
    times the pools' ``price_per_gpu_hour``.
    """

    name: str
    pools: tuple[str, ...]
    gpus: int
    predicted_finish: dt.datetime | None
    slack_seconds: float
    cost_units: float
    feasible: bool
    lead_seconds: float = 0.0
    run_seconds: float = 0.0
    reserve_seconds: float = 0.0
    preemption_overhead_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pools": list(self.pools),
            "gpus": self.gpus,
            "predicted_finish": _iso(self.predicted_finish),
            "slack_seconds": _finite(self.slack_seconds),
            "cost_units": _finite(self.cost_units),
            "feasible": self.feasible,
            "lead_seconds": self.lead_seconds,
            "run_seconds": _finite(self.run_seconds),
            "reserve_seconds": _finite(self.reserve_seconds),
            "preemption_overhead_seconds": _finite(self.preemption_overhead_seconds),
        }

    def describe(self) -> str:
        """One sentence with the plan's numbers."""
        where = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''} on {', '.join(self.pools)}"
        if self.predicted_finish is None:
            return f"plan {self.name} ({where}) would never finish: preemptions cost more than the work gains"
        extra = (
            f", incl. {format_duration(self.preemption_overhead_seconds)} expected preemption overhead"
            if self.preemption_overhead_seconds > 0
            else ""
        )
        return (
            f"plan {self.name} ({where}): {format_duration(self.lead_seconds)} queue and startup + "
            f"{format_duration(self.run_seconds)} of work{extra}, finish at {_iso(self.predicted_finish)}, "
            f"{format_duration(self.reserve_seconds)} recovery reserve, slack "
            f"{format_duration(self.slack_seconds, signed=True)}, cost {self.cost_units:.2f} units: "
            + ("feasible" if self.feasible else "not feasible")
        )


@dataclass(frozen=True, kw_only=True)
class AdmissionReport:
    """The verdict of admission with its reasons, the chosen plan and every plan considered."""

    verdict: Verdict
    feasible: bool
    reasons: tuple[str, ...]
    slack_seconds: float
    predicted_finish: dt.datetime | None
    chosen: PlanOption | None
    options: tuple[PlanOption, ...]
    work: WorkSummary
    deadline: dt.datetime
    now: dt.datetime

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (ISO-8601 datetimes; infinities as null)."""
        return {
            "verdict": self.verdict.value,
            "feasible": self.feasible,
            "reasons": list(self.reasons),
            "slack_seconds": _finite(self.slack_seconds),
            "predicted_finish": _iso(self.predicted_finish),
            "chosen": None if self.chosen is None else self.chosen.to_dict(),
            "options": [o.to_dict() for o in self.options],
            "work": self.work.to_dict(),
            "deadline": _iso(self.deadline),
            "now": _iso(self.now),
        }

    def summary(self) -> str:
        """A multi-line text for logs: the verdict first, then one reason per line."""
        head = f"admission: {self.verdict.value}"
        if self.chosen is not None:
            head += f" (plan {self.chosen.name}, slack {format_duration(self.slack_seconds, signed=True)})"
        return "\n".join([head, *(f"  - {reason}" for reason in self.reasons)])

    def raise_if_not_feasible(self) -> None:
        """Raise :class:`AdmissionRejected` (exit code 3) carrying this report unless feasible."""
        if not self.feasible:
            raise AdmissionRejected(self.summary(), report=self)


# --------------------------------------------------------------------------------------------


def format_duration(seconds: float, *, signed: bool = False) -> str:
    """Human duration such as ``2h05m``, ``10m00s`` or ``45s`` (``+``/``-`` when ``signed``)."""
    if not math.isfinite(seconds):
        return "-inf" if seconds < 0 else "inf"
    sign = "-" if seconds < 0 else ("+" if signed else "")
    total = int(round(abs(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{sign}{hours}h{minutes:02d}m"
    if minutes:
        return f"{sign}{minutes}m{secs:02d}s"
    return f"{sign}{secs}s"


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def work_seconds_on(work: WorkSummary, pool: PoolSpec, per_record_overhead_s: float = 0.0) -> float:
    """GPU-seconds the whole batch needs on one GPU of ``pool``.

    Token totals are priced at the pool's own rates; a summary without tokens (for example one
    re-estimated from measured GPU time) is taken at its ``gpu_seconds``.
    """
    if work.prompt_tokens or work.output_tokens:
        model = WorkModel.from_pool(pool, per_record_overhead_s)
        return model.total_seconds(work.prompt_tokens, work.output_tokens, work.records)
    return work.gpu_seconds


def preemption_loss_fraction(pool: PoolSpec, shard_seconds: float) -> float:
    """Fraction of a GPU's time lost to preemptions: rate × (startup + half a shard of redo)."""
    return pool.preemptions_per_hour / 3600.0 * (pool.startup_seconds + shard_seconds / 2.0)


@dataclass(frozen=True)
class _Plan:
    name: str
    pools: tuple[PoolSpec, ...]


def _allocate(pools: Sequence[PoolSpec], max_parallel: int | None) -> list[tuple[PoolSpec, int]]:
    budget = math.inf if max_parallel is None else max_parallel
    allocation = []
    for pool in pools:
        take = int(min(pool.gpus, budget))
        if take <= 0:
            break
        allocation.append((pool, take))
        budget -= take
    return allocation


def _evaluate(
    plan: _Plan,
    work: WorkSummary,
    *,
    now: dt.datetime,
    deadline: dt.datetime,
    policy: AdmissionPolicy,
    max_parallel: int | None,
    shard_seconds: float | None,
) -> tuple[PlanOption, float]:
    """Evaluate one plan; also return its throughput per GPU (fraction of the job per second)."""
    allocation = _allocate(plan.pools, max_parallel)
    gpus = sum(n for _, n in allocation)
    lead = max(p.queue_wait_seconds + p.startup_seconds for p, _ in allocation)
    rate = 0.0  # fraction of the job done per second, all GPUs together
    ideal_rate = 0.0  # the same without preemptions
    for pool, n in allocation:
        seconds = work_seconds_on(work, pool, policy.per_record_overhead_s)
        if seconds <= 0:
            rate = ideal_rate = math.inf
            break
        nominal_run = seconds / (n * policy.efficiency)
        shard = shard_seconds
        if shard is None:
            mtbi = 3600.0 / pool.preemptions_per_hour if pool.preemptions_per_hour > 0 else math.inf
            shard = target_shard_seconds(
                checkpoint_cost_s=policy.checkpoint_cost_s,
                mtbi_s=mtbi,
                recovery_reserve_s=policy.recovery_reserve(nominal_run),
            )
        useful = policy.efficiency * max(0.0, 1.0 - preemption_loss_fraction(pool, shard))
        rate += n * useful / seconds
        ideal_rate += n * policy.efficiency / seconds
    run = 0.0 if math.isinf(rate) else (math.inf if rate <= 0 else 1.0 / rate)
    ideal_run = 0.0 if math.isinf(ideal_rate) else 1.0 / ideal_rate
    reserve = policy.recovery_reserve(run)
    if math.isfinite(run):
        finish: dt.datetime | None = now + dt.timedelta(seconds=lead + run)
        slack = (deadline - now).total_seconds() - (lead + run + reserve)
    else:
        finish, slack = None, -math.inf
    billed = max(p.startup_seconds for p, _ in allocation) + run  # queueing is not billed
    cost = sum(n * p.price_per_gpu_hour for p, n in allocation) * billed / 3600.0
    option = PlanOption(
        name=plan.name,
        pools=tuple(p.name for p, _ in allocation),
        gpus=gpus,
        predicted_finish=finish,
        slack_seconds=slack,
        cost_units=cost,
        feasible=slack >= 0,
        lead_seconds=lead,
        run_seconds=run,
        reserve_seconds=reserve,
        preemption_overhead_seconds=run - ideal_run,
    )
    per_gpu = 0.0 if gpus == 0 or not math.isfinite(rate) else rate / gpus
    return option, per_gpu


def assess(
    work: WorkSummary,
    pools: Sequence[PoolSpec],
    *,
    deadline: dt.datetime,
    now: dt.datetime,
    policy: AdmissionPolicy | None = None,
    max_parallel: int | None = None,
    shard_seconds: float | None = None,
) -> AdmissionReport:
    """Decide whether ``work`` can finish on ``pools`` by ``deadline``, and under which plan.

    Plans considered: Spot only, Spot + on-demand, on-demand only (on-demand ones only when the
    policy allows). The cheapest feasible plan is chosen. ``max_parallel`` caps the GPUs a plan
    may use (for example the number of shards or concurrent pods). ``shard_seconds`` is the
    planned shard duration; by default it is derived from each pool's interruption rate.
    """
    policy = policy or AdmissionPolicy()
    deadline = ensure_aware(deadline, "deadline")
    now = ensure_aware(now, "now")
    if not pools:
        raise ConfigurationError("no GPU pools configured; give at least one pool (Spot or on-demand)")
    if max_parallel is not None and max_parallel < 1:
        raise ConfigurationError(f"max_parallel must be >= 1, got {max_parallel}")

    spot = tuple(p for p in pools if p.kind is PoolKind.SPOT)
    on_demand = tuple(p for p in pools if p.kind is PoolKind.ON_DEMAND)
    plans: list[_Plan] = []
    if spot:
        plans.append(_Plan("spot", spot))
    if policy.allow_on_demand and spot and on_demand:
        plans.append(_Plan("spot+on_demand", spot + on_demand))
    if policy.allow_on_demand and on_demand:
        plans.append(_Plan("on_demand", on_demand))

    time_left = (deadline - now).total_seconds()
    reasons = [
        f"work: {work.records:,} valid records, {work.prompt_tokens:,} prompt + {work.output_tokens:,} "
        f"output tokens, {work.gpu_seconds:,.0f} GPU-seconds estimated ({work.invalid:,} invalid lines)",
        f"deadline {_iso(deadline)} is {format_duration(time_left, signed=True)} from now ({_iso(now)})",
    ]
    evaluated = [
        _evaluate(
            p,
            work,
            now=now,
            deadline=deadline,
            policy=policy,
            max_parallel=max_parallel,
            shard_seconds=shard_seconds,
        )
        for p in plans
    ]
    options = tuple(o for o, _ in evaluated)
    reasons.extend(o.describe() for o in options)
    feasible_options = [o for o in options if o.feasible]
    chosen = min(feasible_options, key=lambda o: (o.cost_units, -o.slack_seconds), default=None)
    if time_left <= 0:
        chosen = None

    rejected_invalid = work.invalid_fraction > policy.max_invalid_fraction
    if rejected_invalid:
        verdict = Verdict.REJECTED_INVALID
        reasons.append(
            f"rejected: {work.invalid:,} of {work.records + work.invalid:,} lines are invalid "
            f"({work.invalid_fraction:.1%}), more than the allowed {policy.max_invalid_fraction:.1%}; "
            "fix the input (see the validation errors) or raise max_invalid_fraction"
        )
    elif chosen is not None:
        uses_on_demand = any(name in {p.name for p in on_demand} for name in chosen.pools)
        verdict = Verdict.FEASIBLE_WITH_ON_DEMAND if uses_on_demand and spot else Verdict.FEASIBLE
        reasons.append(
            f"admitted with plan {chosen.name}: finish at {_iso(chosen.predicted_finish)}, "
            f"slack {format_duration(chosen.slack_seconds, signed=True)}"
            + (" (Spot alone would miss the deadline)" if verdict is Verdict.FEASIBLE_WITH_ON_DEMAND else "")
        )
    else:
        verdict = Verdict.INFEASIBLE
        reasons.extend(_infeasible_reasons(evaluated, time_left, policy, max_parallel, plans, on_demand))

    best = chosen or max(options, key=lambda o: o.slack_seconds, default=None)
    return AdmissionReport(
        verdict=verdict,
        feasible=verdict in (Verdict.FEASIBLE, Verdict.FEASIBLE_WITH_ON_DEMAND),
        reasons=tuple(reasons),
        slack_seconds=best.slack_seconds if best is not None else -math.inf,
        predicted_finish=best.predicted_finish if best is not None else None,
        chosen=chosen if not rejected_invalid else None,
        options=options,
        work=work,
        deadline=deadline,
        now=now,
    )


def _infeasible_reasons(
    evaluated: Sequence[tuple[PlanOption, float]],
    time_left: float,
    policy: AdmissionPolicy,
    max_parallel: int | None,
    plans: Sequence[_Plan],
    on_demand: Sequence[PoolSpec],
) -> list[str]:
    if time_left <= 0:
        return [f"infeasible: the deadline passed {format_duration(-time_left)} ago; set a later deadline"]
    if not plans:
        return [
            "infeasible: no Spot pool is configured and the policy forbids on-demand; "
            "add a Spot pool or set allow_on_demand=True"
        ]
    reasons = []
    for option, per_gpu in evaluated:
        available = time_left - option.lead_seconds
        run_max = min(
            available - policy.min_recovery_reserve_s, available / (1.0 + policy.recovery_reserve_fraction)
        )
        if run_max <= 0:
            reasons.append(
                f"plan {option.name} cannot meet the deadline with any number of GPUs: queue, "
                "startup and the minimum recovery reserve alone exceed the time left"
            )
        elif per_gpu <= 0:
            reasons.append(
                f"plan {option.name} cannot meet the deadline: its expected preemptions cost "
                "more GPU time than they leave for work"
            )
        else:
            # the plan's average per-GPU rate, scaled until the run fits before the reserve
            needed = max(option.gpus + 1, math.ceil(1.0 / (per_gpu * run_max) - 1e-9))
            over = max_parallel is not None and needed > max_parallel
            limit = f", above max_parallel={max_parallel}" if over else ""
            reasons.append(
                f"plan {option.name} would need about {needed} GPUs instead of {option.gpus}{limit}"
            )
    advice = "add GPUs to a pool, move the deadline, or reduce the work"
    if on_demand and not policy.allow_on_demand:
        advice = "allow on-demand capacity (allow_on_demand=True), " + advice
    reasons.append(f"infeasible: no plan finishes before the deadline with the recovery reserve; {advice}")
    return reasons
