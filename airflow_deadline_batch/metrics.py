"""The provider's metrics, sent through Airflow's ``Stats`` (StatsD, DogStatsD or OpenTelemetry).

This module is the one definition of the metric names (all under :data:`PREFIX`) and of how
each value is read from a :class:`~airflow_deadline_batch.core.job_view.JobView`; docs/airflow.md
lists them. Airflow decides where they go (``[metrics] statsd_on`` / ``otel_on``, host, port,
``statsd_prefix``, allow and block lists); every metric carries the tags ``batch_job`` and ``dag_id``
(StatsD shows them with ``statsd_influxdb_enabled``, DogStatsD and OpenTelemetry always).

Emitters: the sensor's pokes and the trigger's polls (:func:`emit_job`), each shard try's
placement decision (:func:`emit_decision`), a racer's launch (:func:`emit_race`), and the tries a
shard task lost to the resume race (:func:`emit_resume_races`). Sending a metric never fails a task
or a trigger: an error is logged and dropped.

Airflow initialises the Task SDK's ``Stats`` in task processes; the triggerer initialises only
its own copy, so :func:`_stats` initialises the SDK's from Airflow's configuration where nobody
has (the trigger runner process).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.job_view import (
    AttemptFields,
    CommitFields,
    JobView,
    pool_named,
)
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.core.states import REDONE_WORK_OUTCOMES, UNRUN_ATTEMPT_OUTCOMES, AttemptOutcome

if TYPE_CHECKING:
    from airflow_deadline_batch.operators.placement import TryDecision
    from airflow_deadline_batch.store import ManifestStore

log = logging.getLogger(__name__)

#: every metric name starts with this (after Airflow's own ``statsd_prefix``)
PREFIX = "deadline_batch"

#: the tag (attribute) naming the job: Airflow's default ``[metrics] statsd_disabled_tags``
#: (``job_id,run_id``, matched anywhere in a tag's name) drops any tag containing ``job_id``
JOB_TAG = "batch_job"

# gauges, from the job view
SLACK_S = f"{PREFIX}.slack_s"
PREDICTED_FINISH_S = f"{PREFIX}.predicted_finish_s"
DEADLINE_IN_S = f"{PREFIX}.deadline_in_s"
RECORDS_COMMITTED = f"{PREFIX}.records_committed"
RECORDS_REMAINING = f"{PREFIX}.records_remaining"
LEASES_ACTIVE = f"{PREFIX}.leases_active"
LEASES_ON_DEMAND = f"{PREFIX}.leases_on_demand"
PREEMPTIONS = f"{PREFIX}.preemptions"
# gauges, from the job view and the job's attempts
REDONE_WORK_S = f"{PREFIX}.redone_work_s"
COST = f"{PREFIX}.cost"
# counters, one per shard try's decision
DECISIONS = f"{PREFIX}.decisions"
ESCALATIONS = f"{PREFIX}.escalations"
#: one per racer pod a shard try launches at the job's tail (the tail race)
RACES = f"{PREFIX}.races"
#: one per Airflow try of a shard task that Airflow ended after it resumed, without its operator
#: ending it: a try lost to Airflow 3.3's resume race (docs/airflow.md, *Resuming tasks*)
RESUME_RACES = f"{PREFIX}.resume_races"

#: the gauges :func:`job_metrics` computes, in documentation order
GAUGES = (
    SLACK_S,
    PREDICTED_FINISH_S,
    DEADLINE_IN_S,
    RECORDS_COMMITTED,
    RECORDS_REMAINING,
    LEASES_ACTIVE,
    LEASES_ON_DEMAND,
    PREEMPTIONS,
    REDONE_WORK_S,
    COST,
)


def _stats() -> ModuleType:
    """The Task SDK's ``Stats``, initialised from Airflow's configuration if nobody did."""
    from airflow.sdk._shared.observability.metrics import stats as shared
    from airflow.sdk.observability import stats

    if getattr(shared, "_factory", None) is None:
        from airflow.sdk.configuration import conf
        from airflow.sdk.observability.metrics import stats_utils

        stats.initialize(
            factory=stats_utils.get_stats_factory(),
            export_legacy_names=conf.getboolean("metrics", "legacy_names_on", fallback=False),
        )
    return stats


def dag_id_of(context: Any) -> str | None:
    """The DAG of a task's context (``None`` without one)."""
    ti = context.get("ti") if context is not None and hasattr(context, "get") else None
    dag_id = getattr(ti, "dag_id", None)
    return dag_id if isinstance(dag_id, str) else None


def tags(job_id: str, dag_id: str | None) -> dict[str, str]:
    out = {JOB_TAG: job_id}
    if dag_id:
        out["dag_id"] = dag_id
    return out


@dataclasses.dataclass(frozen=True)
class AttemptTotals:
    """What the job's tries cost and what they did for nothing (from attempt and commit rows)."""

    #: sum over tries of wall seconds × the pool's ``price_per_gpu_hour`` / 3600
    cost: float
    #: GPU-seconds of tries that ended preempted, abandoned, with a lost lease or stalled
    #: (``core.states.REDONE_WORK_OUTCOMES``), less the generation time of the microbatches they
    #: committed: work done again by another try
    redone_work_s: float


def attempt_totals(
    view: JobView, attempts: Iterable[AttemptFields], commits: Iterable[CommitFields]
) -> AttemptTotals:
    committed_s: dict[str, float] = {}
    for commit in commits:
        committed_s[commit.attempt_id] = committed_s.get(commit.attempt_id, 0.0) + float(commit.elapsed_s)
    cost = redone = 0.0
    for attempt in attempts:
        if attempt.outcome in UNRUN_ATTEMPT_OUTCOMES:
            continue  # a pod that waited for capacity: no GPU time
        started = ensure_aware(attempt.started_at, "started_at")
        ended = ensure_aware(attempt.ended_at, "ended_at") if attempt.ended_at else view.now
        ran_s = max(0.0, (ended - started).total_seconds())
        pool = pool_named(attempt.pool, view.pools)
        if pool is not None:
            cost += ran_s * pool.price_per_gpu_hour / 3600.0
        if attempt.ended_at is not None and AttemptOutcome(attempt.outcome) in REDONE_WORK_OUTCOMES:
            redone += max(0.0, ran_s - committed_s.get(attempt.attempt_id, 0.0))
    return AttemptTotals(cost=cost, redone_work_s=redone)


def job_metrics(view: JobView, totals: AttemptTotals | None = None) -> dict[str, float]:
    """The gauges of one job at ``view.now`` (pure): name → value."""
    out = {
        SLACK_S: view.slack_s,
        PREDICTED_FINISH_S: (view.predicted_finish - view.now).total_seconds(),
        DEADLINE_IN_S: (view.deadline - view.now).total_seconds(),
        RECORDS_COMMITTED: float(view.committed_records),
        RECORDS_REMAINING: float(max(0, view.total_records - view.committed_records)),
        LEASES_ACTIVE: float(len(view.spot_shards) + len(view.on_demand_shards)),
        LEASES_ON_DEMAND: float(len(view.on_demand_shards)),
        PREEMPTIONS: float(view.spot_tries.preemptions),
    }
    if totals is not None:
        out[REDONE_WORK_S] = totals.redone_work_s
        out[COST] = totals.cost
    return out


def send_gauges(values: Mapping[str, float], *, job_id: str, dag_id: str | None) -> None:
    """Send gauges through Airflow's ``Stats``; never raises."""
    try:
        stats = _stats()
        labels = tags(job_id, dag_id)
        for name, value in values.items():
            stats.gauge(name, value, tags=labels)
    except Exception:  # metrics must never fail the task or the trigger
        log.warning("sending deadline_batch metrics for job %s failed", job_id, exc_info=True)


def emit_job(store: ManifestStore, job_id: str, *, dag_id: str | None, now: dt.datetime) -> dict[str, float]:
    """Read the job's view, attempts and commits; send every gauge; return them (never raises)."""
    try:
        from airflow_deadline_batch.operators.placement import job_view_of

        job, shards = store.get_job(job_id), store.list_shards(job_id)
        attempts, commits = store.list_attempts(job_id), store.list_commits(job_id)
        view = job_view_of(job, shards, commits, attempts, now=now)
    except Exception:
        log.warning("reading deadline_batch metrics for job %s failed", job_id, exc_info=True)
        return {}
    return emit_view(view, attempts, commits, dag_id=dag_id)


def emit_view(
    view: JobView, attempts: Sequence[Any], commits: Sequence[Any], *, dag_id: str | None
) -> dict[str, float]:
    """:func:`emit_job` over rows the caller has read already (the trigger reuses them); never raises."""
    try:
        values = job_metrics(view, attempt_totals(view, attempts, commits))
    except Exception:
        log.warning("computing deadline_batch metrics for job %s failed", view.job_id, exc_info=True)
        return {}
    send_gauges(values, job_id=view.job_id, dag_id=dag_id)
    return values


def is_escalation(view: JobView, decision: TryDecision) -> bool:
    """An on-demand decision for a job that has a Spot pool: the slack no longer covers Spot."""
    has_spot = any(p.kind is PoolKind.SPOT for p in view.pools)
    return has_spot and decision.pool is not None and decision.pool.kind is PoolKind.ON_DEMAND


def emit_race(job_id: str, pool: str, *, dag_id: str | None) -> None:
    """One racer launched for a shard of ``job_id`` on ``pool`` (counted; never raises)."""
    try:
        _stats().incr(RACES, tags={**tags(job_id, dag_id), "pool": pool})
    except Exception:
        log.warning("sending the deadline_batch race metric for job %s failed", job_id, exc_info=True)


def emit_resume_races(job_id: str, count: int, *, dag_id: str | None) -> None:
    """``count`` tries of a shard task of ``job_id`` lost to the resume race (counted; never raises)."""
    if count <= 0:
        return
    try:
        _stats().incr(RESUME_RACES, count, tags=tags(job_id, dag_id))
    except Exception:
        log.warning("sending the deadline_batch resume race metric for job %s failed", job_id, exc_info=True)


def emit_decision(view: JobView, decision: TryDecision, *, dag_id: str | None) -> None:
    """One shard try's decision: count it (and an escalation) and send the view's gauges."""
    send_gauges(job_metrics(view), job_id=view.job_id, dag_id=dag_id)
    try:
        stats = _stats()
        labels: dict[str, Any] = {
            **tags(view.job_id, dag_id),
            "action": decision.action.value,
            "capacity": decision.pool.kind.value if decision.pool else "none",
        }
        stats.incr(DECISIONS, tags=labels)
        if is_escalation(view, decision):
            stats.incr(ESCALATIONS, tags=tags(view.job_id, dag_id))
    except Exception:
        log.warning("sending deadline_batch decision metrics for job %s failed", view.job_id, exc_info=True)
