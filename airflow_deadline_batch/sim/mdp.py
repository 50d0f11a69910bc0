"""``mdp``: wait / Spot / on-demand chosen by backward induction over a Markov model of Spot.

Research policy for issue 13 (docs/simulator.md, *Fourth round*). Each worker models its Spot
availability as a continuous-time two-state Markov chain (there / missing) whose rates come from
the same online estimate ``slack_aware`` learns (``core.calibration.AvailabilityEstimate``, with
its prior and the persisted history): a spell ends at rate ``μ = 1 / run_hours`` and, with the
availability ``a``, returns at rate ``λ = μ · a / (1 − a)``. The expected cost-to-go
``V[t, s, m, r]`` over (steps left ``t``, Spot there ``s``, running mode ``m``: none / Spot /
on-demand, work left ``r`` incl. the running try's changeover) is solved by backward induction
over steps of at least one tick, on a grid of work units that divides the step:

* waiting costs nothing; a try pays its changeover on (re)start (as work it must run), Spot 1 and
  on-demand ``k`` per hour; a try finishing inside a step pays only what it runs;
* a Spot try whose capacity goes at the next step loses half a shard (the expected uncommitted
  part) and is idle; leaving a running try loses the same in the table (the actual loss at the
  decision itself);
* the table only waits or takes Spot where on-demand still fits after a step of the worst
  case; a state still unfinished at the deadline costs a large penalty.

The deadline is enforced outside the table by the very rule ``slack_aware`` uses
(``core.placement``: ``slack = time left − od_need_s``; Spot or waiting only while
``slack ≥ spot_risk_s``), so the no-miss argument of docs/simulator.md carries over unchanged:
the table only chooses among the options the rule leaves.

``N > 1``: the workers act independently on one shared table, solved for one worker with the
job's work per worker (a worker's Spot "there" means a free Spot GPU for it, and the estimate's
availability is the share of the workers Spot could hold). One Spot pool (pool 0 of a multi-pool
run). The table is re-solved only when the learned rates move by more than ``resolve_change``.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass

import numpy as np

from airflow_deadline_batch.core.placement import JobSnapshot, PolicyParams, od_need_s, spot_risk_s
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.sim.engine import Choice, Mode, SimConfig, View
from airflow_deadline_batch.sim.policies import EPOCH, SlackAware

#: modes of the table's state (the running try)
IDLE, SPOT, OD = 0, 1, 2
#: the most time steps and work units of one table (cost of a solve ∝ their product)
MAX_STEPS = 160
MAX_UNITS = 320


@dataclass(frozen=True)
class Grid:
    """The table's step (hours), work unit (hours) and sizes, fixed per job."""

    step_h: float
    unit_h: float
    steps: int
    units: int

    @classmethod
    def for_job(cls, config: SimConfig, gap_h: float) -> Grid:
        ticks = max(1, math.ceil(config.deadline_h / gap_h - 1e-9))
        step = gap_h * max(1, math.ceil(ticks / MAX_STEPS))
        per_worker = config.work_h / config.workers + config.shard_size_h + 2 * config.changeover_h
        per_step = max(1, min(8, math.floor(MAX_UNITS * step / per_worker)))
        unit = step / per_step
        return cls(step, unit, math.ceil(config.deadline_h / step - 1e-9), math.ceil(per_worker / unit) + 1)


@dataclass(frozen=True)
class Rates:
    """The Markov chain of one worker's Spot over one step: P(there next | there / missing now)."""

    availability: float
    run_h: float
    up_up: float
    down_up: float

    @classmethod
    def of(cls, availability: float, run_h: float, step_h: float) -> Rates:
        a = min(max(availability, 0.01), 0.99)
        mu = 1.0 / max(run_h, 1e-3)
        lam = mu * a / (1.0 - a)
        decay = math.exp(-(lam + mu) * step_h)
        return cls(a, run_h, a + (1.0 - a) * decay, a * (1.0 - decay))


class Table:
    """``V[t, s, m, r]``: expected cost-to-go with ``t`` steps left (see the module docstring).

    The changeover and the loss of a stop are whole units in the recursion (index shifts, so a
    solve is a few array operations per step); the decision itself interpolates the actual state.
    """

    def __init__(self, grid: Grid, config: SimConfig, rates: Rates, steps: int) -> None:
        self.grid, self.rates = grid, rates
        u = grid.unit_h
        self.per_step = round(grid.step_h / u)
        self.changeover = config.changeover_h / u
        self.loss = config.shard_size_h / 2 / u
        self.k = config.price_ratio
        self.p_up = np.array([rates.down_up, rates.up_up])
        n = grid.units
        r = np.arange(n)
        c, loss, per, k = round(self.changeover), round(self.loss), self.per_step, self.k
        big = 10.0 * self.k * (config.work_h / config.workers + 10 * config.changeover_h + 10 * grid.step_h)
        v = np.empty((steps + 1, 2, 3, n))
        v[0] = big + k * (r + self.changeover) * u
        v[0][..., 0] = 0.0

        # shifts as slices of arrays padded with their edge values (index r + offset, clipped)
        pad = per + 1
        top = loss + c + 1

        def at(offset: int) -> slice:
            return slice(pad + offset, pad + offset + n)

        # per current mode (idle, Spot, on-demand): what leaving it adds, and where a Spot /
        # on-demand try starts from (keep it, or leave it and pay the changeover)
        leave = (0, loss, loss)
        start_spot = (c, 0, loss + c)
        start_od = (c, loss + c, 0)
        done_spot = [(r + o) <= per for o in start_spot]
        done_od = [(r + o) <= per for o in start_od]
        cost_spot = [(r + o) * u for o in start_spot]
        cost_od = [k * (r + o) * u for o in start_od]
        step_h = grid.step_h
        p1 = rates.up_up
        p_up = self.p_up[:, None]
        nxt = np.empty((2, 3, pad + n + top))
        for t in range(1, steps + 1):
            nxt[..., pad : pad + n] = v[t - 1]
            nxt[..., :pad] = v[t - 1][..., :1]
            nxt[..., pad + n :] = v[t - 1][..., -1:]
            e_idle = p_up * nxt[1, IDLE] + (1 - p_up) * nxt[0, IDLE]
            e_od = p_up * nxt[1, OD] + (1 - p_up) * nxt[0, OD]
            spot_next = p1 * nxt[1, SPOT]
            spot_lost = (1 - p1) * nxt[0, IDLE]
            for m in (IDLE, SPOT, OD):
                safe = (t - 1) * step_h >= (r + leave[m] + c) * u - 1e-9
                od = np.where(done_od[m], cost_od[m], k * step_h + e_od[:, at(start_od[m] - per)])
                wait = np.where(safe, e_idle[:, at(leave[m])], np.inf)
                best = np.minimum(od, wait)
                spot = step_h + spot_next[at(start_spot[m] - per)] + spot_lost[at(start_spot[m] - per + loss)]
                spot = np.where(safe, np.where(done_spot[m], cost_spot[m], spot), np.inf)
                best[1] = np.minimum(best[1], spot)
                v[t, :, m] = best
            v[t][..., 0] = 0.0
        self.v = v

    @staticmethod
    def _value(row: np.ndarray, r: float) -> float:
        """``row`` at fractional unit ``r`` (linear between units, clipped to the grid)."""
        top = len(row) - 1
        r = min(max(r, 0.0), float(top))
        i = min(int(r), top - 1)
        f = r - i
        return float(row[i] * (1 - f) + row[i + 1] * f)

    def action(self, t: int, s: int, m: int, keep_h: float, leave_h: float) -> int:
        """The table's choice (IDLE = wait, SPOT, OD) at the actual state: work left if the try is
        kept / left, in hours, with ``t`` steps left."""
        t = min(t, len(self.v) - 1)
        if t < 1:
            return OD
        nxt = self.v[t - 1]
        u, step, per, k = self.grid.unit_h, self.grid.step_h, self.per_step, self.k
        keep, leave = keep_h / u, leave_h / u
        p = self.p_up[s]

        def expect(mode: int, r: float) -> float:
            return p * self._value(nxt[1, mode], r) + (1 - p) * self._value(nxt[0, mode], r)

        r_od = keep if m == OD else leave + self.changeover
        od = k * r_od * u if r_od <= per else k * step + expect(OD, r_od - per)
        # waiting and Spot are safe here: the caller's rule (slack against the risk) admitted them
        values = [expect(IDLE, leave), math.inf, od]
        if s == 1:
            r_sp = keep if m == SPOT else leave + self.changeover
            p1 = self.p_up[1]
            values[SPOT] = (
                r_sp * u
                if r_sp <= per
                else step
                + p1 * self._value(nxt[1, SPOT], r_sp - per)
                + (1 - p1) * self._value(nxt[0, IDLE], r_sp - per + self.loss)
            )
        return int(np.argmin(values))


class MarkovDecision(SlackAware):
    """``mdp``: the table's choice per worker above ``slack_aware``'s safety rule (module docstring)."""

    name = "mdp"

    #: the step's transition probabilities are rounded to this for the table (a new table when
    #: the learned rates move by more)
    resolve_change = 0.025

    def reset(self, config: SimConfig, gap_h: float) -> None:
        super().reset(config, gap_h)
        self.grid = Grid.for_job(config, gap_h)
        #: tables solved for this job, by the step's transition probabilities rounded to
        #: ``resolve_change`` (a later, shorter horizon is always covered by an earlier table)
        self.tables: dict[tuple[int, int], Table] = {}
        self.solves = 0
        self.decisions = 0
        self.seconds = 0.0

    def _table(self, config: SimConfig, availability: float, run_h: float, time_left_h: float) -> Table:
        rates = Rates.of(availability, run_h, self.grid.step_h)
        q = self.resolve_change
        key = (round(rates.up_up / q), round(rates.down_up / q))
        table = self.tables.get(key)
        if table is None:
            steps = min(self.grid.steps, math.ceil(time_left_h / self.grid.step_h - 1e-9) + 1)
            centre = Rates(rates.availability, rates.run_h, key[0] * q, key[1] * q)
            table = self.tables[key] = Table(self.grid, config, centre, max(1, steps))
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
        if view.pending_shards == 0 and not any(s.busy for s in view.slots):
            return [Mode.NONE] * len(view.slots)
        table = self._table(cfg, availability, run_h, view.time_left_h)
        n = cfg.workers
        now = EPOCH + dt.timedelta(hours=view.t_h)
        free = view.capacity - sum(1 for s in view.slots if s.mode is Mode.SPOT)
        steps_left = round(view.time_left_h / self.grid.step_h)
        per_worker = view.remaining_h / n
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
            )
            slack_s = view.time_left_h * 3600 - od_need_s(snapshot)
            if slack_s < spot_risk_s(snapshot, self.run_params):
                modes.append(Mode.ON_DEMAND)  # the safety rule: slack no longer covers the risk
                continue
            m = {Mode.NONE: IDLE, Mode.SPOT: SPOT, Mode.ON_DEMAND: OD}[slot.mode]
            keep = per_worker + (slot.changeover_left_h - slot.progress_h if running else 0.0)
            act = table.action(steps_left, int(has_spot), m, max(keep, 0.0), per_worker)
            interval = self.run_params.decision_interval_s or 0.0
            if act == IDLE and has_spot and slack_s < interval:
                act = SPOT  # idling burns the whole tick, a Spot try with capacity less (the rule's risk)
            if act == SPOT:
                if slot.mode is not Mode.SPOT:
                    free -= 1
                modes.append(Mode.SPOT)
            elif act == OD:
                modes.append(Mode.ON_DEMAND)
            else:
                modes.append(Mode.NONE)
        return modes

    @property
    def decision_s(self) -> float:
        """Mean seconds per decision (every worker's choice at one tick), solves included."""
        return self.seconds / max(1, self.decisions)


__all__ = ["MarkovDecision", "PolicyParams"]
