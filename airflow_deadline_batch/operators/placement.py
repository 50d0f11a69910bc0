"""The per-try decision of a shard task, as small pure functions over store rows.

Both shard operators (Kubernetes pod and local subprocess) and the local runner call
:func:`decide_for_try` before every try: it re-reads nothing itself, it only turns the job's
:class:`~airflow_deadline_batch.core.job_view.JobView` and the shard into a :class:`TryDecision`
(run / skip, which pool, timeouts), so a retry after a preemption escalates to on-demand by itself
once slack has shrunk. :func:`read_job_view` reads that view from the store for all of them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.core.job_view import JobView, build_job_view
from airflow_deadline_batch.core.placement import PlacementDecision, PolicyParams, choose_pool
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.exceptions import ConfigurationError

if TYPE_CHECKING:
    from airflow_deadline_batch.store import AttemptRow, CommitRow, JobRow, ManifestStore, ShardRow

#: label/annotation prefix of everything this package puts on a pod
LABEL_PREFIX = "deadline-batch.io"
#: capacity-type values as Karpenter spells them
CAPACITY_VALUES = {PoolKind.SPOT: "spot", PoolKind.ON_DEMAND: "on-demand"}


class TryAction(str, enum.Enum):
    """What this try of a shard task does."""

    RUN = "run"
    ALREADY_DONE = "already_done"
    SHARD_FAILED = "shard_failed"
    JOB_STOPPED = "job_stopped"


@dataclasses.dataclass(frozen=True)
class TryDecision:
    """The decision recorded (logged and pushed to XCom) for one try of one shard."""

    job_id: str
    shard_index: int
    action: TryAction
    reason: str
    pool: PoolSpec | None = None
    placement: PlacementDecision | None = None

    def to_dict(self) -> dict[str, Any]:
        placement = self.placement
        return {
            "job_id": self.job_id,
            "shard_index": self.shard_index,
            "action": self.action.value,
            "reason": self.reason,
            "pool": self.pool.name if self.pool else None,
            "capacity": self.pool.kind.value if self.pool else None,
            "slack_s": placement.slack_s if placement else None,
            "last_safe_spot_start": (
                placement.last_safe_spot_start.isoformat()
                if placement and placement.last_safe_spot_start
                else None
            ),
            "startup_timeout_s": placement.startup_timeout_s if placement else None,
            "grace_period_s": placement.grace_period_s if placement else None,
        }


def parse_pools(
    pools: Sequence[PoolSpec | Mapping[str, Any]] | None, job_config: Mapping[str, Any] | None = None
) -> tuple[PoolSpec, ...]:
    """Operator pools (PoolSpec or their dicts) win; else the pools recorded in the job's config."""
    raw = list(pools) if pools else list((job_config or {}).get("pools") or [])
    if not raw:
        raise ConfigurationError(
            "no pools: pass pools=[...] to the shard operator or plan the job with pools"
        )
    return tuple(p if isinstance(p, PoolSpec) else PoolSpec.from_dict(p) for p in raw)


def pool_for(kind: PoolKind, pools: Sequence[PoolSpec]) -> PoolSpec:
    """The first pool of ``kind``; the other kind when the job defines none (nothing else can run)."""
    for pool in pools:
        if pool.kind is kind:
            return pool
    return pools[0]


def read_job_view(
    store: ManifestStore,
    job_id: str,
    *,
    now: dt.datetime,
    pools: Sequence[PoolSpec | Mapping[str, Any]] | None = None,
    parallelism: int | None = None,
) -> JobView:
    """The job's :class:`JobView` from the store: its row, shards, commits and attempts.

    The attempts tell the placement what Spot did to this job (docs/design.md §5, *Observed
    preemptions*): the observed preemption rate and the Spot tries preempted before any commit.

    ``pools`` (the operator's, else the job's) and ``parallelism`` (else the job's ``workers``)
    are what :func:`decide_for_try` places with.
    """
    job = store.get_job(job_id)
    return job_view_of(
        job,
        store.list_shards(job_id),
        store.list_commits(job_id),
        store.list_attempts(job_id),
        now=now,
        pools=pools,
        parallelism=parallelism,
    )


def job_view_of(
    job: JobRow,
    shards: Sequence[ShardRow],
    commits: Sequence[CommitRow],
    attempts: Sequence[AttemptRow],
    *,
    now: dt.datetime,
    pools: Sequence[PoolSpec | Mapping[str, Any]] | None = None,
    parallelism: int | None = None,
) -> JobView:
    """:func:`read_job_view` over rows the caller has read already (the jobs view reuses them)."""
    return build_job_view(
        job,
        shards,
        commits,
        now=now,
        pools=parse_pools(pools, job.config),
        parallelism=parallelism,
        attempts=attempts,
        tenant=job.tenant,
    )


def decide_for_try(view: JobView, shard: ShardRow, *, policy: PolicyParams | None = None) -> TryDecision:
    """Decide this try: skip a committed shard, stop on a stopped job, else choose the pool."""
    job_id, index = view.job_id, shard.shard_index
    if shard.state is ShardState.SUCCEEDED:
        return TryDecision(
            job_id,
            index,
            TryAction.ALREADY_DONE,
            f"shard {index} of job {job_id} is already committed; nothing to run",
        )
    if shard.state is ShardState.TERMINAL_FAILURE:
        return TryDecision(
            job_id,
            index,
            TryAction.SHARD_FAILED,
            f"shard {index} of job {job_id} failed for good: {shard.last_error or 'no detail'}",
        )
    if view.stopped:
        return TryDecision(
            job_id,
            index,
            TryAction.JOB_STOPPED,
            f"job {job_id} is {view.state.value}; shard {index} will not run",
        )
    placement = choose_pool(view.snapshot(index), policy)
    pool = pool_for(placement.pool, view.pools)
    reason = placement.reason
    if pool.kind is not placement.pool:
        reason += f"; the job has no {placement.pool.value} pool, so it runs on {pool.name}"
    return TryDecision(job_id, index, TryAction.RUN, reason, pool=pool, placement=placement)


@dataclasses.dataclass(frozen=True)
class PodPlacement:
    """What a decision changes on the pod: scheduling constraints, labels and timeouts."""

    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    labels: dict[str, str]
    annotations: dict[str, str]
    startup_timeout_s: int
    grace_period_s: int


def pod_placement(
    decision: TryDecision, *, capacity_label: str | None = "karpenter.sh/capacity-type"
) -> PodPlacement:
    """Node selector, tolerations and labels for the chosen pool (pure; the pool's own values win)."""
    if decision.pool is None or decision.placement is None:
        raise ValueError("pod_placement needs a decision to run (action 'run')")
    pool, placement = decision.pool, decision.placement
    capacity = CAPACITY_VALUES[pool.kind]
    labels = {
        **{str(k): str(v) for k, v in pool.labels.items()},
        f"{LABEL_PREFIX}/job-id": decision.job_id,
        f"{LABEL_PREFIX}/shard": str(decision.shard_index),
        f"{LABEL_PREFIX}/pool": pool.name,
        f"{LABEL_PREFIX}/capacity": capacity,
    }
    if capacity_label:
        labels.setdefault(capacity_label, capacity)
    annotations = {f"{LABEL_PREFIX}/placement-reason": decision.reason[:1000]}
    if placement.last_safe_spot_start is not None:
        annotations[f"{LABEL_PREFIX}/last-safe-spot-start"] = placement.last_safe_spot_start.isoformat()
    return PodPlacement(
        node_selector=dict(pool.node_selector),
        tolerations=[dict(t) for t in pool.tolerations],
        labels=labels,
        annotations=annotations,
        startup_timeout_s=int(placement.startup_timeout_s),
        grace_period_s=int(placement.grace_period_s),
    )
