"""``mdp``: wait / Spot / on-demand chosen by backward induction over a Markov model of Spot.

Research policy for issue 13 (docs/simulator.md, *Fourth round*). Each worker models its Spot
availability as a continuous-time two-state Markov chain (there / missing) whose rates come from
the same online estimate ``slack_aware`` learns (``core.calibration.AvailabilityEstimate``, with
its prior and the persisted history): a spell ends at rate ``μ = 1 / run_hours`` and, with the
availability ``a``, returns at rate ``λ = μ · a / (1 − a)``. The expected cost-to-go
``V[t, s, m, r, p]`` over (steps left ``t``, Spot there ``s``, running try ``m``: none / Spot /
on-demand, committed shards left ``r``, the try's progress ``p`` in its shard, negative while its
changeover runs) is solved by backward induction over steps of one tick (several when the
deadline is more than ``MAX_STEPS`` ticks away), in time units that divide the shard:

* waiting costs nothing; a try pays its changeover on every (re)start, Spot 1 and on-demand
  ``k`` per hour, and only until the job's last shard commits;
* a Spot try whose capacity is gone at the next step is preempted, and a stopped try (to wait
  or to switch) loses its uncommitted progress, exactly as in the engine;
* waiting or Spot only where on-demand from the next step still fits, counted as the fallback
  rule counts it (``od_need_s``); a state unfinished at the deadline costs a large penalty.

The deadline is enforced outside the table by the very rule ``slack_aware`` uses
(``core.placement``: ``slack = time left − od_need_s``; Spot or waiting only while
``slack ≥ spot_risk_s``), so the no-miss argument of docs/simulator.md carries over unchanged:
the table only chooses among the options the rule leaves.

``N > 1``: the workers act independently on one shared table, solved for one worker with the
job's shards per worker (list-scheduled); a worker's Spot "there" means a free Spot GPU for it,
and the estimate's availability is the share of the workers Spot could hold. One Spot pool (pool
0 of a multi-pool run). A job solves a new table only when the learned rates, rounded to
``resolve_change``, reach values it has no table for.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from airflow_deadline_batch.core.calibration import AvailabilityEstimate
from airflow_deadline_batch.core.placement import (
    JobSnapshot,
    PolicyParams,
    choose_pool,
    cost_room_s,
    in_storm,
    od_need_s,
    spot_cost_ratio,
    spot_risk_s,
    spot_waste_s,
)
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.sim.engine import Choice, Mode, SimConfig, SlotView, View
from airflow_deadline_batch.sim.policies import EPOCH, SlackAware, cost_excess_h

#: the running try's mode in the table's state, and the actions (IDLE = wait)
IDLE, SPOT, OD = 0, 1, 2
#: what waiting a step costs on top of nothing: a tie goes to the choice that makes progress
TIE = 1e-6
#: the most time steps and committed-shard levels of one table (a solve costs ∝ their product)
MAX_STEPS = 400
MAX_SHARDS = 200


@dataclass(frozen=True)
class Grid:
    """The table's step, its shard (a multiple of the job's when a worker has more than
    ``MAX_SHARDS``), its time unit (a fraction of the shard) and its sizes, fixed per job."""

    step_h: float
    shard_h: float
    unit_h: float
    per_step: int  # units of a step
    shard_units: int
    changeover_units: int
    steps: int
    shards: int  # committed-shard levels of one worker, 0 included: shards + 1 rows
    merge: int  # job shards per table shard

    @classmethod
    def for_job(cls, config: SimConfig, gap_h: float) -> Grid:
        ticks = max(1, math.ceil(config.deadline_h / gap_h - 1e-9))
        step = gap_h * max(1, math.ceil(ticks / MAX_STEPS))
        per_worker = math.ceil(config.shards / config.workers)
        merge = max(1, math.ceil(per_worker / MAX_SHARDS))
        shard = config.shard_size_h * merge

        def misfit(length: float, k: int) -> float:
            x = length * k / shard
            return abs(x - max(1, round(x))) / max(x, 1.0)

        # the unit: the whole fraction of the shard that fits the step and the changeover best
        split = min(
            range(1, 13),
            key=lambda k: (round(misfit(step, k) + misfit(config.changeover_h, k), 2), k),
        )
        unit = shard / split
        return cls(
            step_h=step,
            shard_h=shard,
            unit_h=unit,
            per_step=max(1, round(step / unit)),
            shard_units=split,
            changeover_units=round(config.changeover_h / unit),
            steps=math.ceil(config.deadline_h / step - 1e-9),
            shards=math.ceil(per_worker / merge),
            merge=merge,
        )

    def shards_left(self, remaining_h: float, config: SimConfig) -> int:
        """A worker's committed-shard level: the job's shards left, list-scheduled, merged."""
        left = round(remaining_h / config.shard_size_h)
        return min(self.shards, math.ceil(math.ceil(left / config.workers) / self.merge))


@dataclass(frozen=True)
class Rates:
    """The two-state chain of one worker's Spot: spells end at ``end_rate`` and return at
    ``return_rate`` per hour; over a step, P(there next | missing / there now)."""

    end_rate: float
    return_rate: float
    down_up: float
    up_up: float

    @classmethod
    def of(cls, end_rate: float, return_rate: float, step_h: float) -> Rates:
        decay = math.exp(-(end_rate + return_rate) * step_h)
        share = return_rate / (end_rate + return_rate)
        return cls(end_rate, return_rate, share * (1.0 - decay), share + (1.0 - share) * decay)

    @staticmethod
    def key(availability: float, run_h: float, change: float) -> tuple[int, int]:
        """The learned estimate's rates, each rounded to a relative ``change`` (log scale)."""
        a = min(max(availability, 0.01), 0.99)
        end = 1.0 / max(run_h, 1e-3)
        step = math.log1p(change)
        return round(math.log(end) / step), round(math.log(end * a / (1.0 - a)) / step)

    @classmethod
    def at(cls, key: tuple[int, int], change: float, step_h: float) -> Rates:
        step = math.log1p(change)
        return cls.of(math.exp(key[0] * step), math.exp(key[1] * step), step_h)


class Table:
    """``V[t]``: the expected cost-to-go with ``t`` steps left, by backward induction.

    State: Spot there ``s``, committed shards left ``r`` (one worker's, list-scheduled) and, for a
    running try, its progress in the current shard ``p`` (negative while its changeover runs), so
    that a preemption or a stop loses exactly the uncommitted part, as in the engine.
    """

    def __init__(
        self,
        grid: Grid,
        config: SimConfig,
        rates: Rates,
        steps: int,
        *,
        credit_commits: bool = False,
        waste_price: float = 0.0,
    ) -> None:
        self.rates = rates
        self.p_up = np.array([rates.down_up, rates.up_up])
        self._setup(grid, config, credit_commits, waste_price)
        self.idle, self.running = self._induct(config, steps, 2)

    def _setup(self, grid: Grid, config: SimConfig, credit_commits: bool, waste_price: float) -> None:
        """The job's geometry on the grid: where a step takes each (shards left, progress) state."""
        self.grid, self.k = grid, config.price_ratio
        #: the risk term: every hour a stop or a preemption throws away (the try's changeover done
        #: and its uncommitted progress, at its price) costs this much more (0: expected cost only)
        self.waste_price = waste_price
        c, size, per = grid.changeover_units, grid.shard_units, grid.per_step
        width = c + size
        r = np.arange(grid.shards + 1)[:, None]
        p = np.arange(width)[None, :] - c
        after = p + per
        commits = np.where(after >= 0, after // size, 0)
        left_units = r * size - p  # units still to run (changeover left included)
        self.done = left_units <= per
        self.done_h = left_units * grid.unit_h
        self.done_od = self.k * self.done_h
        r_next = np.clip(r - commits, 0, grid.shards)
        j_next = np.clip(after - commits * size + c, 0, width - 1)
        self.next_flat = r_next * width + j_next
        # what a try throws away if stopped now ``[j]``, or preempted at the next step ``[r, j]``
        self.lost_h = np.arange(width) * grid.unit_h
        self.lost_next_h = j_next[0] * grid.unit_h
        self.next_r = r_next
        # the shards left that decide whether Spot is safe: now, or (``credit_commits``, exact) after
        # the step's commits, which a try preempted at the next step keeps (-1: it finishes)
        self.spot_r = np.where(self.done, -1, r_next) if credit_commits else np.broadcast_to(r, r_next.shape)
        self.width = width
        # waiting or Spot only while on-demand from the next step still fits, counted as the
        # fallback rule counts it (``od_need_s``: changeover, work per worker, list imbalance)
        n = config.workers
        imbalance = config.shard_size_h * (n - 1) / n
        self.safe_h = config.changeover_h + np.arange(grid.shards + 1) * grid.shard_h + imbalance

    def _induct(self, config: SimConfig, steps: int, states: int) -> tuple[np.ndarray, np.ndarray]:
        """Backward induction over ``steps`` layers of ``states`` Spot states (unfinished at the
        deadline: the large penalty plus on-demand for the rest)."""
        grid = self.grid
        big = 10.0 * self.k * (config.deadline_h + config.changeover_h)
        idle = np.empty((steps + 1, states, grid.shards + 1))
        idle[0] = big + self.k * self.safe_h
        idle[0][:, 0] = 0.0
        running = np.empty((steps + 1, 2, states, grid.shards + 1, self.width))
        running[0] = idle[0][None, :, :, None]
        for t in range(1, steps + 1):
            idle[t], running[t] = self.layer(idle[t - 1], running[t - 1], t)
        return idle, running

    def layer(self, nxt_idle: np.ndarray, nxt_running: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """One step of backward induction: the values with ``t`` steps left, idle ``[s, r]`` and
        running ``[mode, s, r, j]`` (mode 0 Spot, 1 on-demand; ``j``: progress in the shard plus
        the changeover, in units). Waiting and Spot are admitted for ``r`` below ``unsafe``."""
        step, k, p_up, p1 = self.grid.step_h, self.k, self.p_up[:, None], self.rates.up_up
        unsafe = int(np.searchsorted(self.safe_h, (t - 1) * step + 1e-9, side="right"))
        wait = p_up * nxt_idle[1] + (1 - p_up) * nxt_idle[0] + TIE  # [s, r]
        wait[:, unsafe:] = np.inf
        od_next = nxt_running[1].reshape(2, -1)
        od = (p_up * od_next[1] + (1 - p_up) * od_next[0])[:, self.next_flat]  # [s, r, j]
        od += k * step
        np.copyto(od, self.done_od, where=self.done)
        spot = p1 * nxt_running[0, 1].reshape(-1)[self.next_flat] + (1 - p1) * nxt_idle[0][self.next_r]
        spot += step
        w = self.waste_price
        if w:
            spot += (1 - p1) * w * self.lost_next_h
        np.copyto(spot, self.done_h, where=self.done)
        spot[self.spot_r >= unsafe] = np.inf  # [r, j], Spot there only
        idle = np.minimum(wait, od[:, :, 0])
        np.minimum(idle[1], spot[:, 0], out=idle[1])
        running = np.empty((2,) + od.shape)
        stop = wait[:, :, None]
        np.minimum(stop, od[:, :, :1], out=running[0])  # a Spot try: stop, or on-demand instead
        if w:
            running[0] += w * self.lost_h
        np.minimum(running[0, 1], spot, out=running[0, 1])  # ... or keep it (Spot there)
        if w:
            np.minimum(stop + w * k * self.lost_h, od, out=running[1])  # an on-demand try: stop, or keep it
            np.minimum(running[1, 1], spot[:, :1] + w * k * self.lost_h, out=running[1, 1])  # ... or Spot
        else:
            np.minimum(stop, od, out=running[1])  # an on-demand try: stop, or keep it
            np.minimum(running[1, 1], spot[:, :1], out=running[1, 1])  # ... or start Spot
        idle[:, 0] = 0.0
        running[:, :, 0, :] = 0.0
        return idle, running

    def action(self, t: int, s: int, m: int, r: int, j: int, *, spot_ok: bool = True) -> int:
        """The best action (IDLE = wait, SPOT, OD) with ``t`` steps left at one state: the same
        choice as :meth:`layer`, for that state alone; without ``spot_ok`` only waiting or on-demand
        (a guard in front of the table took Spot off)."""
        values = self.values(t, s, m, r, j, spot_ok=spot_ok)
        return min(range(3), key=values.__getitem__)

    def values(self, t: int, s: int, m: int, r: int, j: int, *, spot_ok: bool = True) -> tuple[float, ...]:
        """The expected cost-to-go of waiting, Spot and on-demand at one state (risk term included)."""
        t = min(t, len(self.idle) - 1)
        if t < 1 or r < 1:
            return (math.inf, math.inf, 0.0)
        nxt_idle, nxt_run = self.idle[t - 1], self.running[t - 1]
        step, p, p1 = self.grid.step_h, float(self.p_up[s]), self.rates.up_up
        safe = (t - 1) * step >= self.safe_h[r] - 1e-9
        wait = p * nxt_idle[1, r] + (1 - p) * nxt_idle[0, r] + TIE if safe else math.inf
        w = self.waste_price
        # the risk term: leaving the running try throws its changeover done and progress away
        lost = 0.0 if m == IDLE else w * (self.k if m == OD else 1.0) * float(self.lost_h[j])

        def on_demand(jj: int) -> float:
            if self.done[r, jj]:
                return float(self.k * self.done_h[r, jj])
            at = self.next_flat[r, jj]
            return float(self.k * step + p * nxt_run[1, 1].flat[at] + (1 - p) * nxt_run[1, 0].flat[at])

        def spot(jj: int) -> float:
            left = int(self.spot_r[r, jj])
            if s == 0 or not spot_ok or (left >= 0 and (t - 1) * step < self.safe_h[left] - 1e-9):
                return math.inf
            if self.done[r, jj]:
                return float(self.done_h[r, jj])
            at = self.next_flat[r, jj]
            preempted = nxt_idle[0, self.next_r[r, jj]] + w * self.lost_next_h[jj]
            return float(step + p1 * nxt_run[0, 1].flat[at] + (1 - p1) * preempted)

        return (
            wait + lost,
            spot(j) if m == SPOT else spot(0) + lost,
            on_demand(j) if m == OD else on_demand(0) + lost,
        )


def expm(matrix: np.ndarray) -> np.ndarray:
    """``e^A`` of a small matrix: Taylor series after scaling by ``2^-n``, squared back ``n`` times."""
    norm = float(np.abs(matrix).sum(axis=1).max())
    halvings = max(0, math.ceil(math.log2(norm / 0.25))) if norm > 0.25 else 0
    scaled = matrix / 2.0**halvings
    result = term = np.eye(len(matrix))
    for i in range(1, 20):
        term = term @ scaled / i
        result = result + term
    for _ in range(halvings):
        result = result @ result
    return result


class GeneratorChain:
    """A continuous-time Spot chain given by its rate matrix (:meth:`generator`): the step's
    transition and the long-run shares, the same for every chain (:class:`AgeRates`,
    :class:`RegimeRates`)."""

    def generator(self) -> np.ndarray:
        raise NotImplementedError

    def transition(self, step_h: float) -> np.ndarray:
        """P(state next step | state now), ``[z, z']``."""
        p = np.clip(expm(self.generator() * step_h), 0.0, None)
        return p / p.sum(axis=1, keepdims=True)

    def stationary(self) -> np.ndarray:
        """The chain's long-run share of each state."""
        g = self.generator()
        a = np.vstack([g.T, np.ones(len(g))])
        share = np.clip(np.linalg.lstsq(a, np.r_[np.zeros(len(g)), 1.0], rcond=None)[0], 0.0, None)
        return share / share.sum()


@dataclass(frozen=True)
class AgeRates(GeneratorChain):
    """Spot whose spells remember their age: a continuous-time chain over (Spot there ``s``, the
    spell's age phase ``b``), state ``z = s · B + b`` (docs/simulator.md, *Eighth round*).

    A spell of kind ``s`` in phase ``b`` ends at ``hazards[s][b]`` per hour (to phase 0 of the
    other kind) and moves on to phase ``b + 1`` at a rate chosen so that it outlasts the phase
    with the chance a hazard constant over the age bucket ``[edges_h[b], edges_h[b + 1])`` gives
    (``e^{−h·w}``); the last phase has no end. So the phase is the age bucket, but a spell's time in
    it is random (a Coxian spell, not the bucket's exact width): its hazard by age is the buckets'
    smoothed. ``hazards[0]``: absent spells (Spot returns), ``hazards[1]``: present (Spot ends).
    """

    hazards: tuple[tuple[float, ...], tuple[float, ...]]
    edges_h: tuple[float, ...]

    def __post_init__(self) -> None:
        b = len(self.edges_h)
        if any(len(h) != b for h in self.hazards) or b < 1:
            raise ValueError(f"AgeRates: one hazard per age bucket of each kind ({b} buckets)")
        if any(not (x > 0 and math.isfinite(x)) for h in self.hazards for x in h):
            raise ValueError("AgeRates: every hazard must be a finite rate > 0 per hour")

    @property
    def buckets(self) -> int:
        return len(self.edges_h)

    @property
    def up(self) -> np.ndarray:
        """Spot there in each state ``z`` (``z ≥ B``)."""
        return np.arange(2 * self.buckets) >= self.buckets

    def generator(self) -> np.ndarray:
        """The chain's rate matrix (rows sum to 0)."""
        b = self.buckets
        g = np.zeros((2 * b, 2 * b))
        for s in (0, 1):
            for i, h in enumerate(self.hazards[s]):
                z = s * b + i
                g[z, (1 - s) * b] += h
                if i + 1 < b:
                    width = self.edges_h[i + 1] - self.edges_h[i]
                    survive = math.exp(-h * width)
                    g[z, z + 1] += h * survive / (1.0 - survive)
                g[z, z] -= g[z].sum()
        return g


class SpotChain(Protocol):
    """What :class:`AgeTable` needs of its Spot chain: each state's Spot there, and the step's
    transition ``[z, z']`` (:class:`AgeRates`, :class:`RegimeRates`)."""

    @property
    def up(self) -> np.ndarray: ...

    def transition(self, step_h: float) -> np.ndarray: ...


@dataclass(frozen=True)
class RegimeRates(GeneratorChain):
    """Spot with regimes: ``R`` hidden regimes, each an :class:`AgeRates` (its own hazards by spell
    age, the same buckets), state ``z = ρ · 2B + s · B + b`` (docs/simulator.md, *Tenth round*).

    Within regime ``ρ`` a spell ages and ends as :class:`AgeRates` says; where Spot returns (an
    absent spell ends) the regime becomes ``ρ'`` with the chance ``switch[ρ][ρ']`` (the fitted chain
    over successive spells), and a present spell's end keeps it: a regime holds for a present spell
    and the absence after it, so long spells come in runs where one regime's spells are long. With
    one regime, or identical ones, it is the age chain.
    """

    regimes: tuple[AgeRates, ...]
    switch: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        r = len(self.regimes)
        if r < 1 or any(x.edges_h != self.regimes[0].edges_h for x in self.regimes):
            raise ValueError("RegimeRates: one AgeRates per regime, all with the same age buckets")
        if len(self.switch) != r or any(len(row) != r for row in self.switch):
            raise ValueError(f"RegimeRates: switch must be {r} x {r} (one row per regime)")
        if any(not (x >= 0) for row in self.switch for x in row) or any(
            abs(math.fsum(row) - 1.0) > 1e-9 for row in self.switch
        ):
            raise ValueError(
                "RegimeRates: each switch row is the next spell's regime's chances (>= 0, sum 1)"
            )

    @property
    def buckets(self) -> int:
        return self.regimes[0].buckets

    @property
    def up(self) -> np.ndarray:
        """Spot there in each state ``z``."""
        return np.tile(self.regimes[0].up, len(self.regimes))

    def generator(self) -> np.ndarray:
        """The chain's rate matrix: each regime's age chain, its absences' ends spread over the regimes."""
        n = 2 * self.buckets
        g = np.zeros((n * len(self.regimes),) * 2)
        for rho, regime in enumerate(self.regimes):
            block = regime.generator()
            for z in range(n):
                end = (1 - z // self.buckets) * self.buckets  # phase 0 of the other kind
                if z >= self.buckets:
                    continue  # a present spell ends in its regime
                rate = block[z, end]
                block[z, end] = 0.0
                for nxt, chance in enumerate(self.switch[rho]):
                    g[rho * n + z, nxt * n + end] += rate * chance
            g[rho * n : (rho + 1) * n, rho * n : (rho + 1) * n] += block
        return g


class AgeTable(Table):
    """:class:`Table` with the spell's age phase in the state: Spot state ``z`` of
    :class:`AgeRates` (``z // B``: there or not) in place of ``s``, one ``[z, z']`` transition per
    step; the same choices, constraint and penalty (no risk term). With one hazard for every phase
    of a kind it is the memoryless table (the phase is then irrelevant). Any :class:`SpotChain`
    will do for ``ages``: :class:`RegimeRates` gives the table with the regime in its state."""

    def __init__(
        self, grid: Grid, config: SimConfig, ages: SpotChain, steps: int, *, credit_commits: bool = False
    ) -> None:
        self.ages = ages
        self.p = ages.transition(grid.step_h)
        self.up = ages.up
        self._setup(grid, config, credit_commits, 0.0)
        self.idle, self.running = self._induct(config, steps, len(self.up))

    def layer(self, nxt_idle: np.ndarray, nxt_running: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`Table.layer` over the states ``z``: idle ``[z, r]``, running ``[mode, z, r, j]``."""
        step, k, p, up = self.grid.step_h, self.k, self.p, self.up
        states = len(up)
        unsafe = int(np.searchsorted(self.safe_h, (t - 1) * step + 1e-9, side="right"))
        wait = p @ nxt_idle + TIE  # [z, r]
        wait[:, unsafe:] = np.inf
        od = (p @ nxt_running[1].reshape(states, -1))[:, self.next_flat]  # [z, r, j]
        od += k * step
        np.copyto(od, self.done_od, where=self.done)
        # a Spot try goes on where Spot is there at the next step, else it is preempted (idle)
        spot = (p[:, up] @ nxt_running[0][up].reshape(up.sum(), -1))[:, self.next_flat]
        spot += (p[:, ~up] @ nxt_idle[~up])[:, self.next_r]
        spot += step
        np.copyto(spot, self.done_h, where=self.done)
        spot[~up] = np.inf
        spot[:, self.spot_r >= unsafe] = np.inf
        idle = np.minimum(np.minimum(wait, od[:, :, 0]), spot[:, :, 0])
        stop = wait[:, :, None]
        running = np.empty((2,) + od.shape)
        np.minimum(np.minimum(stop, od[:, :, :1]), spot, out=running[0])  # a Spot try: stop, OD or keep
        np.minimum(np.minimum(stop, od), spot[:, :, :1], out=running[1])  # on-demand: stop, keep or Spot
        idle[:, 0] = 0.0
        running[:, :, 0, :] = 0.0
        return idle, running

    def values(self, t: int, s: int, m: int, r: int, j: int, *, spot_ok: bool = True) -> tuple[float, ...]:
        """:meth:`Table.values` at Spot state ``s`` = ``z``."""
        t = min(t, len(self.idle) - 1)
        if t < 1 or r < 1:
            return (math.inf, math.inf, 0.0)
        nxt_idle, nxt_run = self.idle[t - 1], self.running[t - 1]
        step, p = self.grid.step_h, self.p[s]
        safe = (t - 1) * step >= self.safe_h[r] - 1e-9
        wait = float(p @ nxt_idle[:, r]) + TIE if safe else math.inf

        def on_demand(jj: int) -> float:
            if self.done[r, jj]:
                return float(self.k * self.done_h[r, jj])
            at = self.next_flat[r, jj]
            return float(self.k * step + p @ nxt_run[1].reshape(len(p), -1)[:, at])

        def spot(jj: int) -> float:
            left = int(self.spot_r[r, jj])
            if not self.up[s] or not spot_ok or (left >= 0 and (t - 1) * step < self.safe_h[left] - 1e-9):
                return math.inf
            if self.done[r, jj]:
                return float(self.done_h[r, jj])
            at = self.next_flat[r, jj]
            after = np.where(self.up, nxt_run[0].reshape(len(p), -1)[:, at], nxt_idle[:, self.next_r[r, jj]])
            return float(step + p @ after)

        return (wait, spot(j) if m == SPOT else spot(0), on_demand(j) if m == OD else on_demand(0))


class MarkovDecision(SlackAware):
    """``mdp``: the table's choice per worker above ``slack_aware``'s safety rule (module docstring).

    Variants for its dear tail (docs/simulator.md, *Fifth round b*), all off by default:
    ``PolicyParams.cost_cap`` runs slack_aware's cap rule after the safety rule (hold or
    on-demand when a Spot choice could waste more than the room left); ``guards`` runs
    slack_aware's storm backoff and expected-cost rule (``spot_cost_limit``) in front of the table
    (a storm sends fresh tries on-demand, a dear Spot try is taken off the table's choices);
    ``waste_price`` is the table's risk term (:class:`Table`), with ``waste_above`` only while the
    run has banked less than that fraction of on-demand only's cost (a coarse budget state);
    ``PolicyParams.return_doubling`` paces the moves from on-demand back to Spot as slack_aware's
    rule does.
    """

    name = "mdp"

    #: the learned rates (spell end, spell return) are rounded to this relative change for the
    #: table: a new table only when one of them moves by more
    resolve_change = 0.5
    #: ``False``: the table alone, only its own fallback constraint (docs/simulator.md, *Fifth round*)
    safety_rule = True

    def __init__(
        self,
        params: PolicyParams | None = None,
        priors: Sequence[AvailabilityEstimate] = (),
        *,
        guards: bool = False,
        waste_price: float = 0.0,
        waste_above: float | None = None,
    ) -> None:
        super().__init__(params, priors)
        if not waste_price >= 0 or math.isinf(waste_price):
            raise ValueError(f"waste_price must be a finite number >= 0 (e.g. 1.0), got {waste_price!r}")
        if waste_above is not None and not waste_above >= 0:
            raise ValueError(f"waste_above must be >= 0 (e.g. 0.02) or None, got {waste_above!r}")
        self.guards = guards
        self.waste_price = waste_price
        #: the risk term only while the job has saved less than this fraction of on-demand only's
        #: cost so far (its excess above ``-waste_above ×`` that cost); ``None``: always
        self.waste_above = waste_above

    def _waste_price(self, view: View, excess_s: float) -> float:
        """The risk term's price now: ``waste_price`` while the run is near on-demand's cost."""
        if self.waste_above is None or not self.waste_price:
            return self.waste_price
        cfg = view.config
        on_demand_s = cfg.price_ratio * (cfg.work_h + cfg.workers * cfg.changeover_h) * 3600
        return self.waste_price if excess_s >= -self.waste_above * on_demand_s else 0.0

    def reset(self, config: SimConfig, gap_h: float) -> None:
        super().reset(config, gap_h)
        self.grid = Grid.for_job(config, gap_h)
        #: tables solved for this job, by the rates rounded to ``resolve_change`` (a table solved
        #: earlier covers every later, shorter horizon)
        self.tables: dict[tuple[int, int, float], Table] = {}
        #: tables solved, decisions taken (one per tick, every worker), and seconds spent in both
        self.solves = 0
        self.solve_seconds = 0.0
        self.decisions = 0
        self.seconds = 0.0
        self.overrides = 0  # worker choices where the safety rule changed the table's action

    def _table(
        self,
        config: SimConfig,
        availability: float,
        run_h: float,
        time_left_h: float,
        *,
        waste_price: float = 0.0,
    ) -> Table:
        key = Rates.key(availability, run_h, self.resolve_change)
        table = self.tables.get((*key, waste_price))
        if table is None:
            steps = min(self.grid.steps, math.ceil(time_left_h / self.grid.step_h - 1e-9) + 1)
            rates = Rates.at(key, self.resolve_change, self.grid.step_h)
            began = time.perf_counter()
            table = Table(self.grid, config, rates, max(1, steps), waste_price=waste_price)
            self.tables[(*key, waste_price)] = table
            self.solve_seconds += time.perf_counter() - began
            self.solves += 1
        return table

    def decide(self, view: View) -> list[Choice]:
        began = time.perf_counter()
        try:
            return self._decide(view)
        finally:
            self.seconds += time.perf_counter() - began
            self.decisions += 1

    def _decide(self, view: View) -> list[Choice]:
        cfg = view.config
        availability = self.availability.value
        run_h = self.availability.run_hours
        self.availability = self.availability.observe(view.capacity, cfg.workers, view.gap_h)
        for ended in view.ended_spot_tries:  # the storm guard's input, as slack_aware folds it
            self.spot_tries = self.spot_tries.observe(
                ended_s=ended.ended_h * 3600,
                duration_s=ended.duration_h * 3600,
                preempted=ended.preempted,
                commits=ended.commits,
            )
        if view.pending_shards == 0 and not any(s.busy for s in view.slots):
            return [Mode.NONE] * len(view.slots)
        excess_s = cost_excess_h(view) * 3600
        table = self._table(
            cfg, availability, run_h, view.time_left_h, waste_price=self._waste_price(view, excess_s)
        )
        n = cfg.workers
        now = EPOCH + dt.timedelta(hours=view.t_h)
        free = view.capacity - sum(1 for s in view.slots if s.mode is Mode.SPOT)
        on_spot = sum(1 for s in view.slots if s.mode is Mode.SPOT)
        starting = sum(1 for s in view.slots if s.mode is Mode.SPOT and s.changeover_left_h > 0)
        fruitless_end = self.spot_tries.fruitless_end_s
        steps_left = round(view.time_left_h / self.grid.step_h)
        grid = self.grid
        shards = grid.shards_left(view.remaining_h, cfg)
        interval = self.run_params.decision_interval_s or 0.0
        modes: list[Choice] = []
        for slot in view.slots:
            running = slot.mode is not Mode.NONE
            has_spot = slot.mode is Mode.SPOT or free > 0
            snapshot = JobSnapshot(
                now=now,
                deadline=self.deadline,
                remaining_work_s=view.remaining_h * 3600,
                shard_work_s=cfg.shard_size_h * 3600,
                parallelism=n,
                changeover_s=cfg.changeover_h * 3600,
                spot_available=has_spot,
                previous_pool=None if not running else PoolKind(slot.mode.value),
                running=running,
                changeover_left_s=slot.changeover_left_h * 3600 if running else None,
                spot_availability=availability,
                spot_mean_run_s=run_h * 3600,
                started_at=EPOCH,
                total_work_s=cfg.work_h * 3600,
                running_progress_s=(
                    (cfg.changeover_h - slot.changeover_left_h + slot.progress_h) * 3600 if running else 0.0
                ),
                spot_fruitless_tries=self.spot_tries.fruitless,
                spot_fruitless_age_s=None if fruitless_end is None else view.t_h * 3600 - fruitless_end,
                spot_workers=on_spot - (1 if slot.mode is Mode.SPOT else 0),
                price_ratio=cfg.price_ratio,
                cost_excess_s=excess_s,
                total_shards=cfg.shards,
                spot_workers_starting=starting
                - (1 if slot.mode is Mode.SPOT and slot.changeover_left_h > 0 else 0),
            )
            slack_s = view.time_left_h * 3600 - od_need_s(snapshot)
            table_act = self._tabled(table, snapshot, slot, steps_left, shards)
            if slack_s < spot_risk_s(snapshot, self.run_params):
                act = OD  # the safety rule: slack no longer covers the risk
            else:
                guarded = self._guarded(snapshot, slot)
                act = table_act if guarded is None else guarded
                if act == IDLE and slack_s < interval:
                    # idling burns the whole tick, a Spot try with capacity less (the rule's risk)
                    act = SPOT if has_spot and self._spot_ok(snapshot) else OD
                if act == SPOT and slot.mode is Mode.ON_DEMAND and self._return_paced(snapshot):
                    act = OD
            self.overrides += act != table_act
            if not self.safety_rule:  # the table alone (docs/simulator.md, *Fifth round*)
                act = table_act
            if slot.mode is Mode.ON_DEMAND and act != OD:
                # leaving on-demand throws its try away (the cap let it: its room counts this)
                excess_s += cfg.price_ratio * snapshot.running_progress_s
            if act == SPOT:
                if slot.mode is not Mode.SPOT:
                    starting += 1 if free > 0 else 0
                    free -= 1
                    on_spot += 1
            elif slot.mode is Mode.SPOT:
                on_spot -= 1
            modes.append({IDLE: Mode.NONE, SPOT: Mode.SPOT, OD: Mode.ON_DEMAND}[act])
        return modes

    def _guarded(self, snapshot: JobSnapshot, slot: SlotView) -> int | None:
        """The cap rule's and the storm guard's choice where they decide (else ``None``: the table)."""
        params = self.run_params
        room = cost_room_s(snapshot, params)
        if room is not None and room < spot_waste_s(snapshot, params):
            # slack_aware's cap rule (the safety rule passed): hold above the reserve, else on-demand;
            # a running on-demand try is kept (stopping it to wait throws its progress away too)
            return IDLE if choose_pool(snapshot, params).hold else OD
        if self.guards and slot.mode is not Mode.SPOT and in_storm(snapshot, params):
            return OD
        return None

    def _return_paced(self, snapshot: JobSnapshot) -> bool:
        """slack_aware's ``return_doubling`` (``PolicyParams``, off): a running on-demand try stays
        while as many other Spot tries are still in their changeover as have passed it, so the
        moves back to Spot go 1, 1, 2, 4, … per tick and a gang reclaimed at once throws few away."""
        starting = snapshot.spot_workers_starting
        return self.params.return_doubling and starting >= max(1, snapshot.spot_workers - starting)

    def _spot_ok(self, snapshot: JobSnapshot) -> bool:
        """Whether the expected-cost guard lets this worker take Spot (a running Spot try: yes)."""
        limit = self.run_params.spot_cost_limit
        if not self.guards or limit is None or snapshot.previous_pool is PoolKind.SPOT:
            return True
        ratio = spot_cost_ratio(snapshot)
        return ratio is None or ratio < limit

    def _tabled(
        self, table: Table, snapshot: JobSnapshot, slot: SlotView, steps_left: int, shards: int
    ) -> int:
        """The table's action for this worker (Spot taken off where the expected-cost guard says)."""
        grid = self.grid
        m = {Mode.NONE: IDLE, Mode.SPOT: SPOT, Mode.ON_DEMAND: OD}[slot.mode]
        running = slot.mode is not Mode.NONE
        units = (slot.progress_h - slot.changeover_left_h) / grid.unit_h if running else 0.0
        j = min(max(round(units), -grid.changeover_units), grid.shard_units - 1) + grid.changeover_units
        spot_ok = self._spot_ok(snapshot)
        return table.action(steps_left, self._spot_state(snapshot), m, shards, j, spot_ok=spot_ok)

    def _spot_state(self, snapshot: JobSnapshot) -> int:
        """The table's Spot state of this worker: there or not (a table with age adds the phase)."""
        return int(snapshot.spot_available)

    @property
    def decision_s(self) -> float:
        """Mean seconds per decision (every worker's choice at one tick), solves included."""
        return self.seconds / max(1, self.decisions)


__all__ = ["MarkovDecision", "PolicyParams"]
