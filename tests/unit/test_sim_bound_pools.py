"""The omniscient bound for several Spot pools: below every schedule, the single-pool bound for one."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.sim.engine import Choice, Mode, SimConfig, SimPool, SpotIn, View, simulate_pools
from airflow_deadline_batch.sim.omniscient import lagrangian_bound, pools_bound
from airflow_deadline_batch.sim.policies import OnDemand, slack_aware_at
from airflow_deadline_batch.sim.traces import Trace


def _policy_costs(pools: tuple[SimPool, ...], cfg: SimConfig) -> list[float]:
    """slack_aware on all pools and on each alone, and on-demand, from tick 0: the on-time runs' costs."""
    subsets = [pools] + [(p,) for p in pools] if len(pools) > 1 else [pools]
    runs = [simulate_pools(s, 0, cfg, slack_aware_at([p.trace for p in s], 0, cfg.workers)) for s in subsets]
    runs.append(simulate_pools(pools, 0, cfg, OnDemand()))
    return [r.cost for r in runs if not r.missed]


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[SimPool, ...], SimConfig]:
    workers = draw(st.integers(1, 3))
    ticks = draw(st.integers(4, 24))
    gap_s = draw(st.sampled_from([300.0, 600.0, 1800.0, 3600.0]))
    pools = tuple(
        SimPool(
            Trace(
                f"pool{j}",
                gap_s,
                tuple(draw(st.lists(st.integers(0, workers + 1), min_size=ticks, max_size=ticks))),
            ),
            price=draw(st.sampled_from([0.5, 0.8, 1.0, 1.3])),
            speed=draw(st.sampled_from([0.5, 0.8, 1.0, 1.5])),
        )
        for j in range(draw(st.integers(1, 3)))
    )
    shard = draw(st.sampled_from([0.1, 0.125, 0.25, 0.5]))
    changeover = draw(st.sampled_from([0.0, 0.05, 0.1, 0.2]))
    work = shard * draw(st.integers(1, 10 * workers))
    cfg = SimConfig(
        work_h=work,
        deadline_h=draw(st.floats(1.0, 2.5)) * work / workers + changeover + shard,
        workers=workers,
        changeover_h=changeover,
        price_ratio=draw(st.floats(1.2, 6.0)),
        shard_h=shard,
    )
    return pools, cfg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_pools_bound_is_below_every_policy_run(case: tuple[tuple[SimPool, ...], SimConfig]) -> None:
    pools, cfg = case
    bound = pools_bound(pools, 0, cfg)
    assert bound.feasible == cfg.on_demand_feasible()
    if not bound.feasible:
        return
    assert bound.cost > 0
    for cost in _policy_costs(pools, cfg):
        assert bound.cost <= cost + 1e-6


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_one_pool_is_the_single_pool_bound(case: tuple[tuple[SimPool, ...], SimConfig]) -> None:
    pools, cfg = case
    trace = pools[0].trace
    single = lagrangian_bound(trace, 0, cfg)
    assert pools_bound([SimPool(trace)], 0, cfg) == single
    # a pool that never has capacity changes nothing
    empty = SimPool(Trace("empty", trace.gap_s, (0,) * len(trace.capacity)), price=0.5, speed=1.5)
    assert pools_bound([SimPool(trace), empty], 0, cfg) == single


class _Scripted:
    """Slots playing a fixed choice per tick (to enumerate every schedule)."""

    name = "scripted"

    def __init__(self, plan: tuple[tuple[Choice, ...], ...]) -> None:
        self.plan = plan

    def reset(self, config: SimConfig, gap_h: float) -> None:
        pass

    def decide(self, view: View) -> tuple[Choice, ...]:
        if view.tick < len(self.plan):
            return self.plan[view.tick]
        return (Mode.ON_DEMAND,) * len(view.slots)


@pytest.mark.parametrize(
    ("caps", "workers", "ticks", "speed"),
    [
        (((1, 0, 1, 1, 0), (0, 1, 1, 0, 1)), 1, 5, 1.5),
        (((1, 1, 0, 1, 1), (1, 0, 1, 1, 0)), 1, 5, 0.8),
        (((1, 2, 1), (2, 0, 1)), 2, 3, 1.0),
    ],
)
def test_pools_bound_is_below_the_best_of_every_schedule(
    caps: tuple[tuple[int, ...], tuple[int, ...]], workers: int, ticks: int, speed: float
) -> None:
    pools = (
        SimPool(Trace("a", 600.0, caps[0]), price=1.0),
        SimPool(Trace("b", 600.0, caps[1]), price=0.7, speed=speed),
    )
    cfg = SimConfig(
        work_h=0.25 * workers,
        deadline_h=ticks / 6,
        workers=workers,
        changeover_h=0.05,
        price_ratio=3.0,
        shard_h=0.125,
    )
    options: list[Choice] = [Mode.NONE, Mode.ON_DEMAND, SpotIn(0), SpotIn(1)]
    per_tick = list(itertools.product(options, repeat=workers))
    best = min(
        r.cost
        for plan in itertools.product(per_tick, repeat=ticks)
        if not (r := simulate_pools(pools, 0, cfg, _Scripted(plan))).missed
    )
    bound = pools_bound(pools, 0, cfg)
    assert bound.cost <= best + 1e-9
    # not the trivial bound: Spot in the pools makes it cheaper than on-demand only
    assert bound.cost < cfg.price_ratio * (cfg.work_h + cfg.changeover_h)


def test_pools_must_share_the_tick() -> None:
    cfg = SimConfig(work_h=1.0, deadline_h=2.0)
    pools = [SimPool(Trace("a", 600.0, (1, 1))), SimPool(Trace("b", 300.0, (1, 1)))]
    with pytest.raises(ValueError, match="share one tick length"):
        pools_bound(pools, 0, cfg)
