"""No avoidable miss: slack_aware meets every deadline that on-demand from the start meets.

The argument (docs/simulator.md, *Why it cannot miss*): at every decision either going on-demand
now still meets the deadline after the worst the current choice can burn before the next decision,
or every worker is on on-demand. :class:`_Checked` asserts that invariant at every tick from the
simulator's own state (independently of ``core.placement``), and the property test asserts its
consequence over random traces, ticks, shard sizes, changeovers and deadlines, with one Spot pool
or several (each its own trace, price and speed).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim.engine import (
    Choice,
    Mode,
    SimConfig,
    SimPool,
    Speculate,
    SpotIn,
    View,
    on_demand_makespan,
    simulate,
    simulate_pools,
)
from airflow_deadline_batch.sim.policies import POLICIES, SlackAware
from airflow_deadline_batch.sim.traces import Trace

EPS = 1e-9


def worst_burn_h(view: View, choices: list[Choice]) -> float:
    """The most slack this tick can burn, from the engine's rules (capacity holds for a tick).

    Slack counts committed work only, so it falls at most by the tick. With one worker on Spot with
    capacity (or on on-demand), by at most the changeover still to run plus one shard at the
    pool's speed.
    """
    cfg = view.config
    if cfg.workers > 1:
        return view.gap_h
    slot, choice = view.slots[0], choices[0]
    want = Mode.SPOT if isinstance(choice, SpotIn) else choice
    pool = choice.pool if isinstance(choice, SpotIn) else 0
    speed = view.pool_speeds[pool] if want is Mode.SPOT and view.pool_speeds else 1.0
    same = slot.mode is want and (want is not Mode.SPOT or slot.pool == pool)
    if want is Mode.SPOT and not same and view.pool_capacities[pool] == 0:
        return view.gap_h  # waiting for Spot
    if want is Mode.NONE and (slot.busy or view.pending_shards > 0):
        return view.gap_h  # held idle (the cost cap's hold) with work left: the whole tick
    changeover = slot.changeover_left_h if same else cfg.changeover_h
    first = changeover + cfg.shard_size_h / speed
    # after its first shard a pool slower than the reference commits less work than time passes
    return min(view.gap_h, first + max(0.0, 1.0 - speed) * max(0.0, view.gap_h - first))


def slack_h(view: View) -> float:
    """Time left minus the on-demand-from-now need (every worker restarts on on-demand now)."""
    cfg = view.config
    n = cfg.workers
    return view.time_left_h - (cfg.changeover_h + view.remaining_h / n + cfg.shard_size_h * (n - 1) / n)


class _Checked(SlackAware):
    """slack_aware, asserting the last-safe-decision invariant at every decision."""

    def decide(self, view: View) -> list[Choice]:
        modes = super().decide(view)
        # a Spot try raced by an on-demand duplicate of its shard (the tail race) is covered: the
        # duplicate is the on-demand fallback of that shard, started now or running already
        on_demand = [
            want is Mode.ON_DEMAND or (isinstance(want, Speculate) and want.choice is Mode.ON_DEMAND)
            for want in modes
        ]
        raced = {
            want.of for want, od in zip(modes, on_demand, strict=True) if od and isinstance(want, Speculate)
        }
        raced |= {i for i, slot in enumerate(view.slots) if slot.twin is not None and on_demand[slot.twin]}
        off_on_demand = any(
            not on_demand[i] and i not in raced and (slot.busy or view.pending_shards > 0)
            for i, slot in enumerate(view.slots)
        )
        if off_on_demand:
            slack = slack_h(view)
            burn = worst_burn_h(view, modes)
            assert slack - burn >= -EPS, (view.t_h, slack, burn, modes)
        return modes


TICKS_S = [15.0, 32.0, 60.0, 195.0, 300.0, 600.0, 3600.0]
SHARDS_H = [15 / 3600, 1 / 60, 0.1, 0.25, 0.5, 1.0]
CHANGEOVERS_H = [0.0, 0.02, 0.1, 0.2, 0.5]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Trace, SimConfig]:
    workers = draw(st.integers(1, 3))
    gap = draw(st.sampled_from(TICKS_S))
    work = draw(st.floats(0.25, 6.0))
    shard = max(draw(st.sampled_from(SHARDS_H)), work / 150)  # at most 150 shards: seconds per run
    d = draw(st.sampled_from(CHANGEOVERS_H))
    base = SimConfig(work_h=work, deadline_h=1.0, workers=workers, changeover_h=d, shard_h=shard)
    extra = draw(st.sampled_from([0.0, 1e-6]) | st.floats(0.0, 6.0))
    cfg = SimConfig(
        work_h=work,
        deadline_h=on_demand_makespan(base) + extra,
        workers=workers,
        changeover_h=d,
        shard_h=shard,
        price_ratio=3.0,
    )
    # spells of capacity 0..workers, each a random number of ticks (the trace repeats)
    return _random_trace(draw, workers, gap), cfg


def _random_trace(draw: st.DrawFn, workers: int, gap: float, name: str = "random") -> Trace:
    spells = draw(st.lists(st.tuples(st.integers(0, workers), st.integers(1, 40)), min_size=1, max_size=12))
    return Trace(name, gap, tuple(c for c, n in spells for _ in range(n)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), start=st.integers(0, 500))
@example(  # before the exact rule: two workers on partial capacity burned more than the risk allowed
    scenario=(
        Trace("one-of-two", 195.0, (1,)),
        SimConfig(work_h=2.0, deadline_h=2.0, workers=2, changeover_h=0.0, shard_h=0.2 / 15),
    ),
    start=0,
)
@example(  # the tail race: a Spot try raced by its on-demand duplicate at zero slack is covered
    scenario=(
        Trace("race-at-zero-slack", 15.0, (0,) + (1,) * 30),
        SimConfig(work_h=0.25, deadline_h=1.25, workers=3, changeover_h=0.0, shard_h=0.25),
    ),
    start=0,
)
def test_slack_aware_never_misses_a_deadline_on_demand_meets(
    scenario: tuple[Trace, SimConfig], start: int
) -> None:
    trace, cfg = scenario
    assert cfg.on_demand_feasible()
    result = simulate(trace, start % len(trace.capacity), cfg, _Checked())
    assert not result.missed, (result.finish_h, cfg.deadline_h)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), cap=st.sampled_from([0.0, 0.01, 0.05]), start=st.integers(0, 500))
def test_slack_aware_never_misses_with_the_cost_cap_holding_workers(
    scenario: tuple[Trace, SimConfig], cap: float, start: int
) -> None:
    # the cap's hold (PolicyParams.cap_holds) idles a worker for a tick: it burns the whole tick
    trace, cfg = scenario
    checked = _Checked(PolicyParams(cost_cap=cap, cap_holds=True))
    result = simulate(trace, start % len(trace.capacity), cfg, checked)
    assert not result.missed, (result.finish_h, cfg.deadline_h)


#: Uniform Progress as a floor (docs/simulator.md, *Sixth round*), alone, together, with the
#: gang's paced returns and with the cost cap: they only relax the reserve and the return margin
FLOORS = [
    PolicyParams(up_wait_floor=True),
    PolicyParams(up_return_floor=True),
    PolicyParams(up_wait_floor=True, up_return_floor=True, return_doubling=True),
    PolicyParams(up_wait_floor=True, up_return_floor=True, cost_cap=0.01),
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), params=st.sampled_from(FLOORS), start=st.integers(0, 500))
def test_slack_aware_never_misses_with_uniform_progress_as_a_floor(
    scenario: tuple[Trace, SimConfig], params: PolicyParams, start: int
) -> None:
    trace, cfg = scenario
    result = simulate(trace, start % len(trace.capacity), cfg, _Checked(params))
    assert not result.missed, (result.finish_h, cfg.deadline_h)


def _hourly(spot_hours: int) -> Trace:
    return Trace("spot-then-gone", 3600.0, (1,) * spot_hours + (0,) * 100)


@pytest.mark.parametrize("deadline", [52.0, 60.0])
@pytest.mark.parametrize("changeover", [0.1, 0.2])
def test_hourly_ticks_spot_for_48_h_then_gone_finishes_with_the_baselines(
    deadline: float, changeover: float
) -> None:
    # issue 13: slack_aware waited one tick too long (it charged a tick of waiting as d + shard)
    cfg = SimConfig(work_h=48, deadline_h=deadline, changeover_h=changeover, shard_h=0.25)
    finish = {name: simulate(_hourly(48), 0, cfg, cls()).finish_h for name, cls in POLICIES.items()}
    assert finish["slack_aware"] <= deadline
    assert finish["slack_aware"] == pytest.approx(finish["greedy"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), data=st.data(), start=st.integers(0, 500))
def test_slack_aware_never_misses_with_several_spot_pools(
    scenario: tuple[Trace, SimConfig], data: st.DataObject, start: int
) -> None:
    trace, cfg = scenario
    extra = data.draw(st.integers(1, 2))
    pools = [SimPool(trace)] + [
        SimPool(
            _random_trace(data.draw, cfg.workers, trace.gap_s, f"pool-{i}"),
            price=data.draw(st.sampled_from([0.5, 0.8, 1.0, 1.5])),
            speed=data.draw(st.sampled_from([0.5, 1.0, 1.5])),
        )
        for i in range(extra)
    ]
    result = simulate_pools(pools, start % len(trace.capacity), cfg, _Checked())
    assert not result.missed, (result.finish_h, cfg.deadline_h)
