"""``omniscient``: the cheapest cost any policy could reach knowing the whole future trace.

* ``N = 1``: :func:`exact_optimum`, the **exact offline optimum** of the simulator's own model
  (decisions at tick boundaries, a changeover ``d`` on every (re)start, a stop or preemption loses
  the uncommitted part of the shard, a worker stops paying the instant the last shard commits), by
  dynamic programming over ticks. State: committed shards × (pool, changeover left, progress inside
  the running shard). Times are integers of a resolution ``r`` dividing the tick, ``d`` and the
  shard, so the optimum is exact, not approximate. With a tiny shard it is the paper's no-loss model.
* ``N > 1``: :func:`tightest_bound`, the larger of two **proven lower bounds** (not schedules).

  :func:`relaxation_bound`: order the running workers at every instant with the Spot ones at the
  bottom: "virtual worker ``j``" is on Spot iff at least ``j`` workers are, so its Spot time lies in
  the spells of capacity level ``j``, and the Spot starts of all virtual workers are no more than the
  real Spot starts. Relaxing further (no lost work, on-demand in any gap, all worker-time within
  ``N · D``), the cheapest use is the ``c`` longest spells for the best ``c``: each used spell of
  length ``L`` gives ``L − d`` of work for ``L`` of Spot cost. That minimum is computed exactly.

  :func:`lagrangian_bound`: cut every worker's part of an on-time schedule at the last commit of each
  of its tries. Each piece is a try that starts at a tick boundary, pays ``d``, commits ``n`` whole
  shards and lasts ``d + n·S`` (no longer than the real try, so it costs no more and holds Spot no
  longer); the worker's next try starts at a later boundary; a Spot piece lies on ticks with
  capacity. Call such a sequence a *plan* ``p``. The ``N`` plans commit ``W`` together and hold at
  most ``min(c_t, N)·g`` Spot hours in tick ``t``. So for any toll ``λ_t ≥ 0`` and work price ``μ``,
  cost ≥ Σ_i [cost(p_i) + Σ_t λ_t spot_i(t) − μ work(p_i)] + μ·W − Σ_t λ_t min(c_t, N)·g
  ≥ N · min_p [cost(p) + λ·spot(p) − μ·work(p)] + μ·W − λ·min(c, N)·g, and that minimum over one
  worker's plans is an exact dynamic programme over ticks. Any ``(λ, μ)`` gives a valid bound;
  bisection on ``μ`` and a few subgradient steps on ``λ`` (only where capacity is short of ``N``)
  make it tight. Unlike the relaxation it counts a changeover per try, whole shards (work lost to a
  stop) and each worker's own deadline; like it, it holds for schedules that meet the deadline.
* Several Spot pools (as :func:`~.engine.simulate_pools`, any ``N``): :func:`pools_bound`, the same
  Lagrangian bound with a try on on-demand or on one pool ``j`` (price ``p_j``, speed ``s_j``: it
  lasts ``d + n·S/s_j`` and needs pool ``j``'s capacity on every tick it touches) and one toll
  ``λ_{j,t}`` per pool and tick on that pool's ``min(c_j(t), N)·g`` Spot hours. A proven lower bound,
  not an optimum, even for ``N = 1``; :func:`lagrangian_bound` is its one-pool case.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from airflow_deadline_batch.sim.engine import EPS, SimConfig, SimPool, on_demand_makespan
from airflow_deadline_batch.sim.traces import Trace

#: cap on the states of the dynamic programme (offset in shard × committed shards); above it the
#: relaxation bound is used instead
MAX_STATES = 400_000


@dataclass(frozen=True)
class Bound:
    """The omniscient cost of one start; ``exact`` says whether it is the optimum or a bound."""

    cost: float
    spot_hours: float
    on_demand_hours: float
    feasible: bool
    exact: bool = False


def spells(trace: Trace, start_tick: int, horizon_h: float, workers: int) -> list[float]:
    """Lengths in hours of the maximal available runs of every capacity level within the horizon."""
    gap = trace.gap_s / 3600.0
    ticks = max(1, math.ceil(horizon_h / gap - 1e-9))
    out: list[float] = []
    for level in range(1, workers + 1):
        run = 0
        for i in range(ticks):
            if trace.at(start_tick + i) >= level:
                run += 1
            elif run:
                out.append(run * gap)
                run = 0
        if run:
            out.append(run * gap)
    return sorted(out, reverse=True)


def relaxation_bound(trace: Trace, start_tick: int, config: SimConfig) -> Bound:
    """Proven lower bound for any ``N`` (see the module docstring): best number of longest spells."""
    k, d, work, n = config.price_ratio, config.changeover_h, config.work_h, config.workers
    feasible = config.on_demand_feasible()
    od_only = (work + min(n, config.shards) * d) * k
    if not feasible:
        return Bound(cost=od_only, spot_hours=0.0, on_demand_hours=od_only / k, feasible=False)
    budget = n * config.deadline_h
    best = Bound(cost=(work + d) * k, spot_hours=0.0, on_demand_hours=work + d, feasible=True)
    left, spot = work, 0.0
    for length in spells(trace, start_tick, config.deadline_h, n):
        w = min(length - d, left)
        if w <= 0:
            break
        left -= w
        spot += w + d
        od = left + d if left > 1e-12 else 0.0
        if spot + od > budget + 1e-9:  # every segment's changeover eats worker-time
            break
        cost = spot + k * od
        if cost < best.cost:
            best = Bound(cost=cost, spot_hours=spot, on_demand_hours=od, feasible=True)
        if left <= 1e-12:
            break
    return best


@dataclass(frozen=True)
class _WorkerPlan:
    """One worker's best schedule at given prices: its value, work, Spot hours per pool and tick, hours."""

    value: float
    work_h: float
    spot_by_tick: np.ndarray  # (pools, ticks)
    spot_h: float
    on_demand_h: float


class _WorkerProblem:
    """One worker alone on the pools: tries that each commit ``n`` whole shards (Lagrangian step).

    A try starts at a tick boundary ``a``, pays the changeover ``d``, commits ``n ≥ 1`` shards and
    ends at ``a·g + d + n·S/speed`` (the relaxation lets any try stop at its last commit; the engine
    lets only the finishing ones); the worker is idle until the next boundary. A try runs on
    on-demand (price ``k``, speed 1) or on one Spot pool ``j`` (price ``p_j``, speed ``s_j``), which
    needs capacity in pool ``j`` on every tick it touches; every try ends by the deadline.
    """

    def __init__(self, pools: Sequence[SimPool], start_tick: int, config: SimConfig) -> None:
        self.gap = pools[0].trace.gap_s / 3600.0
        self.ticks = max(1, math.ceil(config.deadline_h / self.gap - EPS))
        self.size, self.d, self.k = config.shard_size_h, config.changeover_h, config.price_ratio
        self.deadline = config.deadline_h
        caps = np.array([[p.trace.at(start_tick + i) for i in range(self.ticks)] for p in pools], dtype=float)
        self.caps = np.minimum(caps, config.workers)  # (pools, ticks)
        most = max(0, min(config.shards, math.floor((self.deadline - self.d) / self.size + EPS)))
        self.work = self.size * np.arange(1, most + 1)
        # mode 0 is on-demand, mode 1 + j Spot pool j: price, a try's hours for n shards, ticks it touches
        self.price = [self.k] + [p.price for p in pools]
        self.length = [self.d + self.work / speed for speed in [1.0] + [p.speed for p in pools]]
        self.span = [np.ceil(length / self.gap - EPS).astype(int) for length in self.length]
        self.n_deadline = [
            np.array(
                [
                    np.searchsorted(length, self.deadline - a * self.gap + EPS, side="right")
                    for a in range(self.ticks)
                ]
            )
            for length in self.length
        ]
        self.n_spot = []  # per pool: the most shards a try from each tick can commit on capacity
        for j, pool_caps in enumerate(self.caps):
            run = np.zeros(self.ticks + 1, dtype=int)  # ticks with capacity from each tick on
            for i in range(self.ticks - 1, -1, -1):
                run[i] = run[i + 1] + 1 if pool_caps[i] >= 1 else 0
            n_spot = np.searchsorted(self.span[1 + j], run[: self.ticks], side="right")
            self.n_spot.append(np.minimum(n_spot, self.n_deadline[1 + j]))

    def solve(self, reward: float, toll: np.ndarray) -> _WorkerPlan:
        """Best value (reward × work − cost − Σ toll × Spot hours) by dynamic programming over ticks."""
        longest = max((int(span[-1]) for span in self.span if len(span)), default=0)
        pad = self.ticks + longest + 1
        value = np.zeros(pad + 1)
        gain = reward * self.work
        gains = [gain - price * length for price, length in zip(self.price, self.length, strict=True)]
        tolls = [self._tolls(row, pad) for row in toll]
        choice = np.zeros((self.ticks, 2), dtype=int)  # (mode 0 idle / 1 + try mode, n)
        for a in range(self.ticks - 1, -1, -1):
            best, pick = value[a + 1], (0, 0)
            n_od = int(self.n_deadline[0][a])
            if n_od:
                od = gains[0][:n_od] + value[a + self.span[0][:n_od]]
                i = int(od.argmax())
                if od[i] > best:
                    best, pick = float(od[i]), (1, i + 1)
            for j, n_spot in enumerate(self.n_spot):
                n_sp = int(n_spot[a])
                if not n_sp:
                    continue
                nxt = a + self.span[1 + j][:n_sp]
                sp = gains[1 + j][:n_sp] + value[nxt]
                tolled = tolls[j]
                if tolled is not None:
                    paid, toll_pad = tolled
                    last = nxt - 1
                    sp -= (
                        paid[last]
                        - paid[a]
                        + toll_pad[last] * (self.length[1 + j][:n_sp] - (last - a) * self.gap)
                    )
                i = int(sp.argmax())
                if sp[i] > best:
                    best, pick = float(sp[i]), (2 + j, i + 1)
            value[a] = best
            choice[a] = pick
        return self._trace_back(float(value[0]), choice)

    def _tolls(self, toll: np.ndarray, pad: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A pool's toll paid up to each boundary, and per tick, padded past the deadline (None: no toll)."""
        if not toll.any():
            return None
        paid = np.concatenate(([0.0], np.cumsum(toll * self.gap), np.zeros(pad)))
        paid[self.ticks + 1 :] = paid[self.ticks]
        return paid, np.concatenate((toll, np.zeros(pad)))

    def _trace_back(self, value: float, choice: np.ndarray) -> _WorkerPlan:
        spot_by_tick = np.zeros_like(self.caps)
        work = spot = od = 0.0
        a = 0
        while a < self.ticks:
            mode, n = int(choice[a, 0]), int(choice[a, 1])
            if mode == 0:
                a += 1
                continue
            hours, span = float(self.length[mode - 1][n - 1]), int(self.span[mode - 1][n - 1])
            work += float(self.work[n - 1])
            if mode >= 2:
                spot += hours
                row = spot_by_tick[mode - 2]
                row[a : a + span] = self.gap
                row[a + span - 1] = hours - (span - 1) * self.gap
            else:
                od += hours
            a += span
        return _WorkerPlan(value, work, spot_by_tick, spot, od)


def lagrangian_bound(trace: Trace, start_tick: int, config: SimConfig, *, rounds: int = 8) -> Bound:
    """Proven lower bound for ``N`` workers sharing the trace: Lagrangian relaxation (module docstring).

    Any prices give a valid bound; ``rounds`` subgradient steps only make it tighter. Its Spot and
    on-demand hours are those of ``N`` copies of the last best worker plan (indicative only).
    """
    return pools_bound([SimPool(trace)], start_tick, config, rounds=rounds)


def pools_bound(pools: Sequence[SimPool], start_tick: int, config: SimConfig, *, rounds: int = 8) -> Bound:
    """Proven lower bound for ``N`` workers on several Spot pools (module docstring), as simulate_pools.

    One toll per pool per tick on that pool's capacity ``min(c_j(t), N)·g``; with one pool of price
    and speed 1 it is :func:`lagrangian_bound`.
    """
    if not pools:
        raise ValueError("at least one Spot pool is needed")
    if len({p.trace.gap_s for p in pools}) != 1:
        raise ValueError("the pools' traces must share one tick length (gap_s)")
    n, work, k = config.workers, config.work_h, config.price_ratio
    if not config.on_demand_feasible():
        od_only = (work + min(n, config.shards) * config.changeover_h) * k
        return Bound(cost=od_only, spot_hours=0.0, on_demand_hours=od_only / k, feasible=False)
    problem = _WorkerProblem(pools, start_tick, config)
    toll = np.zeros_like(problem.caps)
    shared = bool(np.any(problem.caps[problem.caps > 0] < n))  # capacity short of N somewhere
    lo, hi = 0.0, 2.0 * k * (1.0 + config.changeover_h / config.shard_size_h)
    best = Bound(cost=0.0, spot_hours=0.0, on_demand_hours=0.0, feasible=True)

    def evaluate(reward: float) -> tuple[float, _WorkerPlan]:
        plan = problem.solve(reward, toll)
        held = (
            sum(float(np.sum(row * caps)) for row, caps in zip(toll, problem.caps, strict=True)) * problem.gap
        )
        return reward * work - n * plan.value - held, plan

    def keep(bound: float, plan: _WorkerPlan) -> None:
        nonlocal best
        if bound > best.cost:
            best = Bound(
                cost=bound, spot_hours=n * plan.spot_h, on_demand_hours=n * plan.on_demand_h, feasible=True
            )

    def bisect(lo: float, hi: float, steps: int) -> tuple[float, _WorkerPlan]:
        """The work price where ``N`` workers' planned work crosses ``W`` (the bound is concave in it)."""
        reward, plan = hi, problem.solve(hi, toll)
        for _ in range(steps):
            mid = (lo + hi) / 2
            bound, plan = evaluate(mid)
            keep(bound, plan)
            if n * plan.work_h >= work - EPS:
                hi = mid
            else:
                lo = mid
            reward = mid
        return reward, plan

    reward, plan = bisect(lo, hi, 16)
    if not shared:
        return best
    target = (work + min(n, config.shards) * config.changeover_h) * k  # on-demand only: above the optimum
    step = 1.0
    for _ in range(rounds):
        excess = n * plan.spot_by_tick - problem.caps * problem.gap
        norm = sum(float(np.dot(row, row)) for row in excess)  # pool by pool: an empty pool adds 0.0
        if norm < 1e-12:
            break
        before = best.cost
        toll = np.maximum(0.0, toll + step * (target - best.cost) / norm * excess)
        reward, plan = bisect(max(0.0, reward - 0.5), reward + 0.5, 5)
        if best.cost <= before + 1e-9:
            step /= 2
    return best


def _resolution(*seconds: float) -> tuple[int, int]:
    """A common integer grid: (scale, unit) with every value × scale an integer multiple of unit."""
    for scale in (1, 10, 1000):
        values = [s * scale for s in seconds]
        if all(abs(v - round(v)) < 1e-6 for v in values):
            ints = [round(v) for v in values if round(v) > 0]
            return scale, math.gcd(*ints) if ints else 1
    fractions = [Fraction(s).limit_denominator(1000) for s in seconds]
    scale = math.lcm(*(f.denominator for f in fractions))
    return scale, math.gcd(*(int(f * scale) for f in fractions if f > 0))


def exact_optimum(trace: Trace, start_tick: int, config: SimConfig) -> Bound:
    """Exact offline optimum for one worker in the simulator's model (module docstring)."""
    if config.workers != 1:
        raise ValueError("exact_optimum handles one worker; use relaxation_bound for N > 1")
    k, d_h = config.price_ratio, config.changeover_h
    feasible = config.on_demand_feasible()
    od_cost = (config.work_h + d_h) * k
    if not feasible:
        return Bound(
            cost=od_cost, spot_hours=0.0, on_demand_hours=config.work_h + d_h, feasible=False, exact=True
        )
    scale, unit = _resolution(trace.gap_s, d_h * 3600, config.shard_size_h * 3600)
    hours_per_unit = unit / scale / 3600.0
    gap = round(trace.gap_s * scale) // unit
    co0 = round(d_h * 3600 * scale) // unit
    shard = round(config.shard_size_h * 3600 * scale) // unit
    m = config.shards
    if m * shard > MAX_STATES:
        return relaxation_bound(trace, start_tick, config)
    deadline_units = config.deadline_h / hours_per_unit + 1e-6
    ticks = math.ceil(config.deadline_h / (trace.gap_s / 3600.0) - EPS)
    pools = ("spot", "od")
    price = {"spot": 1.0, "od": k}
    inf = math.inf
    c_idx = np.arange(m)
    off_idx = np.arange(shard)
    # units still needed to finish from (offset, committed shards) once past the changeover
    need2d = (m - c_idx)[None, :] * shard - off_idx[:, None]
    new_off = (off_idx + gap) % shard
    commits_by_off = (off_idx + gap) // shard
    # cost (in price × units) of the cheapest way to each state; spot units alongside
    idle = (np.where(c_idx == 0, 0.0, inf), np.zeros(m))
    run: dict[str, tuple[np.ndarray, np.ndarray]] = {
        pool: (np.full((shard, m), inf), np.zeros((shard, m))) for pool in pools
    }
    pend: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {pool: {} for pool in pools}
    best = [od_cost / hours_per_unit, 0.0]

    def finish(cost: np.ndarray, spot: np.ndarray, need: np.ndarray, p: float, s: float, t0: float) -> None:
        ok = (need <= gap) & (t0 + need <= deadline_units)
        if ok.any():
            fin = np.where(ok, cost + p * need, inf)
            j = np.unravel_index(int(np.argmin(fin)), fin.shape)
            if fin[j] < best[0]:
                best[0], best[1] = float(fin[j]), float(spot[j] + s * need[j])

    def start(
        pool: str, cost: np.ndarray, spot: np.ndarray, t0: float, into_run: tuple, into_pend: dict
    ) -> None:
        """A (re)start now: changeover ``co0``, then progress from the start of a shard."""
        p, s = price[pool], (1.0 if pool == "spot" else 0.0)
        if co0 >= gap:
            key = co0 - gap
            c2, s2 = cost + p * gap, spot + s * gap
            if key in into_pend:
                c1, s1 = into_pend[key]
                c2, s2 = np.minimum(c1, c2), np.where(c2 < c1, s2, s1)
            into_pend[key] = (c2, s2)
            return
        _progress_1d(pool, co0, cost, spot, t0, into_run)

    def _progress_1d(
        pool: str, co: int, cost: np.ndarray, spot: np.ndarray, t0: float, into_run: tuple
    ) -> None:
        p, s = price[pool], (1.0 if pool == "spot" else 0.0)
        finish(cost, spot, co + (m - c_idx) * shard, p, s, t0)
        total = gap - co
        j, off = divmod(total, shard)
        if j >= m:
            return
        rc, rs = into_run
        c2 = cost[: m - j] + p * gap
        better = c2 < rc[off, j:]
        rc[off, j:] = np.where(better, c2, rc[off, j:])
        rs[off, j:] = np.where(better, spot[: m - j] + s * gap, rs[off, j:])

    for tick in range(ticks):
        t0 = float(tick * gap)
        available = trace.at(start_tick + tick) >= 1
        ic, isp = idle
        for pool in pools:  # stopping (or a preemption) keeps the committed shards only
            rc, rs = run[pool]
            j = np.argmin(rc, axis=0)
            col = rc[j, c_idx]
            better = col < ic
            ic, isp = np.where(better, col, ic), np.where(better, rs[j, c_idx], isp)
            for c1, s1 in pend[pool].values():
                better = c1 < ic
                ic, isp = np.where(better, c1, ic), np.where(better, s1, isp)
        new_run = {pool: (np.full((shard, m), inf), np.zeros((shard, m))) for pool in pools}
        new_pend: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {pool: {} for pool in pools}
        for pool in pools:
            if pool == "spot" and not available:
                continue
            p, s = price[pool], (1.0 if pool == "spot" else 0.0)
            # continue the running try: whole tick of progress from each offset
            rc, rs = run[pool]
            finish(rc, rs, need2d, p, s, t0)
            nrc, nrs = new_run[pool]
            for j in np.unique(commits_by_off):
                if j >= m:
                    continue
                rows = off_idx[commits_by_off == j]
                c2 = rc[rows, : m - j] + p * gap
                tgt = nrc[new_off[rows], j:]
                better = c2 < tgt
                nrc[new_off[rows], j:] = np.where(better, c2, tgt)
                nrs[new_off[rows], j:] = np.where(better, rs[rows, : m - j] + s * gap, nrs[new_off[rows], j:])
            # continue a try still in its changeover
            for co, (c1, s1) in pend[pool].items():
                if co >= gap:
                    key = co - gap
                    c2, s2 = c1 + p * gap, s1 + s * gap
                    if key in new_pend[pool]:
                        c0, s0 = new_pend[pool][key]
                        c2, s2 = np.minimum(c0, c2), np.where(c2 < c0, s2, s0)
                    new_pend[pool][key] = (c2, s2)
                else:
                    _progress_1d(pool, co, c1, s1, t0, new_run[pool])
            start(pool, ic, isp, t0, new_run[pool], new_pend[pool])
        run, pend, idle = new_run, new_pend, (ic, isp)
    cost = best[0] * hours_per_unit
    spot_h = best[1] * hours_per_unit
    return Bound(
        cost=cost,
        spot_hours=spot_h,
        on_demand_hours=(cost - spot_h) / k,
        feasible=True,
        exact=True,
    )


def omniscient(trace: Trace, start_tick: int, config: SimConfig) -> Bound:
    """The best computable reference: the exact optimum for one worker, the proven bound otherwise."""
    if config.workers == 1:
        return exact_optimum(trace, start_tick, config)
    return tightest_bound(trace, start_tick, config)


def tightest_bound(trace: Trace, start_tick: int, config: SimConfig) -> Bound:
    """The larger of the two proven lower bounds (each is below every schedule, so the larger is)."""
    return max(
        relaxation_bound(trace, start_tick, config),
        lagrangian_bound(trace, start_tick, config),
        key=lambda b: b.cost,
    )


def lower_bound(trace: Trace, start_tick: int, config: SimConfig) -> Bound:
    """Alias kept for callers of the first version: the omniscient reference (never above optimum)."""
    return omniscient(trace, start_tick, config)


__all__ = [
    "Bound",
    "exact_optimum",
    "lagrangian_bound",
    "lower_bound",
    "omniscient",
    "on_demand_makespan",
    "pools_bound",
    "relaxation_bound",
    "spells",
    "tightest_bound",
]
