"""Discrete-time simulator of one batch job on Spot and on-demand workers.

The job is ``W`` GPU-hours cut into equal shards of at most ``S`` hours, pulled from one queue by up
to ``N`` workers (slots). Each tick of the trace a policy chooses, for every slot, Spot, on-demand or
nothing; the simulator grants Spot up to the tick's capacity, charges a changeover ``d`` on every
(re)start, and advances work exactly inside the tick (a shard commits the instant it completes).
A preemption (capacity dropping under the slots on Spot) or a voluntary switch destroys the
uncommitted part of the running shard. Cost is Σ price × time: Spot 1, on-demand ``k``.
A job not done at its deadline is finished on on-demand (counted as a miss).

Several Spot pools (:func:`simulate_pools`): one trace per pool, each with its price (relative to
the reference Spot price) and speed (throughput relative to the reference rate the work is counted
in); a policy then names a pool per Spot slot (:class:`SpotIn`), each pool preempts its own slots.

The tail race (:class:`Speculate`): with no shard left to pull, an idle slot may run a duplicate
of another slot's shard; whichever commits first wins, the other try is cancelled (its progress
counted as redone), and both are billed for the time they ran.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from airflow_deadline_batch.sim.traces import Trace

EPS = 1e-9


class Mode(str, enum.Enum):
    """What a slot runs on during a tick."""

    NONE = "none"
    SPOT = "spot"
    ON_DEMAND = "on_demand"


@dataclass(frozen=True)
class SpotIn:
    """A policy's choice of Spot in one pool of a multi-pool run (``Mode.SPOT`` is pool 0)."""

    pool: int


@dataclass(frozen=True)
class Speculate:
    """A duplicate of slot ``of``'s shard on ``choice``'s pool, for an idle slot when no shard is left."""

    of: int
    choice: Mode | SpotIn


#: what a policy chooses for one slot
Choice = Mode | SpotIn | Speculate


@dataclass(frozen=True)
class SimPool:
    """One Spot pool: its capacity trace, price per GPU-hour over the reference Spot price, speed."""

    trace: Trace
    price: float = 1.0
    speed: float = 1.0

    def __post_init__(self) -> None:
        if not (self.price > 0 and self.speed > 0):
            raise ValueError(f"pool {self.trace.name!r}: price and speed must be > 0")

    @property
    def name(self) -> str:
        return self.trace.name


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One job: ``work_h`` GPU-hours, deadline ``deadline_h`` after the start, and the cost model."""

    work_h: float
    deadline_h: float
    workers: int = 1
    changeover_h: float = 0.1
    price_ratio: float = 3.0
    shard_h: float = 0.25

    def __post_init__(self) -> None:
        if self.work_h <= 0 or self.deadline_h <= 0:
            raise ValueError("work and deadline must be > 0 hours")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.changeover_h < 0 or self.shard_h <= 0 or self.price_ratio < 1:
            raise ValueError("changeover must be >= 0, shard > 0 and price ratio >= 1")

    @property
    def shards(self) -> int:
        return max(1, math.ceil(self.work_h / self.shard_h - EPS))

    @property
    def shard_size_h(self) -> float:
        return self.work_h / self.shards

    def on_demand_feasible(self) -> bool:
        """Whether on-demand only, started now, meets the deadline (list scheduling, exact)."""
        return on_demand_makespan(self) <= self.deadline_h + EPS


def on_demand_makespan(cfg: SimConfig) -> float:
    """Finish time of on-demand only: every slot starts at once and pulls equal shards."""
    slots = min(cfg.workers, cfg.shards)
    per_slot = math.ceil(cfg.shards / slots)
    return cfg.changeover_h + per_slot * cfg.shard_size_h


@dataclass(frozen=True)
class SlotView:
    mode: Mode
    changeover_left_h: float
    progress_h: float  # uncommitted work done on the current shard (reference hours)
    busy: bool  # holds a shard
    pool: int = 0  # the Spot pool of a slot on Spot
    twin: int | None = None  # the slot racing this one on the same shard (Speculate)


@dataclass(frozen=True)
class EndedSpotTry:
    """A Spot try that ended since the previous decision: how long, why, and what it committed."""

    slot: int
    ended_h: float
    duration_h: float
    preempted: bool
    commits: int
    pool: int = 0


@dataclass(frozen=True)
class View:
    """What a policy sees at a tick boundary (the future capacity is not in it)."""

    config: SimConfig
    tick: int
    t_h: float
    gap_h: float
    capacity: int
    remaining_h: float  # work not yet committed
    committed_shards: int
    pending_shards: int
    slots: tuple[SlotView, ...]
    history: Sequence[int]  # capacity of ticks 0..tick (this tick included)
    #: Spot tries ended since the previous decision (preemptions of this tick included)
    ended_spot_tries: tuple[EndedSpotTry, ...] = ()
    #: what the job has cost so far (Spot-GPU-hours: Spot 1, on-demand ``price_ratio``)
    cost: float = 0.0
    #: capacity of every Spot pool this tick (``capacity`` is pool 0's), and their names, prices
    #: and speeds (one pool: empty)
    capacities: tuple[int, ...] = ()
    pool_names: tuple[str, ...] = ()
    pool_prices: tuple[float, ...] = ()
    pool_speeds: tuple[float, ...] = ()

    @property
    def pool_capacities(self) -> tuple[int, ...]:
        return self.capacities or (self.capacity,)

    @property
    def time_left_h(self) -> float:
        return self.config.deadline_h - self.t_h


class Policy(Protocol):
    name: str

    def reset(self, config: SimConfig, gap_h: float) -> None: ...

    def decide(self, view: View) -> Sequence[Choice]: ...


@dataclass
class RunResult:
    """Outcome of one (trace, start, policy) run."""

    policy: str
    start_tick: int
    cost: float = 0.0
    spot_hours: float = 0.0
    on_demand_hours: float = 0.0
    preemptions: int = 0
    redone_hours: float = 0.0
    starts: int = 0
    changeover_hours: float = 0.0
    finish_h: float = 0.0
    missed: bool = False
    work_done_h: float = 0.0
    #: (time h, committed work h) after each tick, and (time h, slot, mode) at each switch
    progress: list[tuple[float, float]] = field(default_factory=list)
    switches: list[tuple[float, int, str]] = field(default_factory=list)
    #: duplicates started (:class:`Speculate`), races the original try won, and what the cancelled
    #: tries of finished races had cost (included in ``cost``)
    races: int = 0
    races_won_by_original: int = 0
    race_loser_cost: float = 0.0


@dataclass
class _Slot:
    mode: Mode = Mode.NONE
    co_left: float = 0.0
    progress: float = 0.0
    busy: bool = False
    started_at_tick: int = 0
    started_h: float = 0.0
    commits: int = 0
    pool: int = 0
    twin: int | None = None
    duplicate: bool = False
    try_cost: float = 0.0


def simulate(
    trace: Trace,
    start_tick: int,
    config: SimConfig,
    policy: Policy,
    *,
    record: bool = False,
    max_ticks: int | None = None,
) -> RunResult:
    """Run ``policy`` on ``trace`` from ``start_tick``; exact accounting (see the module docstring)."""
    return simulate_pools([SimPool(trace)], start_tick, config, policy, record=record, max_ticks=max_ticks)


def simulate_pools(
    pools: Sequence[SimPool],
    start_tick: int,
    config: SimConfig,
    policy: Policy,
    *,
    record: bool = False,
    max_ticks: int | None = None,
) -> RunResult:
    """Run ``policy`` on several Spot pools (traces of one tick length) from ``start_tick``."""
    if not pools:
        raise ValueError("at least one Spot pool is needed")
    if len({p.trace.gap_s for p in pools}) != 1:
        raise ValueError("the pools' traces must share one tick length (gap_s)")
    multi = len(pools) > 1
    gap = pools[0].trace.gap_s / 3600.0
    size = config.shard_size_h
    k = config.price_ratio
    policy.reset(config, gap)

    def speed(slot: _Slot) -> float:
        return pools[slot.pool].speed if slot.mode is Mode.SPOT else 1.0

    slots = [_Slot() for _ in range(config.workers)]
    pending = config.shards
    committed = 0
    result = RunResult(policy=policy.name, start_tick=start_tick)
    history: list[int] = []
    limit = max_ticks or (math.ceil((config.deadline_h + on_demand_makespan(config)) / gap) + 2)
    tick = 0
    t = 0.0
    forced = False
    ended: list[EndedSpotTry] = []

    def end_spot_try(i: int, slot: _Slot, when: float, preempted: bool) -> None:
        if slot.mode is Mode.SPOT:
            ended.append(EndedSpotTry(i, when, when - slot.started_h, preempted, slot.commits, slot.pool))

    def stop(i: int, slot: _Slot, when: float, preempted: bool = False) -> None:
        nonlocal pending
        end_spot_try(i, slot, when, preempted)
        if slot.busy:
            result.redone_hours += slot.progress
            if slot.twin is None:
                pending += 1
            else:  # the twin holds the shard alone now
                slots[slot.twin].twin = None
        slot.busy, slot.progress, slot.co_left, slot.mode = False, 0.0, 0.0, Mode.NONE
        slot.twin, slot.duplicate = None, False
        if record:
            result.switches.append((when, i, Mode.NONE.value))

    while committed < config.shards:
        if tick >= limit:
            raise RuntimeError(f"policy {policy.name} did not finish within {limit} ticks")
        caps = [p.trace.at(start_tick + tick) for p in pools]
        cap = caps[0]
        history.append(cap)
        # 1. preemptions: capacity fell under the slots on Spot (the latest started lose first)
        for j, pool_cap in enumerate(caps):
            on_spot = [i for i, s in enumerate(slots) if s.mode is Mode.SPOT and s.pool == j]
            if len(on_spot) > pool_cap:
                victims = sorted(on_spot, key=lambda i: (slots[i].started_at_tick, i))[pool_cap:]
                for i in victims:
                    result.preemptions += 1
                    stop(i, slots[i], t, preempted=True)
        # 2. decisions (after the deadline a missed job finishes on on-demand)
        if not forced and t >= config.deadline_h - EPS:
            forced = True
        view = View(
            config=config,
            tick=tick,
            t_h=t,
            gap_h=gap,
            capacity=cap,
            remaining_h=(config.shards - committed) * size,
            committed_shards=committed,
            pending_shards=pending,
            slots=tuple(SlotView(s.mode, s.co_left, s.progress, s.busy, s.pool, s.twin) for s in slots),
            history=history,
            ended_spot_tries=tuple(ended),
            cost=result.cost,
            capacities=tuple(caps) if multi else (),
            pool_names=tuple(p.name for p in pools) if multi else (),
            pool_prices=tuple(p.price for p in pools) if multi else (),
            pool_speeds=tuple(p.speed for p in pools) if multi else (),
        )
        ended.clear()
        choices = [Mode.ON_DEMAND] * len(slots) if forced else list(policy.decide(view))
        wanted = [_mode(c) for c in choices]
        want_pool = [_pool(c) for c in choices]
        # 3. apply: keep what continues, stop what changes, then start (Spot up to capacity)
        for i, slot in enumerate(slots):
            moves = slot.mode is Mode.SPOT and wanted[i] is Mode.SPOT and slot.pool != want_pool[i]
            if slot.mode is not Mode.NONE and (slot.mode is not wanted[i] or moves):
                stop(i, slot, t)
        spot_used = [sum(1 for s in slots if s.mode is Mode.SPOT and s.pool == j) for j in range(len(pools))]
        for i, (slot, want) in enumerate(zip(slots, wanted, strict=True)):
            choice = choices[i]
            race = choice if isinstance(choice, Speculate) else None
            if race is not None and not _can_race(slots, i, race.of, pending):
                continue
            if slot.mode is not Mode.NONE or want is Mode.NONE or (pending == 0 and race is None):
                continue
            if want is Mode.SPOT:
                j = want_pool[i]
                if spot_used[j] >= caps[j]:
                    continue
                spot_used[j] += 1
                slot.pool = j
            slot.mode, slot.co_left, slot.busy, slot.progress = want, config.changeover_h, True, 0.0
            slot.started_at_tick = tick
            slot.started_h, slot.commits, slot.try_cost = t, 0, 0.0
            if race is None:
                pending -= 1
            else:
                slot.twin, slot.duplicate, slots[race.of].twin = race.of, True, i
                result.races += 1
            result.starts += 1
            if record:
                result.switches.append((t, i, want.value))
        # 4. advance the running slots through the tick in lockstep, event by event, so that
        #    shards leave the queue in time order (a fast slot cannot take a shard "early")
        used = 0.0
        while used < gap - EPS:
            running = [s for s in slots if s.mode is not Mode.NONE]
            if not running:
                break
            step = min(
                [gap - used]
                + [s.co_left if s.co_left > 0 else (size - s.progress) / speed(s) for s in running]
            )
            step = max(step, 0.0)
            for slot in running:  # every running try pays the step, a race's loser included
                price = k if slot.mode is Mode.ON_DEMAND else pools[slot.pool].price
                _bill(result, slot.mode, step, price)
                slot.try_cost += price * step
            for i, slot in enumerate(slots):
                if slot.mode is Mode.NONE:
                    continue
                if slot.co_left > 0:
                    slot.co_left -= step
                    result.changeover_hours += step
                    if slot.co_left <= EPS:
                        slot.co_left = 0.0
                    continue
                slot.progress += step * speed(slot)
                if slot.progress < size - EPS:
                    continue
                if slot.twin is not None:  # a race: the twin loses and is cancelled
                    j, loser = slot.twin, slots[slot.twin]
                    result.races_won_by_original += not slot.duplicate
                    result.race_loser_cost += loser.try_cost
                    result.redone_hours += loser.progress
                    loser.twin, loser.busy, slot.twin, slot.duplicate = None, False, None, False
                    stop(j, loser, t + used + step)
                committed += 1
                slot.commits += 1
                result.work_done_h += size
                slot.progress = 0.0
                if committed == config.shards:
                    result.finish_h = t + used + step
                if pending > 0:
                    pending -= 1
                else:
                    end_spot_try(i, slot, t + used + step, preempted=False)
                    slot.busy = False
                    slot.mode = Mode.NONE
                    if record:
                        result.switches.append((t + used + step, i, Mode.NONE.value))
            used += step
        t += gap
        tick += 1
        if record:
            result.progress.append(
                (min(t, result.finish_h) if committed == config.shards else t, committed * size)
            )
    result.missed = result.finish_h > config.deadline_h + EPS
    return result


def _mode(choice: Choice) -> Mode:
    if isinstance(choice, Speculate):
        return _mode(choice.choice)
    return Mode.SPOT if isinstance(choice, SpotIn) else choice


def _pool(choice: Choice) -> int:
    if isinstance(choice, Speculate):
        return _pool(choice.choice)
    return choice.pool if isinstance(choice, SpotIn) else 0


def _can_race(slots: Sequence[_Slot], i: int, of: int, pending: int) -> bool:
    """A duplicate needs an idle slot, no shard left to pull, and a lone running try to race."""
    if pending > 0 or i == of or not 0 <= of < len(slots) or slots[i].mode is not Mode.NONE:
        return False
    target = slots[of]
    return target.busy and target.mode is not Mode.NONE and target.twin is None


def _bill(result: RunResult, mode: Mode, hours: float, price: float) -> None:
    if mode is Mode.SPOT:
        result.spot_hours += hours
    elif mode is Mode.ON_DEMAND:
        result.on_demand_hours += hours
    result.cost += price * hours
