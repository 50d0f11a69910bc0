"""``omniscient``: a lower bound on the cost of any policy that knows the whole future trace.

Any schedule is a set of Spot segments, each inside a spell where the capacity covers it and each
paying a changeover ``d`` (billed at Spot price, no progress), plus on-demand time at price ``k``
with at least one changeover when used. Relaxations (each can only lower the cost): no work is lost
to preemptions (the future is known, so runs end on a commit), on-demand may run in any gap, and
the deadline only limits the *number* of Spot segments: every segment costs ``d`` of the
``N · D`` worker-hours, so at most ``(N·D − W − d) / d`` of them fit. The cheapest use of at most
that many spells is the longest spells first (each used spell saves ``(k−1)·w − d`` for ``w`` hours
of work), which this module computes exactly.

For one worker the spells are the maximal runs of available ticks and the bound is proven. For
``N`` workers the spells are taken per capacity level (level ``m`` is available where capacity is at
least ``m``); a schedule whose workers change levels mid-spell can in principle do better, so for
``N > 1`` it is a bound under the "a worker keeps its level" restriction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from airflow_deadline_batch.sim.engine import SimConfig
from airflow_deadline_batch.sim.traces import Trace


@dataclass(frozen=True)
class Bound:
    cost: float
    spot_hours: float
    on_demand_hours: float
    feasible: bool


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
    # the last tick may reach past the horizon: clip the total, not each spell (a lower bound still)
    return sorted(out, reverse=True)


def lower_bound(trace: Trace, start_tick: int, config: SimConfig) -> Bound:
    """Cheapest cost any policy could reach on this start (see the module docstring)."""
    k, d, work = config.price_ratio, config.changeover_h, config.work_h
    feasible = config.on_demand_feasible()
    budget = (config.workers * config.deadline_h - work - d) / d if d > 0 else math.inf
    max_segments = max(0, math.floor(budget + 1e-9)) if feasible else 0
    left = work
    spot = 0.0
    for used, length in enumerate(spells(trace, start_tick, config.deadline_h, config.workers)):
        if used >= max_segments or left <= 1e-12:
            break
        w = min(length - d, left)
        if w <= 0:
            break
        covers_rest = w >= left - 1e-12
        if not covers_rest and (k - 1) * w <= d:
            break  # shorter spells save even less
        spot += w + d
        left -= w
    on_demand = left + d if left > 1e-12 else 0.0
    return Bound(cost=spot + k * on_demand, spot_hours=spot, on_demand_hours=on_demand, feasible=feasible)
