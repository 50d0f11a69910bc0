"""Run policies over many start offsets of traces and summarise them (the ``simulate`` numbers)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from airflow_deadline_batch.sim.engine import RunResult, SimConfig, simulate
from airflow_deadline_batch.sim.omniscient import omniscient
from airflow_deadline_batch.sim.policies import POLICY_NAMES, make_policy, slack_aware_at
from airflow_deadline_batch.sim.traces import Trace


@dataclass(frozen=True)
class Summary:
    """One (trace, policy) line of ``simulate --json`` (docs/design.md §8)."""

    trace: str
    policy: str
    mean_cost: float
    cost_vs_on_demand: float
    miss_rate: float
    spot_hours: float
    on_demand_hours: float
    preemptions: float
    redone_hours: float
    starts: int
    work_hours: float
    deadline_hours: float
    workers: int
    changeover_hours: float
    price_ratio: float
    shard_hours: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def start_ticks(
    trace: Trace,
    config: SimConfig,
    *,
    starts: int = 50,
    seed: int = 0,
    start_hours: Sequence[float] | None = None,
) -> list[int]:
    """Start offsets: the given hours, or ``starts`` seeded draws that leave room for the deadline."""
    gap_h = trace.gap_s / 3600.0
    if start_hours:
        return [int(h / gap_h) for h in start_hours]
    span = len(trace.capacity) - math.ceil(config.deadline_h / gap_h)
    rng = random.Random(seed)
    # a trace shorter than the deadline wraps around (Trace.at); start anywhere then
    return [rng.randrange(max(1, span)) for _ in range(starts)]


def run_policy(name: str, trace: Trace, config: SimConfig, ticks: Sequence[int]) -> list[RunResult]:
    """One result per start; ``omniscient`` becomes the offline reference dressed as a result."""
    if name == "omniscient":
        out = []
        for tick in ticks:
            bound = omniscient(trace, tick, config)
            out.append(
                RunResult(
                    policy=name,
                    start_tick=tick,
                    cost=bound.cost,
                    spot_hours=bound.spot_hours,
                    on_demand_hours=bound.on_demand_hours,
                    missed=not bound.feasible,
                    starts=0,
                    work_done_h=config.work_h,
                )
            )
        return out
    if name == "slack_aware":  # with what earlier jobs on the pool persisted
        return [simulate(trace, t, config, slack_aware_at([trace], t, config.workers)) for t in ticks]
    return [simulate(trace, tick, config, make_policy(name)) for tick in ticks]


def summarise(trace: Trace, config: SimConfig, name: str, results: Sequence[RunResult]) -> Summary:
    n = len(results)
    on_demand_cost = (
        config.work_h + min(config.workers, config.shards) * config.changeover_h
    ) * config.price_ratio

    def mean(values: Sequence[float]) -> float:
        return math.fsum(values) / n

    cost = mean([r.cost for r in results])
    return Summary(
        trace=trace.name,
        policy=name,
        mean_cost=cost,
        cost_vs_on_demand=cost / on_demand_cost,
        miss_rate=mean([1.0 if r.missed else 0.0 for r in results]),
        spot_hours=mean([r.spot_hours for r in results]),
        on_demand_hours=mean([r.on_demand_hours for r in results]),
        preemptions=mean([float(r.preemptions) for r in results]),
        redone_hours=mean([r.redone_hours for r in results]),
        starts=n,
        work_hours=config.work_h,
        deadline_hours=config.deadline_h,
        workers=config.workers,
        changeover_hours=config.changeover_h,
        price_ratio=config.price_ratio,
        shard_hours=config.shard_size_h,
    )


def compare(
    trace: Trace, config: SimConfig, ticks: Sequence[int], policies: Sequence[str] = POLICY_NAMES
) -> list[Summary]:
    return [summarise(trace, config, name, run_policy(name, trace, config, ticks)) for name in policies]
