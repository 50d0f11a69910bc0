"""Placement: Spot or on-demand for the next try of a shard, decided from the job's slack.

One implementation, used by the simulator's ``slack_aware`` policy, the local runner and the Airflow
shard operator alike. The rule (docs/design.md §5), all in seconds of wall time per worker:

* ``od_need`` = changeover + remaining work / parallelism + list-scheduling imbalance: the time the
  job still needs if every worker went on-demand now. ``slack = time left − od_need``.
* **Safety** (the last safe decision): a Spot try, or waiting for Spot, is allowed only while slack
  covers the most slack it can burn before the next decision can still escalate (``risk``,
  :func:`spot_risk_s`); otherwise on-demand. Slack counts committed work only, so it never falls
  faster than wall time: a choice re-decided every ``g`` seconds burns at most ``g``, a Spot try
  that holds capacity at most its changeover still to run plus one shard (decided once per try:
  plus the turnaround until the next try decides). So at every decision going on-demand now
  still meets the deadline, and a job feasible on on-demand never misses (the safety net of
  *Can't Be Late*, NSDI '24, made exact for ticks, shards and changeovers; docs/simulator.md,
  *Why it cannot miss*).
* **Escalation while Spot is missing**: waiting is free but burns slack. Wait while the capacity the
  job can expect (its on-demand workers plus the Spot availability times the other workers) covers
  the rate the remaining work needs; otherwise add on-demand workers one at a time (mixing).
* **Hysteresis**: back from on-demand to Spot only with a margin of extra slack, so work does not
  flap between pools; a running try is kept while it is safe.
* **Preemption storm** (docs/design.md §5, *Observed preemptions*): once the job's (or this
  shard's) last ``storm_tries + parallelism - 1`` Spot tries were all preempted without committing
  anything, fresh tries go on-demand whatever the slack; one Spot probe is allowed after a
  cool-down that doubles with every further round of fruitless tries (one per worker), and only
  while no other Spot try of the job runs.
* **Expected cost**: a fresh Spot try only while its expected price per committed hour of work
  (:func:`spot_cost_ratio`, from the learned spell length) is below on-demand's; an optional hard
  cap (:func:`cost_room_s`) bounds the worst case of a run.
* **Several Spot pools** (``JobSnapshot.spot_pools``): the Spot side is the pool with the lowest
  expected price per unit of work (:func:`pick_spot_pool`), named in the decision; the safety
  rule is the same, with that pool's risk.
* **The tail race** (:func:`should_speculate`): when the safety rule would move a running Spot try
  to on-demand and a worker has nothing left to pull, the on-demand try may start as a duplicate
  while the Spot try keeps running; whichever commits first wins, only when the expected saving
  beats what keeping the Spot try costs.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, replace

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.pools import PoolKind

#: the pod startup timeout never goes below this (the scheduler needs some time to place a pod)
MIN_STARTUP_TIMEOUT_S = 60
#: grace when the Spot pool gives no notice: enough to commit the current microbatch on SIGTERM
DEFAULT_GRACE_S = 30


@dataclass(frozen=True, kw_only=True)
class PolicyParams:
    """The few tunables of :func:`choose_pool` (tuned on synthetic traces, never on the shared files)."""

    #: extra slack (in changeovers) needed to go back from on-demand to Spot
    return_margin_changeovers: float = 2.0
    #: Spot availability assumed when none is observed yet (fraction of time capacity exists)
    availability_prior: float = 0.5
    #: the availability estimate is discounted by this factor before it is trusted
    availability_discount: float = 1.0
    #: while Spot is missing, escalate before slack falls under this many changeovers (beyond the
    #: safety net), so that a later Spot spell can still be taken
    reserve_changeovers: float = 6.0
    #: ... plus this fraction of the remaining work per worker (more work left, more to absorb)
    reserve_work_fraction: float = 0.10
    #: the waiting reserve is capped at this fraction of the slack the uniform line leaves now
    #: (:func:`line_slack_s`): a tight job cannot keep a reserve larger than its whole slack, it would
    #: go on-demand at once; ``None`` or an unknown job start/total work: no cap
    line_reserve_cap: float | None = 0.8
    #: going back from on-demand to Spot also needs this fraction of that line slack
    line_return_fraction: float = 0.3
    #: a running on-demand try moves to Spot only when Spot runs last, on average, this many times
    #: what the move throws away (a changeover plus the try's uncommitted work); 0: always move
    switch_run_factor: float = 2.5
    #: a fresh Spot start is skipped when Spot runs last, on average, under this many changeovers
    min_run_changeovers: float = 1.5
    #: escalate when the expected capacity is short of the rate the remaining work needs
    rate_rule: bool = False
    #: the caller re-decides at least this often while a try runs (the simulator's tick); ``None``
    #: means a try is decided once and runs to its end, so its whole shard is at risk
    decision_interval_s: float | None = None
    #: a preemption storm: this many consecutive Spot tries preempted without a commit (plus one
    #: per worker beyond the first: one reclaim can end them all) send fresh tries on-demand (0: off)
    storm_tries: int = 6
    #: ... until a cool-down of this many (changeover + shard) has passed since the last of them,
    #: doubled for every round of one fruitless try per worker beyond the storm (at most
    #: ``2 ** storm_backoff_cap``)
    storm_cooldown_tries: float = 4.0
    storm_backoff_cap: int = 6
    #: the job may cost at most this fraction more than on-demand only (0.01: 1 %): a Spot try is
    #: taken only while what it can waste before the next decision fits (:func:`cost_room_s`);
    #: ``None``, or a snapshot without ``price_ratio``/``cost_excess_s``/``total_work_s``: off
    cost_cap: float | None = None
    #: when the cap blocks a Spot try, hold the worker (no try, re-decide at the next interval:
    #: free) instead of going on-demand, while slack stays above the waiting reserve; needs
    #: ``decision_interval_s`` (the simulator; an operator cannot hold), off without it
    cap_holds: bool = True
    #: the move from a running on-demand try to Spot weighs the shorter of the learned spell
    #: length and the mean run of the job's own Spot tries (``JobSnapshot.tries_mean_run_s``): a
    #: gang reclaimed within minutes of every return does not look like long spells
    switch_on_tries: bool = False
    #: a running on-demand try moves to Spot only while fewer other workers' Spot tries are still
    #: in their changeover (``JobSnapshot.spot_workers_starting``) than have passed it, or none
    #: when none has: moves go 1, 1, 2, 4, … per round, so a gang reclaimed at once throws away
    #: few on-demand tries (docs/simulator.md, *A per-run bound by default?*)
    return_doubling: bool = False
    #: a fresh Spot try is taken only while its expected price per committed hour of work
    #: (:func:`spot_cost_ratio`: changeover, work lost to a preemption, spells of the learned mean
    #: length) stays under this fraction of on-demand's; ``None``, or a snapshot without
    #: ``price_ratio``/``spot_mean_run_s``: off
    spot_cost_limit: float | None = 1.0
    #: in the job's tail (no shard left to pull, a worker idle), escalate a running Spot try by a
    #: duplicate on on-demand that races it instead of stopping it, when :func:`should_speculate`
    #: says the race is expected to cost less (the simulator; the runner does not race yet)
    race_tail: bool = True
    #: Uniform Progress as a floor on waiting (docs/simulator.md, *Sixth round*): while Spot is
    #: missing, the waiting reserve does not send a worker on-demand while the job's committed work
    #: is at or ahead of UP's line ``W · elapsed / window`` (:func:`up_lead_s`), where UP itself
    #: still waits; the safety rule still decides the last safe moment. Off without the job's start
    #: and total work
    up_wait_floor: bool = False
    #: ... and its mirror: a running on-demand try goes back to Spot without the return margin
    #: (``switch_run_factor`` and the expected-cost rule still apply) once the job is ahead of UP's
    #: line ``2 d`` from now, where UP's hysteresis returns it
    up_return_floor: bool = False
    #: the current spell's age (docs/simulator.md, *Seventh round*; ``JobSnapshot.spell_age_factor``,
    #: the expected rest of the current spell over a fresh one's mean, capped at ``spell_age_cap``
    #: either way; one Spot pool only): with Spot missing the waiting reserve grows by the factor
    #: (an outage that has lasted is likely to last: escalate sooner) ...
    spell_age_wait: bool = False
    #: ... with Spot there the return margin shrinks by it (a spell that has lasted is likely to
    #: last: give the on-demand try back sooner) ...
    spell_age_return: bool = False
    #: ... and the learned spell length (``spot_mean_run_s``, memoryless) grows by it: the expected
    #: cost of a Spot try and the switch from a running on-demand try see the rest of this spell
    spell_age_run: bool = False
    spell_age_cap: float = 2.0
    #: the factor's measure (the caller's, ``core.calibration.SpellAges.age_factor``): ``None``, the
    #: spell's expected rest over the mean; hours, memoryless spells' chance to end within them over
    #: this spell's, so a young spell that likely ends soon counts as shorter than the mean
    spell_age_horizon_h: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.availability_prior <= 1.0:
            raise ValueError("availability_prior must be within [0, 1]")
        if not 0.0 < self.availability_discount <= 1.0:
            raise ValueError("availability_discount must be within (0, 1]")
        if self.line_reserve_cap is not None and self.line_reserve_cap < 0:
            raise ValueError("line_reserve_cap must be >= 0")
        if (
            min(
                self.return_margin_changeovers,
                self.reserve_changeovers,
                self.min_run_changeovers,
                self.line_return_fraction,
                self.switch_run_factor,
            )
            < 0
        ):
            raise ValueError("margins must be >= 0")
        if self.decision_interval_s is not None and self.decision_interval_s < 0:
            raise ValueError("decision_interval_s must be >= 0")
        if self.spot_cost_limit is not None and not self.spot_cost_limit > 0:
            raise ValueError("spot_cost_limit must be > 0")
        if self.cost_cap is not None and not self.cost_cap >= 0:
            raise ValueError("cost_cap must be >= 0")
        if self.storm_tries < 0 or self.storm_cooldown_tries < 0 or self.storm_backoff_cap < 0:
            raise ValueError("storm_tries, storm_cooldown_tries and storm_backoff_cap must be >= 0")
        if self.spell_age_horizon_h is not None and not self.spell_age_horizon_h > 0:
            raise ValueError("spell_age_horizon_h must be > 0 hours, or None for the expected rest")
        if not self.spell_age_cap >= 1.0:
            raise ValueError("spell_age_cap must be >= 1 (1: the spell's age changes nothing)")

    @property
    def spell_age(self) -> bool:
        """Whether any rule uses the current spell's age (the estimate then keeps the spells)."""
        return self.spell_age_wait or self.spell_age_return or self.spell_age_run


DEFAULT_POLICY = PolicyParams()


@dataclass(frozen=True, kw_only=True)
class SpotOption:
    """One of several Spot pools (zones, regions, GPU types) a try may go to, as the job sees it now.

    Prices are per GPU-second relative to the reference Spot price (on-demand costs
    ``JobSnapshot.price_ratio``); ``speed`` is the pool's throughput over the reference rate the
    work is counted in (a shard of ``S`` takes ``S / speed`` there). ``mean_run_s`` and
    ``availability`` are what the job learned of this pool (``None``: unknown, the job-wide values
    stand).
    """

    name: str
    price: float = 1.0
    speed: float = 1.0
    available: bool = True
    availability: float | None = None
    mean_run_s: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a Spot option needs a name")
        if not (self.price > 0 and self.speed > 0) or math.isinf(self.price) or math.isinf(self.speed):
            raise ValueError(f"Spot option {self.name!r}: price and speed must be finite and > 0")
        if self.availability is not None and not 0.0 <= self.availability <= 1.0:
            raise ValueError(f"Spot option {self.name!r}: availability must be within [0, 1]")
        if self.mean_run_s is not None and not self.mean_run_s >= 0:
            raise ValueError(f"Spot option {self.name!r}: mean_run_s must be >= 0")


@dataclass(frozen=True, kw_only=True)
class JobSnapshot:
    """What the placement decision knows of a job at one decision point."""

    now: dt.datetime
    deadline: dt.datetime
    #: GPU-seconds of uncommitted work for the whole job (reference pool rate)
    remaining_work_s: float
    #: remaining GPU-seconds of the shard being placed (what a preemption can destroy)
    shard_work_s: float
    #: workers the job runs at once (>= 1)
    parallelism: int
    #: startup cost of a (re)start: pod scheduling + model load
    changeover_s: float
    #: preemption notice the Spot pool gives
    notice_s: float = 0.0
    #: observed / configured Spot preemption rate
    spot_preemptions_per_hour: float = 0.0
    #: whether Spot capacity is believed available now
    spot_available: bool = True
    #: pool of this shard's previous try (hysteresis)
    previous_pool: PoolKind | None = None
    #: workers of this job currently on on-demand, this one excluded (mixing)
    on_demand_workers: int = 0
    #: the try is running on ``previous_pool`` now (continuing costs no changeover)
    running: bool = False
    #: observed fraction of time Spot capacity was available (``None``: use the policy's prior)
    spot_availability: float | None = None
    #: observed mean length of a Spot spell, in seconds (``None``: unknown)
    spot_mean_run_s: float | None = None
    #: when the job started (with ``total_work_s``: the uniform-progress line; ``None``: unknown)
    started_at: dt.datetime | None = None
    #: GPU-seconds of the whole job (``None``: unknown)
    total_work_s: float | None = None
    #: seconds the running try has spent that leaving it throws away (changeover done so far plus
    #: uncommitted work); 0 when unknown or not running
    running_progress_s: float = 0.0
    #: the most recent consecutive Spot tries (of the job, or of this shard if more) that were
    #: preempted without committing anything (:class:`core.calibration.SpotTries`)
    spot_fruitless_tries: int = 0
    #: seconds since the latest of them ended (``None``: none, or unknown)
    spot_fruitless_age_s: float | None = None
    #: other workers of this job on Spot now (a storm probe runs one at a time)
    spot_workers: int = 0
    #: seconds of changeover the running try has still to run (``None``: unknown; a running Spot try
    #: is then assumed to have its whole changeover ahead, the worst case)
    changeover_left_s: float | None = None
    #: on-demand price over Spot price (``None``: unknown; the cost cap is off)
    price_ratio: float | None = None
    #: what the job has spent beyond on-demand's price of the work it keeps, in Spot-price seconds:
    #: cost so far minus ``price_ratio`` × (committed work + changeover done and uncommitted work of
    #: the running on-demand tries); ``None``: unknown (the cost cap is off)
    cost_excess_s: float | None = None
    #: shards of the whole job (``None``: unknown, assumed at least ``parallelism``); on-demand only
    #: starts ``min(parallelism, total_shards)`` workers, each paying one changeover
    total_shards: int | None = None
    #: the job's Spot pools when it has several (empty: one Spot pool, described by the ``spot_*``
    #: fields above); :func:`choose_pool` then names the pool of a Spot decision
    spot_pools: tuple[SpotOption, ...] = ()
    #: the Spot pool (an option's name) of the running try or the one being decided for
    spot_pool: str | None = None
    #: mean run of the job's own Spot tries before a preemption (``SpotTries.mean_run_s``;
    #: ``None``: unknown or none preempted)
    tries_mean_run_s: float | None = None
    #: of ``spot_workers``, those whose try is still in its changeover (``return_doubling``)
    spot_workers_starting: int = 0
    #: seconds from a try's end to the next try's decision when each try is decided once (no
    #: ``decision_interval_s``): the operator's resume or retry delay plus Airflow's latency to start
    #: the task again (a deferred try's end first reaches a worker through its trigger's poll and a
    #: resume), the local runner's poll. Slack burns through it with nothing running, so a
    #: Spot try's risk includes it (:func:`spot_risk_s`); ignored with a decision interval
    turnaround_s: float = 0.0
    #: the expected rest of the current spell of Spot presence (``spot_available``) or absence,
    #: given its age, over the mean length of a fresh spell of that kind (``core.calibration.
    #: SpellAges.age_factor``: 1 for memoryless spells; ``None``: unknown, the age rules are off)
    spell_age_factor: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "now", ensure_aware(self.now, "now"))
        object.__setattr__(self, "deadline", ensure_aware(self.deadline, "deadline"))
        if self.parallelism < 1:
            raise ValueError(f"parallelism must be >= 1, got {self.parallelism}")
        for name in (
            "remaining_work_s",
            "shard_work_s",
            "changeover_s",
            "notice_s",
            "spot_preemptions_per_hour",
            "running_progress_s",
            "turnaround_s",
        ):
            value = getattr(self, name)
            if not value >= 0 or math.isinf(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        object.__setattr__(self, "spot_pools", tuple(self.spot_pools))
        if len({o.name for o in self.spot_pools}) != len(self.spot_pools):
            raise ValueError("Spot option names must be unique")
        if self.total_shards is not None and self.total_shards < 1:
            raise ValueError(f"total_shards must be >= 1, got {self.total_shards}")
        if self.on_demand_workers < 0 or self.spot_workers < 0 or self.spot_fruitless_tries < 0:
            raise ValueError("on_demand_workers, spot_workers and spot_fruitless_tries must be >= 0")
        if self.spot_availability is not None and not 0.0 <= self.spot_availability <= 1.0:
            raise ValueError("spot_availability must be within [0, 1]")
        if self.changeover_left_s is not None and not (
            self.changeover_left_s >= 0 and not math.isinf(self.changeover_left_s)
        ):
            raise ValueError(f"changeover_left_s must be finite and >= 0, got {self.changeover_left_s!r}")
        if self.spot_mean_run_s is not None and not self.spot_mean_run_s >= 0:
            raise ValueError("spot_mean_run_s must be >= 0")
        if self.spell_age_factor is not None and not (
            self.spell_age_factor > 0 and not math.isinf(self.spell_age_factor)
        ):
            raise ValueError(f"spell_age_factor must be finite and > 0, got {self.spell_age_factor!r}")
        if self.previous_pool is not None:
            object.__setattr__(self, "previous_pool", PoolKind(self.previous_pool))
        if self.started_at is not None:
            object.__setattr__(self, "started_at", ensure_aware(self.started_at, "started_at"))
        if self.total_work_s is not None and not (
            self.total_work_s >= 0 and not math.isinf(self.total_work_s)
        ):
            raise ValueError(f"total_work_s must be a finite number >= 0, got {self.total_work_s!r}")


@dataclass(frozen=True)
class PlacementDecision:
    """Where the next try goes, why, and the timeouts the operator derives from it."""

    pool: PoolKind
    #: one human sentence with numbers (logged by the operator)
    reason: str
    slack_s: float
    #: after this, a Spot start is no longer safe; the operator's pod startup timeout
    last_safe_spot_start: dt.datetime | None
    #: how long to wait for the pod to be scheduled before giving up (>= 60)
    startup_timeout_s: int
    #: termination grace the worker needs (notice-aware)
    grace_period_s: int
    #: the Spot pool a Spot decision names, with several (``JobSnapshot.spot_pools``); else ``None``
    spot_pool: str | None = None
    #: a Spot decision that starts no try now, even with capacity: the cost cap holds the worker
    #: idle until the next decision (``PolicyParams.cap_holds``; only with a decision interval)
    hold: bool = False


@dataclass(frozen=True)
class SlackBreakdown:
    """The quantities behind a decision, in seconds; exposed for the simulator, logs and tests."""

    time_left_s: float
    od_need_s: float
    slack_s: float
    spot_risk_s: float
    required_rate: float
    expected_rate: float


def od_need_s(snapshot: JobSnapshot) -> float:
    """Wall time the job needs from now if every worker goes on-demand now (changeover included).

    With several workers pulling shards from one queue, the last one may finish up to one shard
    later than the average (list scheduling), hence the imbalance term.
    """
    p = snapshot.parallelism
    imbalance = snapshot.shard_work_s * (p - 1) / p
    return snapshot.changeover_s + snapshot.remaining_work_s / p + imbalance


def spot_option(snapshot: JobSnapshot) -> SpotOption | None:
    """The option of ``snapshot.spot_pool`` among ``spot_pools`` (``None``: single pool, or unknown)."""
    return next((o for o in snapshot.spot_pools if o.name == snapshot.spot_pool), None)


def _spot_speed(snapshot: JobSnapshot) -> float:
    option = spot_option(snapshot)
    return 1.0 if option is None else option.speed


def spot_risk_s(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> float:
    """Slack a Spot choice may burn, at worst, before the next decision can still go on-demand.

    Slack (time left minus :func:`od_need_s`) counts committed work only, so it falls at most as
    fast as wall time, and only while nothing commits (docs/design.md §5, *Placement*):

    * a Spot try that gets capacity burns its changeover still to run (all of it for a fresh
      start) plus at most one shard of uncommitted work (less the notice): by then it has committed,
      which gives the slack back, or it was preempted, which ends the try and calls for a decision;
    * waiting for missing Spot burns all the time until the next decision;
    * re-decided every ``decision_interval_s`` (the simulator's tick), nothing burns more than one
      interval, and waiting burns exactly that. With several workers the job's slack falls by the
      mean of what each worker burns, an idle or restarted on-demand worker included, so only the
      whole interval bounds it: every worker then sees the same risk and all escalate together.

    Without an interval (an operator decides once per try) waiting is bounded by the startup
    timeout the decision sets (:attr:`PlacementDecision.last_safe_spot_start`), so the risk is the
    try's own, plus the turnaround before the next try can decide (``turnaround_s``): a Spot try that
    fails at its worst moment, or whose pod gives up waiting at the last safe start, leaves the next
    decision that much later, with nothing committed meanwhile.
    """
    continuing = snapshot.running and snapshot.previous_pool is PoolKind.SPOT
    if continuing:
        left = snapshot.changeover_left_s
        changeover = snapshot.changeover_s if left is None else left
    else:
        changeover = snapshot.changeover_s
    # a slower Spot pool (several pools) takes longer to commit the shard
    speed = _spot_speed(snapshot)
    try_worst = changeover + max(0.0, snapshot.shard_work_s / speed - snapshot.notice_s)
    interval = policy.decision_interval_s
    if interval is None:
        return try_worst + snapshot.turnaround_s
    if snapshot.parallelism > 1 or not (snapshot.spot_available or continuing):
        return interval
    if speed < 1.0:
        # committing at ``speed`` gives back less slack than the wall time it takes: beyond its
        # first shard a slow pool still burns ``1 − speed`` of the interval
        try_worst += (1.0 - speed) * max(0.0, interval - try_worst)
    return min(try_worst, interval)


def breakdown(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> SlackBreakdown:
    """Compute slack, risk and the required versus expected service rate (in workers)."""
    time_left = (snapshot.deadline - snapshot.now).total_seconds()
    need = od_need_s(snapshot)
    p = snapshot.parallelism
    m = min(snapshot.on_demand_workers, p - 1)
    usable = max(time_left - snapshot.changeover_s, 1e-9)
    required = (need - snapshot.changeover_s) * p / usable
    availability = (
        policy.availability_prior if snapshot.spot_availability is None else snapshot.spot_availability
    )
    # A Spot spell of mean length L yields work for L - d of it (the changeover is lost).
    useful = 1.0
    if snapshot.spot_mean_run_s is not None:
        useful = max(0.0, 1.0 - snapshot.changeover_s / max(snapshot.spot_mean_run_s, 1e-9))
    expected = m + availability * policy.availability_discount * useful * (p - m)
    return SlackBreakdown(
        time_left_s=time_left,
        od_need_s=need,
        slack_s=time_left - need,
        spot_risk_s=spot_risk_s(snapshot, policy),
        required_rate=required,
        expected_rate=expected,
    )


def cost_room_s(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> float | None:
    """Spot-price seconds a Spot try may still waste before the job could cost more than allowed.

    Going on-demand now with every worker costs at most ``price_ratio × (remaining work +
    parallelism × changeover)``, so the job's final cost is at most on-demand only's plus
    ``cost_excess_s``. On-demand work never raises the excess (paid ``k``, credited ``k``); only
    Spot time that commits nothing does, and throwing away a running on-demand try. The room is
    ``cost_cap × on-demand only's cost − excess``; ``None`` when the cap is off or an input unknown.

    On-demand only starts ``m = min(parallelism, total_shards)`` workers, while the bound above
    pays a changeover for all ``parallelism``: the ``parallelism − m`` extra changeovers (credited
    to the excess for the workers with nothing to pull) are taken from the room, so a job with
    fewer shards than workers cannot spend that credit on Spot.
    """
    k, excess, total = snapshot.price_ratio, snapshot.cost_excess_s, snapshot.total_work_s
    if policy.cost_cap is None or k is None or excess is None or total is None:
        return None
    p = snapshot.parallelism
    starts = p if snapshot.total_shards is None else min(p, snapshot.total_shards)
    on_demand_only = k * (total + starts * snapshot.changeover_s)
    return policy.cost_cap * on_demand_only - excess - k * (p - starts) * snapshot.changeover_s


def spot_waste_s(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> float:
    """The most a Spot choice for this worker can add to the excess before the next decision.

    Every worker on Spot (this one and ``spot_workers`` others) may burn its changeover plus one
    shard (at most one decision interval) at Spot price without committing; leaving a running
    on-demand try throws its progress away at on-demand price.
    """
    d = snapshot.changeover_s
    interval = math.inf if policy.decision_interval_s is None else policy.decision_interval_s
    option = spot_option(snapshot)
    price, speed = (1.0, 1.0) if option is None else (option.price, option.speed)
    shard_wall = snapshot.shard_work_s / speed
    own = d + shard_wall
    left = snapshot.changeover_left_s
    if snapshot.running and snapshot.previous_pool is PoolKind.SPOT and left is not None:
        # the running try commits once its changeover and the rest of its shard are done
        uncommitted = max(0.0, snapshot.running_progress_s - (d - left))
        own = left + max(0.0, shard_wall - uncommitted)
    # other workers may be on any of the job's Spot pools: the dearest and slowest price them
    others_price = max((o.price for o in snapshot.spot_pools), default=1.0)
    others_wall = snapshot.shard_work_s / min((o.speed for o in snapshot.spot_pools), default=1.0)
    waste = price * min(own, interval) + others_price * min(d + others_wall, interval) * snapshot.spot_workers
    if snapshot.running and snapshot.previous_pool is PoolKind.ON_DEMAND:
        waste += (snapshot.price_ratio or 1.0) * snapshot.running_progress_s
    return waste


def spot_cost_ratio(
    snapshot: JobSnapshot,
    *,
    mean_run_s: float | None = None,
    price: float | None = None,
    speed: float | None = None,
) -> float | None:
    """Expected price of a fresh Spot try per hour of work it commits, over on-demand's price.

    A try runs for a time ``T`` drawn from an exponential of the learned mean spell length ``L``
    (memoryless: what the job has seen is all it knows); it pays ``T`` at the Spot ``price`` and
    commits a shard for every full ``S / speed`` after its changeover ``d``, so its expected work
    is ``S · e^(−(d + S/speed)/L) / (1 − e^(−S/(speed·L)))`` for ``price · L`` paid. Above 1 the
    try is expected to cost more than running the same work on on-demand (``price_ratio``,
    reference throughput). ``None`` when the price ratio or the spell length is unknown. Price and
    speed default to those of ``snapshot.spot_pool`` (1 with a single Spot pool).
    """
    k = snapshot.price_ratio
    run = snapshot.spot_mean_run_s if mean_run_s is None else mean_run_s
    shard = snapshot.shard_work_s
    option = spot_option(snapshot)
    if price is None:
        price = 1.0 if option is None else option.price
    if speed is None:
        speed = 1.0 if option is None else option.speed
    if k is None or run is None or shard <= 0 or speed <= 0:
        return None
    if run <= 0:
        return math.inf
    shard_wall = shard / speed
    work = shard * math.exp(-(snapshot.changeover_s + shard_wall) / run) / -math.expm1(-shard_wall / run)
    if work <= 0:
        return math.inf
    return price * run / (k * work)


def line_slack_s(snapshot: JobSnapshot) -> float:
    """Slack left now by a job that spends its initial slack uniformly over its window.

    The initial slack is the window minus the on-demand need of the whole job (same terms as
    :func:`od_need_s`); the line scales it by the share of the window still left, as Uniform
    Progress's line does. 0 when the start or the total work is unknown (the rules using it are off).
    """
    if snapshot.started_at is None or snapshot.total_work_s is None:
        return 0.0
    window = (snapshot.deadline - snapshot.started_at).total_seconds()
    if window <= 0:
        return 0.0
    p = snapshot.parallelism
    initial_need = snapshot.changeover_s + snapshot.total_work_s / p + snapshot.shard_work_s * (p - 1) / p
    time_left = max(0.0, (snapshot.deadline - snapshot.now).total_seconds())
    return max(0.0, window - initial_need) * time_left / window


def up_lead_s(snapshot: JobSnapshot, ahead_s: float = 0.0) -> float | None:
    """Work committed beyond Uniform Progress's line ``ahead_s`` from now, in work seconds.

    UP's line (*Can't Be Late*) is ``W · t / window``; committed work is ``W − remaining``. ``None``
    when the job's start or total work is unknown.
    """
    total = snapshot.total_work_s
    if snapshot.started_at is None or total is None:
        return None
    window = (snapshot.deadline - snapshot.started_at).total_seconds()
    if window <= 0:
        return None
    elapsed = (snapshot.now - snapshot.started_at).total_seconds() + ahead_s
    return (total - snapshot.remaining_work_s) - total * elapsed / window


def storm_cooldown_s(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> float | None:
    """Seconds a storm keeps fresh Spot tries off after its last fruitless try; None: no storm.

    A storm is ``storm_tries + parallelism - 1`` consecutive Spot tries preempted without a commit
    (docs/design.md §5, *Observed preemptions*): one reclaim may end every worker's try at once.
    The cool-down is ``storm_cooldown_tries`` tries' length (changeover plus the shard), doubled
    for every further round of ``parallelism`` fruitless tries (with one worker: every further
    try), so probing Spot costs a bounded share of the job's tries however long the storm lasts.
    """
    n = snapshot.spot_fruitless_tries
    # one reclaim can take every worker of the job at once: that alone is not a storm
    p = snapshot.parallelism
    need = policy.storm_tries + p - 1
    if policy.storm_tries <= 0 or n < need:
        return None
    # the backoff doubles per round of one fruitless try per worker: a reclaim that ends every
    # worker's try at once is one more failure, not ``parallelism`` of them (counted per try, two
    # reclaims of 8 workers kept Spot off for 8 × the cool-down, 14 h: gang8-902, docs/simulator.md)
    doublings = min((n - need) // p, policy.storm_backoff_cap)
    try_s = snapshot.changeover_s + snapshot.shard_work_s
    return policy.storm_cooldown_tries * try_s * 2.0**doublings


def in_storm(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> bool:
    """Whether a fresh Spot try is off because Spot tries stopped making progress.

    After the cool-down one probe may go to Spot, and only while no other Spot try of the job runs
    (a running one is the probe). An unknown age (no clock for the last try) keeps the storm on.
    """
    cooldown = storm_cooldown_s(snapshot, policy)
    if cooldown is None:
        return False
    age = snapshot.spot_fruitless_age_s
    return age is None or age < cooldown or snapshot.spot_workers > 0


def grace_period_s(snapshot: JobSnapshot) -> int:
    """Termination grace: the Spot notice when there is one (nothing after it counts), else a default."""
    if snapshot.notice_s > 0:
        return max(1, int(snapshot.notice_s))
    return DEFAULT_GRACE_S


def pick_spot_pool(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> SpotOption | None:
    """The Spot pool a Spot try (or a wait for Spot) would go to, with several; ``None`` with one.

    A running Spot try keeps its pool. Otherwise, among the pools with capacity now (all of them
    when none has), the lowest expected price per unit of work (:func:`spot_cost_ratio` with each
    pool's learned spell length, price and speed; the price per unit of work where no spell length
    is known); ties go to the more available pool, then to the order of declaration.
    """
    options = snapshot.spot_pools
    if not options:
        return None
    if snapshot.running and snapshot.previous_pool is PoolKind.SPOT:
        current = spot_option(snapshot)
        if current is not None:
            return current
    candidates = [o for o in options if o.available] or list(options)
    k = snapshot.price_ratio or 1.0

    def key(item: tuple[int, SpotOption]) -> tuple[float, float, int]:
        index, option = item
        run, price, speed = option.mean_run_s, option.price, option.speed
        ratio = spot_cost_ratio(snapshot, mean_run_s=run, price=price, speed=speed)
        if ratio is None:
            ratio = option.price / (option.speed * k)
        availability = policy.availability_prior if option.availability is None else option.availability
        return ratio, -availability, index

    return min(enumerate(candidates), key=key)[1]


def _on_option(snapshot: JobSnapshot, option: SpotOption) -> JobSnapshot:
    """The snapshot as if the job had only ``option`` as Spot pool (waiting counts on any pool)."""
    known = [o.availability for o in snapshot.spot_pools if o.availability is not None]
    availability = snapshot.spot_availability
    if known:
        availability = 1.0 - math.prod(1.0 - a for a in known)
    return replace(
        snapshot,
        spot_pool=option.name,
        spot_available=option.available,
        spot_mean_run_s=snapshot.spot_mean_run_s if option.mean_run_s is None else option.mean_run_s,
        spot_availability=availability,
    )


def spell_age_factor(snapshot: JobSnapshot, policy: PolicyParams = DEFAULT_POLICY) -> float:
    """The snapshot's spell-age factor within ``[1 / spell_age_cap, spell_age_cap]``; 1 when
    unknown, with several Spot pools (the factor is the job's one pool's) or no age rule on."""
    factor = snapshot.spell_age_factor
    if factor is None or snapshot.spot_pools or not policy.spell_age:
        return 1.0
    return min(max(factor, 1.0 / policy.spell_age_cap), policy.spell_age_cap)


def choose_pool(snapshot: JobSnapshot, policy: PolicyParams | None = None) -> PlacementDecision:
    """Choose Spot or on-demand for the next try of a shard (see the module docstring for the rule).

    With several Spot pools (``snapshot.spot_pools``) the Spot side is the pool
    :func:`pick_spot_pool` names, and a Spot decision carries its name; the safety rule is the same
    (slack against the on-demand fallback, the risk of a try on that pool).
    """
    policy = policy or DEFAULT_POLICY
    option = pick_spot_pool(snapshot, policy)
    if option is not None:
        snapshot = _on_option(snapshot, option)
    age = spell_age_factor(snapshot, policy)
    run_s = snapshot.spot_mean_run_s
    if policy.spell_age_run and snapshot.spot_available and run_s is not None and age != 1.0:
        snapshot = replace(snapshot, spot_mean_run_s=run_s * age)
    b = breakdown(snapshot, policy)
    d = snapshot.changeover_s
    prev = snapshot.previous_pool
    continuing_spot = snapshot.running and prev is PoolKind.SPOT
    continuing_od = snapshot.running and prev is PoolKind.ON_DEMAND
    line = line_slack_s(snapshot)
    # UP's own return (its hysteresis: ahead of its line 2 d from now, with Spot there)
    up_returns = False
    if policy.up_return_floor and continuing_od and snapshot.spot_available:
        lead = up_lead_s(snapshot, 2 * d)
        up_returns = lead is not None and lead >= 0
    margin = (
        policy.return_margin_changeovers * d + policy.line_return_fraction * line
        if prev is PoolKind.ON_DEMAND and not up_returns
        else 0.0
    )
    if policy.spell_age_return and snapshot.spot_available:
        margin /= age
    spot_needs = b.spot_risk_s + margin
    room_s = b.slack_s - spot_needs  # how long a Spot try may wait for capacity
    last_safe = snapshot.now + dt.timedelta(seconds=max(0.0, room_s))

    def decide(pool: PoolKind, why: str, hold: bool = False) -> PlacementDecision:
        if pool is PoolKind.SPOT and policy.decision_interval_s is None and room_s < MIN_STARTUP_TIMEOUT_S:
            # a try's pod waits for capacity at least the minimum startup timeout: this close to
            # the last safe Spot start, that wait could outlast it (one decision per try, no tick)
            pool, hold = PoolKind.ON_DEMAND, False
            why = (
                f"{why}, but a Spot pod's shortest wait for capacity ({MIN_STARTUP_TIMEOUT_S} s) "
                f"would outlast the last safe Spot start ({max(0.0, room_s):.0f} s away)"
            )
        if pool is PoolKind.SPOT:
            timeout = max(MIN_STARTUP_TIMEOUT_S, int(max(0.0, room_s)))
            safe: dt.datetime | None = last_safe
        else:
            timeout = max(MIN_STARTUP_TIMEOUT_S, int(max(0.0, b.slack_s)))
            safe = None
        reason = (
            f"{pool.value}: {why} (slack {b.slack_s / 3600:.2f} h, Spot risk "
            f"{spot_needs / 3600:.2f} h, need {b.required_rate:.2f} workers, "
            f"expect {b.expected_rate:.2f})"
        )
        return PlacementDecision(
            pool=pool,
            reason=reason,
            slack_s=b.slack_s,
            last_safe_spot_start=safe,
            startup_timeout_s=timeout,
            grace_period_s=grace_period_s(snapshot),
            spot_pool=option.name if option is not None and pool is PoolKind.SPOT else None,
            hold=hold,
        )

    if b.slack_s < spot_needs:
        return decide(PoolKind.ON_DEMAND, "slack no longer covers a Spot try's worst case")
    per_worker = snapshot.remaining_work_s / snapshot.parallelism
    reserve = policy.reserve_changeovers * d + policy.reserve_work_fraction * per_worker
    if policy.spell_age_wait and not snapshot.spot_available:
        reserve *= age
    if policy.line_reserve_cap is not None and line > 0:
        reserve = min(reserve, policy.line_reserve_cap * line)
    room = cost_room_s(snapshot, policy)
    if room is not None and room < spot_waste_s(snapshot, policy):
        interval = policy.decision_interval_s
        # holding burns the whole interval of slack, with or without Spot capacity
        holdable = policy.cap_holds and interval is not None and not continuing_od
        if holdable and interval is not None and b.slack_s >= max(interval, spot_needs) + reserve:
            return decide(
                PoolKind.SPOT,
                f"hold: a Spot try could make the job dearer than on-demand (room "
                f"{room / 3600:.2f} Spot h) and slack is above its reserve",
                hold=True,
            )
        return decide(
            PoolKind.ON_DEMAND,
            f"a Spot try could make the job dearer than on-demand (room {room / 3600:.2f} Spot h)",
        )
    if not continuing_spot and in_storm(snapshot, policy):
        return decide(
            PoolKind.ON_DEMAND,
            f"preemption storm: the last {snapshot.spot_fruitless_tries} Spot tries were preempted "
            "before committing anything",
        )
    short = policy.rate_rule and b.required_rate > b.expected_rate
    worth = snapshot.spot_mean_run_s is None or snapshot.spot_mean_run_s >= policy.min_run_changeovers * d
    ratio = None if policy.spot_cost_limit is None else spot_cost_ratio(snapshot)
    dear = ratio is not None and policy.spot_cost_limit is not None and ratio >= policy.spot_cost_limit
    if dear and not continuing_spot:
        # waiting is free but cannot be told apart from a Spot try here: on-demand when Spot is
        # there, else wait above the reserve (below)
        worth = False
    if snapshot.spot_available and (continuing_spot or worth):
        if continuing_spot:
            return decide(PoolKind.SPOT, "keep the running Spot try while it is safe")
        if continuing_od and short:
            return decide(PoolKind.ON_DEMAND, "behind the rate Spot can be expected to deliver")
        if continuing_od and snapshot.spot_mean_run_s is not None:
            thrown = d + snapshot.running_progress_s
            run = snapshot.spot_mean_run_s
            if policy.switch_on_tries and snapshot.tries_mean_run_s is not None:
                run = min(run, snapshot.tries_mean_run_s)
            if run < policy.switch_run_factor * thrown:
                return decide(
                    PoolKind.ON_DEMAND, "keep the running on-demand try: Spot would not repay the switch"
                )
            starting = snapshot.spot_workers_starting
            if policy.return_doubling and starting >= max(1, snapshot.spot_workers - starting):
                return decide(
                    PoolKind.ON_DEMAND,
                    "keep the running on-demand try: other workers' Spot tries are still starting",
                )
        return decide(PoolKind.SPOT, "Spot is available and slack covers a preemption")
    # Spot is missing (or too short-lived): wait for it (free, burns slack) or escalate this worker.
    if short:
        return decide(PoolKind.ON_DEMAND, "Spot is missing and the expected capacity is short")
    # UP waits while the job is at or ahead of its line (Spot missing, worker not on on-demand)
    up_waits = False
    if policy.up_wait_floor and not continuing_od and not snapshot.spot_available:
        lead = up_lead_s(snapshot)
        up_waits = lead is not None and lead >= 0
    if b.slack_s < spot_needs + reserve and not up_waits:
        return decide(PoolKind.ON_DEMAND, "Spot is missing or short-lived and slack is down to its reserve")
    if continuing_od:
        return decide(PoolKind.ON_DEMAND, "keep the running on-demand try: Spot runs are too short")
    if snapshot.spot_available and dear:
        return decide(
            PoolKind.ON_DEMAND, f"a Spot try is expected to cost {ratio:.2f} x on-demand per hour of work"
        )
    if snapshot.spot_available:
        return decide(PoolKind.SPOT, "Spot runs are short-lived, but slack still affords a try")
    return decide(PoolKind.SPOT, "wait for Spot: slack is above its reserve")


def race_gain(
    *,
    remaining_s: float,
    price: float,
    mean_run_s: float | None,
    duplicate_s: float,
    duplicate_price: float,
) -> float:
    """Expected saving of racing a running try against its escalation, in price × seconds.

    The alternative is the escalation itself: stop the running try and run the shard on the other
    pool, ``duplicate_price × duplicate_s`` (its changeover and the whole shard). Racing starts the
    same duplicate but keeps the running try, which still needs ``remaining_s`` and is preempted
    after an exponential time of mean ``mean_run_s`` (``None``: never). It wins with probability
    ``q = e^(−remaining/mean)`` when it needs less than the duplicate; the duplicate is then
    cancelled early, saving ``duplicate_price × (duplicate_s − remaining_s)``; keeping it costs
    ``price × E[min(preemption, remaining_s)]`` whoever wins. Gain = ``q × saving − that cost``;
    never positive when the running try needs as long as the duplicate.
    """
    if min(remaining_s, price, duplicate_s, duplicate_price) < 0:
        raise ValueError("remaining_s, price, duplicate_s and duplicate_price must be >= 0")
    if remaining_s >= duplicate_s:
        return -price * (remaining_s if mean_run_s is None else min(remaining_s, mean_run_s))
    if mean_run_s is None:
        q, kept = 1.0, remaining_s
    elif mean_run_s <= 0:
        return 0.0 if remaining_s == 0 else -math.inf
    else:
        q = math.exp(-remaining_s / mean_run_s)
        kept = mean_run_s * -math.expm1(-remaining_s / mean_run_s)
    return q * duplicate_price * (duplicate_s - remaining_s) - price * kept


def should_speculate(
    *,
    remaining_s: float,
    price: float,
    mean_run_s: float | None,
    duplicate_s: float,
    duplicate_price: float,
) -> bool:
    """Whether a try the safety rule escalates should race a duplicate instead of stopping.

    Only for the job's tail: the duplicate needs a worker with nothing else to pull (the caller
    checks), and it runs on on-demand, so the deadline is as safe as with the escalation: the
    duplicate alone finishes when the escalated try would have. True when :func:`race_gain` > 0.
    """
    gain = race_gain(
        remaining_s=remaining_s,
        price=price,
        mean_run_s=mean_run_s,
        duplicate_s=duplicate_s,
        duplicate_price=duplicate_price,
    )
    return gain > 0
