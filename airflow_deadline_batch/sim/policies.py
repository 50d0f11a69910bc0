"""Policies compared by the simulator: the baselines of *Can't Be Late* (NSDI '24) and the project's.

All of them see only the past and present capacity (:class:`~.engine.View`); ``omniscient`` is not a
policy but a bound computed from the future trace (:mod:`.omniscient`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import replace

from airflow_deadline_batch.core.calibration import AvailabilityEstimate, SpellAges, SpotTries
from airflow_deadline_batch.core.placement import (
    JobSnapshot,
    PolicyParams,
    SpotOption,
    choose_pool,
    should_speculate,
)
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.sim.engine import (
    Choice,
    Mode,
    Policy,
    SimConfig,
    SlotView,
    Speculate,
    SpotIn,
    View,
)
from airflow_deadline_batch.sim.traces import Trace

EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)


def _safety_net_due(view: View, changeovers: float) -> bool:
    """Tick-aligned safety net: waiting one more tick could leave too little time for on-demand.

    The on-demand need counts ``changeovers`` restarts and the list-scheduling imbalance of shards
    over several workers; decisions happen on ticks, hence the one-tick look-ahead.
    """
    cfg = view.config
    n = cfg.workers
    need = changeovers * cfg.changeover_h + view.remaining_h / n + cfg.shard_size_h * (n - 1) / n
    return view.time_left_h - view.gap_h < need - 1e-9


def cost_excess_h(view: View) -> float:
    """What the job has spent beyond on-demand's price of the work it keeps (``JobSnapshot.cost_excess_s``,
    in hours; core.placement.cost_room_s). On-demand only pays one changeover per worker, so a
    worker that will not need a fresh on-demand start (idle, nothing left to pull) keeps its
    changeover as credit."""
    cfg = view.config
    od_slots = [s for s in view.slots if s.mode is Mode.ON_DEMAND]
    others = cfg.workers - len(od_slots)
    busy_elsewhere = sum(1 for s in view.slots if s.busy and s.mode is not Mode.ON_DEMAND)
    no_restart = others - min(others, view.pending_shards + busy_elsewhere)
    kept_h = (
        view.committed_shards * cfg.shard_size_h
        + sum(cfg.changeover_h - s.changeover_left_h + s.progress_h for s in od_slots)
        + no_restart * cfg.changeover_h
    )
    return view.cost - cfg.price_ratio * kept_h


class OnDemand:
    """On-demand only: every worker starts at once and never stops until the queue is empty."""

    name = "on_demand"

    def reset(self, config: SimConfig, gap_h: float) -> None:
        pass

    def decide(self, view: View) -> list[Mode]:
        return [Mode.ON_DEMAND] * len(view.slots)


class Greedy:
    """Spot whenever available, else wait; safety net: on-demand for good once time left equals
    remaining work plus a changeover (one tick ahead)."""

    name = "greedy"

    def reset(self, config: SimConfig, gap_h: float) -> None:
        self.on_demand_for_good = False

    def decide(self, view: View) -> list[Mode]:
        if self.on_demand_for_good or _safety_net_due(view, changeovers=1.0):
            self.on_demand_for_good = True
            return [Mode.ON_DEMAND] * len(view.slots)
        return [Mode.SPOT] * len(view.slots)


class UniformProgress:
    """*Can't Be Late*'s Uniform Progress with its hysteresis, per worker, as in the authors' code.

    With ``cp`` the committed progress and ``ep(t) = W·t/D`` the uniform line (rules of the paper,
    in the order of ``sky_spot``'s ``rc_cr_threshold``): take Spot whenever it is available and keep
    it until preempted; when ``cp < ep(t)`` and Spot is missing, on-demand; a worker on on-demand
    stays there while Spot is missing or ``cp < ep(t + 2d)`` (hysteresis); safety net: an idle or
    on-demand worker goes on-demand when the time left is under ``C(t) + 2d``, and every worker does
    at ``C(t) + d`` (the paper keeps a running Spot try there; here it would risk a redone shard).
    """

    name = "uniform_progress"

    def reset(self, config: SimConfig, gap_h: float) -> None:
        self.on_demand_for_good = False

    def decide(self, view: View) -> list[Mode]:
        cfg = view.config
        if self.on_demand_for_good or _safety_net_due(view, changeovers=1.0):
            self.on_demand_for_good = True
            return [Mode.ON_DEMAND] * len(view.slots)
        net = _safety_net_due(view, changeovers=2.0)
        cp = cfg.work_h - view.remaining_h

        def ep(t: float) -> float:
            return cfg.work_h * t / cfg.deadline_h

        behind = cp < ep(view.t_h)
        behind_ahead = cp < ep(view.t_h + 2 * cfg.changeover_h)
        free_spot = view.capacity - sum(1 for s in view.slots if s.mode is Mode.SPOT)
        modes: list[Mode] = []
        for slot in view.slots:
            has_spot = slot.mode is Mode.SPOT or free_spot > 0
            if slot.mode is Mode.SPOT:
                modes.append(Mode.SPOT)
                continue
            want = Mode.SPOT if has_spot else (Mode.ON_DEMAND if behind else Mode.NONE)
            if slot.mode is Mode.ON_DEMAND and (not has_spot or behind_ahead or net):
                want = Mode.ON_DEMAND
            if net and slot.mode is not Mode.SPOT:
                want = Mode.ON_DEMAND
            if want is Mode.SPOT:
                free_spot -= 1
            modes.append(want)
        return modes


class SlackAware:
    """The project's policy: :func:`core.placement.choose_pool` for every worker at every tick.

    With several Spot pools each pool's availability and spell length are learned from its own
    capacity, and ``choose_pool`` names the pool of every Spot decision (``SpotIn``). In the tail
    (``PolicyParams.race_tail``) a running Spot try the rule escalates may race an on-demand
    duplicate on an idle slot instead (``core.placement.should_speculate``); a racing pair is
    left as it is until one of them commits or is preempted.
    """

    name = "slack_aware"

    def __init__(
        self, params: PolicyParams | None = None, priors: Sequence[AvailabilityEstimate] = ()
    ) -> None:
        self.params = params or PolicyParams()
        #: each pool's estimate as earlier jobs left it (:func:`pool_priors`); empty: the default prior
        self.priors = tuple(priors)

    def reset(self, config: SimConfig, gap_h: float) -> None:
        self.deadline = EPOCH + dt.timedelta(hours=config.deadline_h)
        self.run_params = PolicyParams(**{**self.params.__dict__, "decision_interval_s": gap_h * 3600})
        fresh = AvailabilityEstimate(
            prior=self.params.availability_prior, ages=SpellAges() if self.params.spell_age else None
        )
        self.availability = self.priors[0] if self.priors else fresh
        self.pool_availability: list[AvailabilityEstimate] = list(self.priors) if len(self.priors) > 1 else []
        self.spot_tries = SpotTries()

    def _observe_pools(self, view: View) -> tuple[SpotOption, ...]:
        """Each pool's option before this tick's capacity is folded in (one pool: none)."""
        caps = view.capacities
        if not caps:
            return ()
        if not self.pool_availability:
            self.pool_availability = [self.availability] * len(caps)
        options = tuple(
            SpotOption(
                name=name,
                price=price,
                speed=speed,
                availability=est.value,
                mean_run_s=est.run_hours * 3600,
            )
            for name, price, speed, est in zip(
                view.pool_names, view.pool_prices, view.pool_speeds, self.pool_availability, strict=True
            )
        )
        self.pool_availability = [
            est.observe(cap, view.config.workers, view.gap_h)
            for est, cap in zip(self.pool_availability, caps, strict=True)
        ]
        return options

    def decide(self, view: View) -> list[Choice]:
        cfg = view.config
        now = EPOCH + dt.timedelta(hours=view.t_h)
        # The tick now starting is known to be (un)available, not yet observed for its length.
        availability = self.availability.value
        mean_run_s = self.availability.run_hours * 3600
        ages = self.availability.ages
        # the age factor of the spell this tick is in (Spot there or not), before the tick is folded
        there = view.capacity > 0
        age_factor = None if ages is None else ages.age_factor(there, self.params.spell_age_horizon_h)
        if age_factor is not None and self.params.spell_age_run and there:
            # the age rule scales the memoryless mean, not the mean raised to the spell's age
            mean_run_s = 3600.0 / self.availability.spell_end_rate
        self.availability = self.availability.observe(view.capacity, cfg.workers, view.gap_h)
        options = self._observe_pools(view)
        # the same storm input as the job view's (docs/design.md §5, Observed preemptions)
        for ended in view.ended_spot_tries:
            self.spot_tries = self.spot_tries.observe(
                ended_s=ended.ended_h * 3600,
                duration_s=ended.duration_h * 3600,
                preempted=ended.preempted,
                commits=ended.commits,
            )
        excess_s = cost_excess_h(view) * 3600
        fruitless_end = self.spot_tries.fruitless_end_s
        fruitless_age = None if fruitless_end is None else view.t_h * 3600 - fruitless_end
        on_spot = sum(1 for s in view.slots if s.mode is Mode.SPOT)
        starting = sum(1 for s in view.slots if s.mode is Mode.SPOT and s.changeover_left_h > 0)
        free = [
            cap - sum(1 for s in view.slots if s.mode is Mode.SPOT and s.pool == j)
            for j, cap in enumerate(view.pool_capacities)
        ]
        free_spot = free[0]
        on_demand = sum(1 for s in view.slots if s.mode is Mode.ON_DEMAND)
        modes: list[Choice] = []
        if view.pending_shards == 0 and not any(s.busy for s in view.slots):
            return [Mode.NONE] * len(view.slots)
        idle = []
        if self.params.race_tail and view.pending_shards == 0:
            idle = [i for i, s in enumerate(view.slots) if s.mode is Mode.NONE and not s.busy]
        races: dict[int, int] = {}
        for index, slot in enumerate(view.slots):
            running = slot.mode is not Mode.NONE
            if slot.twin is not None and running:  # a race runs until one of its tries commits
                modes.append(Mode.ON_DEMAND if slot.mode is Mode.ON_DEMAND else _spot(slot.pool, options))
                continue
            previous = None if slot.mode is Mode.NONE else PoolKind(slot.mode.value)
            others_on_demand = on_demand - (1 if slot.mode is Mode.ON_DEMAND else 0)
            others_on_spot = on_spot - (1 if slot.mode is Mode.SPOT else 0)
            free_spot = free[0]
            on_pool = slot.pool if slot.mode is Mode.SPOT else None
            pools = tuple(replace(o, available=on_pool == j or free[j] > 0) for j, o in enumerate(options))
            snapshot = JobSnapshot(
                now=now,
                deadline=self.deadline,
                remaining_work_s=view.remaining_h * 3600,
                shard_work_s=cfg.shard_size_h * 3600,
                parallelism=cfg.workers,
                changeover_s=cfg.changeover_h * 3600,
                spot_available=slot.mode is Mode.SPOT or free_spot > 0,
                previous_pool=previous,
                running=running,
                on_demand_workers=others_on_demand,
                spot_availability=availability,
                spot_mean_run_s=mean_run_s,
                started_at=EPOCH,
                total_work_s=cfg.work_h * 3600,
                running_progress_s=(
                    (cfg.changeover_h - slot.changeover_left_h + slot.progress_h) * 3600 if running else 0.0
                ),
                spot_fruitless_tries=self.spot_tries.fruitless,
                spot_fruitless_age_s=fruitless_age,
                spot_workers=others_on_spot,
                changeover_left_s=slot.changeover_left_h * 3600 if running else None,
                price_ratio=cfg.price_ratio,
                cost_excess_s=excess_s,
                total_shards=cfg.shards,
                spot_pools=pools,
                spot_pool=None if on_pool is None or not pools else pools[on_pool].name,
                tries_mean_run_s=self.spot_tries.mean_run_s,
                spot_workers_starting=min(
                    others_on_spot,
                    starting - (1 if slot.mode is Mode.SPOT and slot.changeover_left_h > 0 else 0),
                ),
                # the factor is the job's spell's: only for a worker that sees the same (partial
                # capacity taken by other workers is not an outage)
                spell_age_factor=age_factor if (slot.mode is Mode.SPOT or free_spot > 0) == there else None,
            )
            decision = choose_pool(snapshot, self.run_params)
            pool = decision.pool
            j = 0 if decision.spot_pool is None else view.pool_names.index(decision.spot_pool)
            if pool is PoolKind.SPOT and slot.mode is Mode.ON_DEMAND:
                # leaving on-demand throws its try away: the workers after this one see it
                excess_s += cfg.price_ratio * snapshot.running_progress_s
            if pool is PoolKind.SPOT and slot.mode is not Mode.SPOT and not decision.hold and free[j] > 0:
                starting += 1  # a fresh Spot try with capacity starts its changeover
            if (
                pool is PoolKind.ON_DEMAND
                and slot.mode is Mode.SPOT
                and idle
                and self._race(view, slot, options)
            ):
                races[idle.pop(0)] = index
                on_demand += 1
                modes.append(_spot(slot.pool, options))
                continue
            if decision.hold:  # the cost cap holds this worker idle until the next tick
                if on_pool is not None:
                    on_spot -= 1
                    free[on_pool] += 1
                modes.append(Mode.NONE)
                continue
            if pool is PoolKind.SPOT:
                if on_pool != j and free[j] > 0:
                    free[j] -= 1
                    if on_pool is None:
                        on_spot += 1
                    else:
                        free[on_pool] += 1
                modes.append(SpotIn(j) if options else Mode.SPOT)
            else:
                if slot.mode is not Mode.ON_DEMAND:
                    on_demand += 1
                if slot.mode is Mode.SPOT:
                    on_spot -= 1
                modes.append(Mode.ON_DEMAND)
        for duplicate, original in races.items():
            modes[duplicate] = Speculate(original, Mode.ON_DEMAND)
        return modes

    def _race(self, view: View, slot: SlotView, options: tuple[SpotOption, ...]) -> bool:
        """Whether this running Spot try should race an on-demand duplicate rather than stop."""
        cfg = view.config
        option = options[slot.pool] if options else None
        speed = option.speed if option is not None else 1.0
        price = option.price if option is not None else 1.0
        run_s = option.mean_run_s if option is not None else self.availability.run_hours * 3600
        remaining_h = slot.changeover_left_h + (cfg.shard_size_h - slot.progress_h) / speed
        return should_speculate(
            remaining_s=remaining_h * 3600,
            price=price,
            mean_run_s=run_s,
            duplicate_s=(cfg.changeover_h + cfg.shard_size_h) * 3600,
            duplicate_price=cfg.price_ratio,
        )


def _spot(pool: int, options: tuple[SpotOption, ...]) -> Choice:
    return SpotIn(pool) if options else Mode.SPOT


POLICIES: dict[str, type] = {
    "on_demand": OnDemand,
    "greedy": Greedy,
    "uniform_progress": UniformProgress,
    "slack_aware": SlackAware,
}
#: every name ``--policy`` accepts (``omniscient`` is the offline bound)
POLICY_NAMES = ("on_demand", "greedy", "uniform_progress", "omniscient", "slack_aware")
#: research policies ``make_policy`` also builds (not in ``all``: docs/simulator.md, *Fourth round*)
RESEARCH_POLICIES = ("mdp",)


#: hours of a pool's capacity before a job's start that earlier jobs saw and persisted (the
#: simulator's counterpart of ``store.pool_stats``' history; 0: every job starts from the prior)
HISTORY_HOURS = 48.0


def pool_priors(
    traces: Sequence[Trace],
    start_tick: int,
    workers: int,
    *,
    hours: float = HISTORY_HOURS,
    params: PolicyParams | None = None,
) -> tuple[AvailabilityEstimate, ...]:
    """Each pool's availability and spell estimate after the ``hours`` of its trace before the start.

    What a job inherits from earlier jobs on the same pools (docs/simulator.md, *Persisted prior*):
    the capacity they saw, folded into the estimate the job then keeps learning from. Only ticks
    before the start are read (none before the trace's first), so no future is seen.
    """
    prior = (params or PolicyParams()).availability_prior
    out = []
    for trace in traces:
        gap_h = trace.gap_s / 3600.0
        first = max(0, start_tick - round(hours / gap_h))
        estimate = AvailabilityEstimate(
            prior=prior, ages=SpellAges() if params is not None and params.spell_age else None
        )
        for tick in range(first, start_tick):
            estimate = estimate.observe(trace.at(tick), workers, gap_h)
        out.append(estimate)
    return tuple(out)


def slack_aware_at(
    traces: Sequence[Trace],
    start_tick: int,
    workers: int,
    params: PolicyParams | None = None,
    *,
    hours: float = HISTORY_HOURS,
) -> SlackAware:
    """``slack_aware`` for a job starting at ``start_tick``, with the pools' persisted priors."""
    return SlackAware(params, pool_priors(traces, start_tick, workers, hours=hours, params=params))


def make_policy(name: str) -> Policy:
    if name == "mdp":  # imported here: sim.mdp builds on SlackAware from this module
        from airflow_deadline_batch.sim.mdp import MarkovDecision

        return MarkovDecision()
    policy: Policy = POLICIES[name]()
    return policy
