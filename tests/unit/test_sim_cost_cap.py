"""The cost cap: with ``PolicyParams.cost_cap = c`` slack_aware never costs more than on-demand only
plus ``c`` × its cost, on any trace (docs/simulator.md, *Never dearer than on-demand*)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim.engine import SimConfig, on_demand_makespan, simulate
from airflow_deadline_batch.sim.policies import OnDemand, SlackAware
from airflow_deadline_batch.sim.traces import Trace, flapping, multi_gpu_suite


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Trace, SimConfig]:
    workers = draw(st.integers(1, 4))
    work = draw(st.floats(0.5, 8.0))
    shard = max(draw(st.sampled_from([1 / 60, 0.1, 0.25, 0.5])), work / 150)
    d = draw(st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.5]))
    base = SimConfig(work_h=work, deadline_h=1.0, workers=workers, changeover_h=d, shard_h=shard)
    cfg = SimConfig(
        work_h=work,
        deadline_h=on_demand_makespan(base) + draw(st.floats(0.0, 8.0)),
        workers=workers,
        changeover_h=d,
        shard_h=shard,
        price_ratio=draw(st.sampled_from([1.5, 3.0, 3.1446, 6.0])),
    )
    spells = draw(st.lists(st.tuples(st.integers(0, workers), st.integers(1, 30)), min_size=1, max_size=12))
    gap = draw(st.sampled_from([60.0, 195.0, 300.0, 600.0, 3600.0]))
    return Trace("random", gap, tuple(c for c, n in spells for _ in range(n))), cfg


def _bound(trace: Trace, cfg: SimConfig, cap: float) -> float:
    on_demand = simulate(trace, 0, cfg, OnDemand()).cost
    return on_demand + cap * cfg.price_ratio * (cfg.work_h + cfg.workers * cfg.changeover_h)


def test_the_cost_cap_with_fewer_shards_than_workers() -> None:
    # a worker with nothing to pull was credited a changeover on-demand only never pays: the cap
    # spent it on Spot (0.892 > 0.825); the room now subtracts the changeovers of idle workers
    trace = Trace("random", 60.0, (1,))
    cfg = SimConfig(work_h=0.5, deadline_h=1.55, workers=2, changeover_h=0.05, price_ratio=1.5, shard_h=0.5)
    result = simulate(trace, 0, cfg, SlackAware(PolicyParams(cost_cap=0.0)))
    assert result.cost <= _bound(trace, cfg, 0.0) + 1e-9, (result.cost, _bound(trace, cfg, 0.0))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), cap=st.sampled_from([0.0, 0.01, 0.05]), start=st.integers(0, 300))
def test_the_cost_cap_holds_on_any_trace(scenario: tuple[Trace, SimConfig], cap: float, start: int) -> None:
    trace, cfg = scenario
    result = simulate(trace, start % len(trace.capacity), cfg, SlackAware(PolicyParams(cost_cap=cap)))
    assert not result.missed
    assert result.cost <= _bound(trace, cfg, cap) + 1e-9, (result.cost, _bound(trace, cfg, cap))


@pytest.mark.parametrize("deadline", [30.0, 40.0])
def test_the_cap_keeps_a_scarce_eight_gpu_job_within_one_percent_of_on_demand(deadline: float) -> None:
    # issue 13's shape (W = 192 GPU-h, N = 8, d = 0.2 h, k = 3): without the cap some starts cost
    # up to 1.013 x on-demand only on this synthetic trace
    trace = multi_gpu_suite(900, capacity=8)[4]
    cfg = SimConfig(work_h=192, deadline_h=deadline, workers=8, changeover_h=0.2, price_ratio=3.0)
    for start in (516, 1100, 3682):
        result = simulate(trace, start, cfg, SlackAware(PolicyParams(cost_cap=0.01)))
        assert not result.missed
        assert result.cost <= 1.01 * (192 + 8 * 0.2) * 3.0 + 1e-9


@pytest.mark.parametrize("trace", [flapping(3, hours=40), Trace("blink", 300.0, (1, 1, 0, 0) * 200)])
def test_spells_shorter_than_a_try_cost_more_than_on_demand_without_the_cap_only(trace: Trace) -> None:
    # 10-minute Spot spells against a 0.2 h changeover: every try is wasted until the storm rule
    cfg = SimConfig(work_h=4.0, deadline_h=12.0, changeover_h=0.2, shard_h=0.25)
    on_demand = simulate(trace, 0, cfg, OnDemand()).cost
    # off by default: the first tries go by the prior spell length (1 h) until the posterior and
    # the storm rule learn the short spells (1.016 and 1.079 x on-demand here)
    assert simulate(trace, 0, cfg, SlackAware()).cost > on_demand
    assert simulate(trace, 0, cfg, SlackAware(PolicyParams(cost_cap=0.01))).cost <= 1.01 * on_demand
    assert simulate(trace, 0, cfg, SlackAware(PolicyParams(cost_cap=0.0))).cost == pytest.approx(on_demand)
