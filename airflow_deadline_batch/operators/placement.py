"""The per-try decision of a shard task, as small pure functions over store rows.

Both shard operators (Kubernetes pod and local subprocess) and the local runner call
:func:`decide_for_try` before every try: it re-reads nothing itself, it only turns the job's
:class:`~airflow_deadline_batch.core.job_view.JobView` and the shard into a :class:`TryDecision`
(run / skip, which pool, timeouts), so a retry after a preemption escalates to on-demand by itself
once slack has shrunk. :func:`read_job_view` reads that view from the store for all of them.

With the job's pools (docs/design.md §5, *Several pools*) the decision is the simulator's rule
(:func:`core.placement.choose_pool`) with everything it takes: the on-demand over Spot price ratio
(so the expected-cost rule is on), every Spot pool as a :class:`~core.placement.SpotOption` (price,
learned throughput, learned spell length) for :func:`~core.placement.pick_spot_pool`, and the
cheapest on-demand pool that is not slower than the reference pool. Each Spot pool's preemption
rate is learned from this job's finished tries on it, starting from a prior made of the pool's
declared rate and of what earlier jobs saw on a pool of that name
(:meth:`ManifestStore.pool_history`, read once per :func:`read_job_view`). Each Spot pool's
availability is learned the same way (:class:`~core.calibration.PoolAvailability`): the time its
tries ran against the time their pods waited for capacity (``unschedulable`` attempts, which
:class:`~operators.shard.DeadlineShardPodOperator` records until a Spot pod is scheduled or its
try gives up at the startup timeout), over the policy's ``availability_prior`` and earlier jobs'
evidence; and a pool whose latest try gave up waiting recently, with none started since, counts
as out of capacity (``spot_available`` false), so the rule waits for it or escalates.

The tail race (issue 13) is decided here once for the local runner and the pod operator:
:func:`race_decision` (a running Spot try the rule would escalate, raced when
``core.placement.should_speculate`` says so) and :func:`tail_has_room` (the pod operator's check
that no shard waits for a worker and one is free). The view counts a race's workers on their own
pools (:func:`leased_workers`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from airflow_deadline_batch.core.calibration import (
    PoolAvailability,
    PoolHistory,
    PoolTry,
    SpotTries,
    SpotTry,
    availability_prior,
    gave_up_waiting,
    spot_prior,
)
from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.job_view import (
    AttemptFields,
    CommitFields,
    FinishedSpotTry,
    JobView,
    as_utc,
    build_job_view,
    finished_spot_tries,
    is_stopped,
    pool_index,
    pool_named,
    reference_pool,
)
from airflow_deadline_batch.core.placement import (
    DEFAULT_POLICY,
    JobSnapshot,
    PlacementDecision,
    PolicyParams,
    SpotOption,
    choose_pool,
    should_speculate,
)
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import TERMINAL_SHARD_STATES, AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.exceptions import ConfigurationError

if TYPE_CHECKING:
    from airflow_deadline_batch.store import AttemptRow, CommitRow, JobRow, ManifestStore, ShardRow

#: label/annotation prefix of everything this package puts on a pod
LABEL_PREFIX = "deadline-batch.io"
#: capacity-type values as Karpenter spells them
CAPACITY_VALUES = {PoolKind.SPOT: "spot", PoolKind.ON_DEMAND: "on-demand"}


class TryFields(AttemptFields, Protocol):
    """The attempt fields the placement view reads (``store.AttemptRow`` and the store's
    ``placement_rows`` have them): :class:`~core.job_view.AttemptFields` and what the pools'
    availability reads."""

    @property
    def heartbeat_at(self) -> dt.datetime | None: ...


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
    """Operator pools (PoolSpec or their dicts) win; else the pools recorded in the job's config.

    A pool the job's config names too keeps the config's rates: the job's shards were estimated
    at them (``service.planning.rate_pools`` may have moved them to what earlier jobs measured),
    so its calibration must start from the same rates.
    """
    recorded = [PoolSpec.from_dict(p) for p in (job_config or {}).get("pools") or []]
    raw = list(pools) if pools else recorded
    if not raw:
        raise ConfigurationError(
            "no pools: pass pools=[...] to the shard operator or plan the job with pools"
        )
    planned = {p.name: p for p in recorded}
    out = []
    for spec in (p if isinstance(p, PoolSpec) else PoolSpec.from_dict(p) for p in raw):
        rated = planned.get(spec.name)
        if rated is not None and spec is not rated:
            spec = dataclasses.replace(
                spec,
                prefill_tokens_per_s=rated.prefill_tokens_per_s,
                decode_tokens_per_s=rated.decode_tokens_per_s,
            )
        out.append(spec)
    return tuple(out)


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
    """The job's :class:`JobView` from the store: its row, shards, commits and attempts, read in one
    transaction, only the columns the view reads (:meth:`~ManifestStore.placement_rows`).

    The attempts tell the placement what Spot did to this job (docs/design.md §5, *Observed
    preemptions*): the observed preemption rate and the Spot tries preempted before any commit.

    ``pools`` (the operator's, else the job's) and ``parallelism`` (else the job's ``workers``)
    are what :func:`decide_for_try` places with; earlier jobs' tries on the job's Spot pools (the
    store's bounded :meth:`~ManifestStore.pool_history`) are the prior of each pool's learned rate.
    """
    # the operator's pools name the Spot pools without the job's row; else the job's config does
    spot_names = [p.name for p in parse_pools(pools) if p.kind is PoolKind.SPOT] if pools else None
    rows = store.placement_rows(job_id, spot_pools=spot_names)
    return _placement_view(
        rows.job,
        rows.shards,
        rows.commits,
        rows.attempts,
        now=now,
        pools=parse_pools(pools, rows.job.config),
        parallelism=parallelism,
        history=rows.history,
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
    history: Mapping[str, PoolHistory] | None = None,
) -> PlacementView:
    """:func:`read_job_view` over rows the caller has read already (the jobs view reuses them).

    ``history``: earlier jobs' tries by pool name (none: each pool's declaration is the prior).
    """
    return _placement_view(
        job,
        shards,
        commits,
        attempts,
        now=now,
        pools=parse_pools(pools, job.config),
        parallelism=parallelism,
        history=history or {},
    )


def _placement_view(
    job: JobRow,
    shards: Sequence[ShardRow],
    commits: Sequence[CommitFields],
    attempts: Sequence[TryFields],
    *,
    now: dt.datetime,
    pools: tuple[PoolSpec, ...],
    parallelism: int | None,
    history: Mapping[str, PoolHistory],
) -> PlacementView:
    """:func:`job_view_of` over the pools :func:`parse_pools` gave (each row read once: the Spot
    tries are found once for the job's, each shard's and each pool's folds)."""
    attempts = list(attempts)
    commits = list(commits)
    shards = list(shards)
    finished = finished_spot_tries(attempts, commits, pools)
    view = build_job_view(
        job,
        shards,
        commits,
        now=now,
        pools=pools,
        parallelism=parallelism,
        attempts=attempts,
        tenant=job.tenant,
        finished=finished,
    )
    fields = {f.name: getattr(view, f.name) for f in dataclasses.fields(JobView)}
    fields["on_demand_shards"], fields["spot_shards"] = leased_workers(shards, attempts, pools)
    return PlacementView(
        **fields,
        pool_tries=pool_spot_tries(pools, attempts, commits, history, finished=finished),
        pool_availability=pool_spot_availability(pools, attempts, history, now=now),
    )


def leased_workers(
    shards: Sequence[ShardRow], attempts: Sequence[TryFields], pools: Sequence[PoolSpec]
) -> tuple[frozenset[int], frozenset[int]]:
    """The shards with a worker on on-demand now and those with one on Spot, racers included.

    A leased shard's worker runs on its lease holder's pool (its attempt's; the shard's
    ``last_pool`` when the attempt is not among ``attempts``), and a shard in a race (issue 13) has
    a second worker, its racer, on the racer's pool. ``core.job_view`` counts ``last_pool`` only,
    which misses the racer: a racer on on-demand was not counted among the job's on-demand
    workers. (A racer promoted to the primary lease is the shard's ``last_pool`` in the store, and
    its attempt's pool here either way: it no longer counts as a Spot worker blocking a storm
    probe, ``core.placement.in_storm``, or charging a Spot worker's waste to the cost cap.)
    """
    leased = [shard for shard in shards if shard.state is ShardState.LEASED]
    holders = {shard.lease_attempt_id for shard in leased} | {shard.race_attempt_id for shard in leased}
    pool_of = {a.attempt_id: a.pool for a in attempts if a.attempt_id in holders}
    index = pool_index(pools)
    on_demand: set[int] = set()
    on_spot: set[int] = set()
    for shard in leased:
        names = [pool_of.get(shard.lease_attempt_id or "", shard.last_pool)]
        if shard.race_attempt_id is not None:
            names.append(pool_of.get(shard.race_attempt_id))
        for name in names:
            pool = index.get(name) if name else None
            if pool is not None:
                (on_demand if pool.kind is PoolKind.ON_DEMAND else on_spot).add(shard.shard_index)
    return frozenset(on_demand), frozenset(on_spot)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementView(JobView):
    """A :class:`JobView` with what the job learned of each of its Spot pools (by pool name)."""

    #: each Spot pool's finished tries of this job, over the prior of :func:`core.calibration.spot_prior`
    pool_tries: Mapping[str, SpotTries] = dataclasses.field(default_factory=dict)
    #: each Spot pool's capacity seen by this job's tries, over earlier jobs' (:func:`pool_spot_availability`)
    pool_availability: Mapping[str, PoolAvailability] = dataclasses.field(default_factory=dict)


def pool_spot_tries(
    pools: Sequence[PoolSpec],
    attempts: Sequence[TryFields],
    commits: Sequence[CommitFields],
    history: Mapping[str, PoolHistory],
    *,
    finished: Sequence[FinishedSpotTry] | None = None,
) -> dict[str, SpotTries]:
    """Each Spot pool's finished tries of the job, folded over its declaration and earlier jobs' history.

    ``finished``: the job's :func:`core.job_view.finished_spot_tries`, read already.
    """
    if finished is None:
        finished = finished_spot_tries(attempts, commits, pools)
    by_pool: dict[str, list[SpotTry]] = {}
    for one in finished:
        by_pool.setdefault(one.pool, []).append(one.fold)
    out: dict[str, SpotTries] = {}
    for pool in pools:
        if pool.kind is PoolKind.SPOT:
            out[pool.name] = spot_prior(pool.preemptions_per_hour, history.get(pool.name)).observe_all(
                by_pool.get(pool.name, ())
            )
    return out


def pool_spot_availability(
    pools: Sequence[PoolSpec],
    attempts: Sequence[TryFields],
    history: Mapping[str, PoolHistory],
    *,
    now: dt.datetime,
) -> dict[str, PoolAvailability]:
    """Each Spot pool's availability evidence: this job's tries on it over earlier jobs' history.

    A try that ran counts its time on the pool (while it runs: up to its last heartbeat, stamped by
    the store's clock, and never past ``now``) as capacity present;
    an ``unschedulable`` attempt its pod's wait as capacity missing (and, when the try gave up,
    the pool as out of capacity for a while). The prior is the default policy's
    ``availability_prior``; :func:`placement_snapshot` applies the deciding policy's own.
    """
    seen: dict[str, list[PoolTry]] = {p.name: [] for p in pools if p.kind is PoolKind.SPOT}
    tries_of = {name: seen[pool.name] for name, pool in pool_index(pools).items() if pool.name in seen}
    now = ensure_aware(now, "now")
    unschedulable = AttemptOutcome.UNSCHEDULABLE
    for attempt in attempts:
        tries = tries_of.get(attempt.pool) if attempt.pool else None
        if tries is None:
            continue
        started = as_utc(attempt.started_at, "started_at")
        if attempt.ended_at is not None:
            ended = as_utc(attempt.ended_at, "ended_at")
        else:  # running: up to its last heartbeat, the store's clock (a deciding clock ahead adds nothing)
            ended = min(now, as_utc(attempt.heartbeat_at or attempt.started_at, "heartbeat_at"))
        span = (ended - started).total_seconds()
        if attempt.outcome == unschedulable:
            gave_up = ended.timestamp() if gave_up_waiting(attempt.failure_class) else None
            tries.append((0.0, span, None, gave_up))
        else:
            tries.append((span, 0.0, started.timestamp(), None))
    return {
        name: availability_prior(DEFAULT_POLICY.availability_prior, history.get(name)).observe_all(tries)
        for name, tries in seen.items()
    }


def settled_decision(job_id: str, job_state: JobState | str, shard: ShardRow) -> TryDecision | None:
    """The decision of a try that needs no worker (its shard committed or failed for good, its job
    stopped), or None when the shard still has to run."""
    index = shard.shard_index
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
    if is_stopped(job_state):
        return TryDecision(
            job_id,
            index,
            TryAction.JOB_STOPPED,
            f"job {job_id} is {JobState(job_state).value}; shard {index} will not run",
        )
    return None


def decide_for_try(view: JobView, shard: ShardRow, *, policy: PolicyParams | None = None) -> TryDecision:
    """Decide this try: skip a committed shard, stop on a stopped job, else choose the pool."""
    job_id, index = view.job_id, shard.shard_index
    if (settled := settled_decision(job_id, view.state, shard)) is not None:
        return settled
    on_demand = on_demand_pool(view)
    placement = choose_pool(placement_snapshot(view, index, on_demand, policy), policy)
    if placement.pool is PoolKind.ON_DEMAND and on_demand is not None:
        pool = on_demand
    else:
        pool = pool_named(placement.spot_pool, view.pools) or pool_for(placement.pool, view.pools)
    reason = placement.reason
    if pool.kind is not placement.pool:
        reason += f"; the job has no {placement.pool.value} pool, so it runs on {pool.name}"
    elif len(view.pools) > 2:
        reason += f"; on {pool.name}"
    return TryDecision(job_id, index, TryAction.RUN, reason, pool=pool, placement=placement)


def race_decision(view: JobView, shard: ShardRow, running_pool: str | None) -> TryDecision | None:
    """The on-demand try to race this shard's running Spot try with (issue 13), or None.

    As the simulator's ``slack_aware`` policy: only a Spot try that the safety rule would now
    escalate (this shard's decision is on-demand), and only when ``core.placement.should_speculate``
    finds the expected gain above the duplicate's cost. The racer resumes at the cursor, so the
    duplicate needs the changeover and the shard's uncommitted work at the on-demand rate; the
    running try needs that work at its pool's rate. One racer per shard: none while one holds it.
    The caller checks that the job is at its tail (:func:`tail_has_room`, or the local runner's
    own queue); the decision returned is the racer's (its pool and timeouts).
    """
    if shard.state is not ShardState.LEASED or shard.race_attempt_id is not None:
        return None
    spot = pool_named(running_pool, view.pools)
    if spot is None or spot.kind is not PoolKind.SPOT:
        return None
    decision = decide_for_try(view, shard)
    if decision.pool is None or decision.pool.kind is not PoolKind.ON_DEMAND:
        return None
    snap = placement_snapshot(view, shard.shard_index, decision.pool)
    if snap.price_ratio is None:
        return None
    option = next((o for o in snap.spot_pools if o.name == spot.name), None)
    speed, price = (option.speed, option.price) if option is not None else (1.0, 1.0)
    race = should_speculate(
        remaining_s=snap.shard_work_s / speed,
        price=price,
        mean_run_s=option.mean_run_s if option is not None else snap.spot_mean_run_s,
        duplicate_s=snap.changeover_s + snap.shard_work_s,
        duplicate_price=snap.price_ratio,
    )
    return decision if race else None


def race_pool(view: JobView, shard: ShardRow, running_pool: str | None) -> PoolSpec | None:
    """The on-demand pool of :func:`race_decision`, or None."""
    decision = race_decision(view, shard, running_pool)
    return decision.pool if decision is not None else None


def tail_has_room(shards: Sequence[ShardRow], parallelism: int) -> bool:
    """Whether the job is at its tail with a worker free for a racer (the local runner's rule).

    No shard waits for a worker (every unfinished shard is leased), and the job's leased shards
    and racers together are fewer than its ``parallelism`` (the plan's workers).
    """
    busy = 0
    for shard in shards:
        if shard.state in TERMINAL_SHARD_STATES:
            continue
        if shard.state is not ShardState.LEASED:
            return False
        busy += 1 + (shard.race_attempt_id is not None)
    return busy < parallelism


def _speed(view: JobView, pool: PoolSpec, reference: PoolSpec) -> float:
    """The pool's learned throughput over the reference pool's (the unit the work is counted in)."""
    ref = view.calibration.estimate(reference.name).tokens_per_s
    return view.calibration.estimate(pool.name).tokens_per_s / ref if ref > 0 else 1.0


def on_demand_pool(view: JobView) -> PoolSpec | None:
    """The on-demand pool a try escalates to: the cheapest per unit of work among those not slower
    than the reference pool (the deadline's safety is counted at its rate), else the fastest."""
    reference = reference_pool(view.pools)
    pools = [p for p in view.pools if p.kind is PoolKind.ON_DEMAND]
    if not pools:
        return None
    speeds = {p.name: _speed(view, p, reference) for p in pools}
    safe = [p for p in pools if speeds[p.name] >= 1.0 - 1e-9]
    if not safe:
        return max(pools, key=lambda p: speeds[p.name])
    return min(safe, key=lambda p: p.price_per_gpu_hour / speeds[p.name])


def placement_snapshot(
    view: JobView, shard_index: int, on_demand: PoolSpec | None, policy: PolicyParams | None = None
) -> JobSnapshot:
    """The view's snapshot of the shard with the job's prices and its Spot pools' learned rates.

    Prices are per GPU relative to the reference Spot pool (:func:`core.job_view.reference_pool`),
    throughputs the calibrated ones; a Spot pool's spell length comes from :class:`PlacementView`'s
    learned tries (a plain :class:`JobView`: its declared rate), its availability and whether it
    has capacity now from its learned :class:`~core.calibration.PoolAvailability` (none seen: the
    policy's prior, capacity assumed). With one Spot pool the snapshot's own ``spot_*`` fields
    carry it; with several, each is a :class:`SpotOption`.
    """
    snapshot = view.snapshot(shard_index)
    spot = [p for p in view.pools if p.kind is PoolKind.SPOT]
    if not spot:
        return snapshot
    reference = reference_pool(view.pools)
    learned = view.pool_tries if isinstance(view, PlacementView) else {}
    tries = {p.name: learned.get(p.name) or SpotTries(prior_per_hour=p.preemptions_per_hour) for p in spot}
    capacity = {p.name: spot_capacity(view, p.name, policy) for p in spot}
    ref_price = reference.price_per_gpu_hour
    price_ratio = None
    if on_demand is not None and ref_price > 0:
        # free on-demand capacity (price 0): no Spot try is ever cheaper, the ratio only has to be > 0
        od_price = max(on_demand.price_per_gpu_hour, 1e-9)
        price_ratio = od_price / _speed(view, on_demand, reference) / ref_price
    if len(spot) == 1:
        only = tries[reference.name]
        return dataclasses.replace(
            snapshot,
            price_ratio=price_ratio,
            spot_preemptions_per_hour=only.preemptions_per_hour,
            spot_mean_run_s=only.mean_run_s,
            spot_availability=capacity[reference.name][0],
            spot_available=capacity[reference.name][1],
        )
    options = tuple(
        SpotOption(
            name=p.name,
            price=max(p.price_per_gpu_hour, 1e-9) / ref_price if ref_price > 0 else 1.0,
            speed=_speed(view, p, reference),
            mean_run_s=tries[p.name].mean_run_s,
            availability=capacity[p.name][0],
            available=capacity[p.name][1],
        )
        for p in spot
    )
    # each option carries its own spell length (None: no preemption expected on that pool)
    return dataclasses.replace(snapshot, price_ratio=price_ratio, spot_pools=options, spot_mean_run_s=None)


def spot_capacity(view: JobView, pool: str, policy: PolicyParams | None = None) -> tuple[float | None, bool]:
    """A Spot pool's learned availability (``None``: nothing seen, the policy's prior stands) and
    whether it has capacity now (:meth:`~core.calibration.PoolAvailability.available`)."""
    seen = view.pool_availability.get(pool) if isinstance(view, PlacementView) else None
    if seen is None:
        return None, True
    prior = (policy or DEFAULT_POLICY).availability_prior
    learned = dataclasses.replace(seen, prior=prior).value if seen.present_s + seen.absent_s > 0 else None
    return learned, seen.available(view.now.timestamp())


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
