"""Several Spot pools: the decision names the pool with the lowest expected price per unit of work,
with the same safety rule against the on-demand fallback (docs/simulator.md, *Several Spot pools*)."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.placement import (
    JobSnapshot,
    PolicyParams,
    SpotOption,
    choose_pool,
    pick_spot_pool,
    spot_risk_s,
)
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.sim.engine import (
    Choice,
    Mode,
    SimConfig,
    SimPool,
    SpotIn,
    View,
    simulate,
    simulate_pools,
)
from airflow_deadline_batch.sim.policies import OnDemand, SlackAware
from airflow_deadline_batch.sim.traces import Trace, gang

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
H = 3600.0


def snap(**overrides: object) -> JobSnapshot:
    values: dict[str, object] = dict(
        now=NOW,
        deadline=NOW + dt.timedelta(hours=10),
        remaining_work_s=4 * H,
        shard_work_s=0.25 * H,
        parallelism=1,
        changeover_s=0.1 * H,
        price_ratio=3.0,
    )
    values.update(overrides)
    return JobSnapshot(**values)  # type: ignore[arg-type]


def test_one_spot_pool_keeps_the_single_pool_decision() -> None:
    decision = choose_pool(snap())
    assert decision.pool is PoolKind.SPOT and decision.spot_pool is None
    assert pick_spot_pool(snap()) is None


def test_the_decision_names_the_cheaper_available_pool() -> None:
    pools = (SpotOption(name="us-east-1a", price=1.0), SpotOption(name="us-west-2a", price=0.7))
    decision = choose_pool(snap(spot_pools=pools))
    assert (decision.pool, decision.spot_pool) == (PoolKind.SPOT, "us-west-2a")
    # the cheap pool has no capacity now: the other one
    gone = (pools[0], SpotOption(name="us-west-2a", price=0.7, available=False))
    assert choose_pool(snap(spot_pools=gone)).spot_pool == "us-east-1a"
    # a faster GPU type is cheaper per unit of work although dearer per hour
    fast = (SpotOption(name="v100", price=1.0), SpotOption(name="a100", price=1.6, speed=2.0))
    assert choose_pool(snap(spot_pools=fast)).spot_pool == "a100"
    # on-demand decisions name no Spot pool
    late = choose_pool(snap(spot_pools=pools, deadline=NOW + dt.timedelta(hours=4.2)))
    assert late.pool is PoolKind.ON_DEMAND and late.spot_pool is None


def test_observed_short_spells_make_a_cheap_pool_dearer_than_a_steady_one() -> None:
    pools = (
        SpotOption(name="cheap-flappy", price=0.6, mean_run_s=0.25 * H),
        SpotOption(name="steady", price=1.0, mean_run_s=10 * H),
    )
    assert choose_pool(snap(spot_pools=pools)).spot_pool == "steady"


def test_a_running_spot_try_keeps_its_pool() -> None:
    pools = (SpotOption(name="a", price=1.0), SpotOption(name="b", price=0.5))
    running = snap(
        spot_pools=pools, spot_pool="a", running=True, previous_pool=PoolKind.SPOT, changeover_left_s=0.0
    )
    assert choose_pool(running).spot_pool == "a"


def test_a_slow_pool_risks_more_than_a_fast_one() -> None:
    pools = (SpotOption(name="slow", speed=0.5), SpotOption(name="fast", speed=2.0))
    policy = PolicyParams(decision_interval_s=3600.0)
    slow = spot_risk_s(snap(spot_pools=pools, spot_pool="slow"), policy)
    fast = spot_risk_s(snap(spot_pools=pools, spot_pool="fast"), policy)
    assert slow > fast == pytest.approx(0.1 * H + 0.125 * H)


def test_option_validation() -> None:
    with pytest.raises(ValueError, match="price and speed"):
        SpotOption(name="x", price=0.0)
    with pytest.raises(ValueError, match="unique"):
        snap(spot_pools=(SpotOption(name="x"), SpotOption(name="x")))


class _CheapFirst(SlackAware):
    """slack_aware, asserting that no fresh Spot try goes to the dear pool (0) while the cheap
    pool (1), equally available, has a free GPU."""

    def decide(self, view: View) -> list[Choice]:
        choices = super().decide(view)
        free = [
            cap - sum(1 for s in view.slots if s.mode is Mode.SPOT and s.pool == j)
            for j, cap in enumerate(view.pool_capacities)
        ]
        for slot, choice in zip(view.slots, choices, strict=True):
            if isinstance(choice, SpotIn) and slot.mode is not Mode.SPOT:
                assert choice.pool == 1 or free[1] <= 0, (view.t_h, choices)
                free[choice.pool] -= 1
        return choices


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spells=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30)), min_size=1, max_size=10),
    cheap=st.sampled_from([0.3, 0.5, 0.8]),
    workers=st.integers(1, 3),
    start=st.integers(0, 200),
)
def test_with_two_equally_available_pools_the_job_runs_on_the_cheaper_one(
    spells: list[tuple[int, int]], cheap: float, workers: int, start: int
) -> None:
    capacity = tuple(c for c, n in spells for _ in range(n))
    dear, cheaper = Trace("dear", 300.0, capacity), Trace("cheap", 300.0, capacity)
    cfg = SimConfig(work_h=2.0 * workers, deadline_h=8.0, workers=workers, changeover_h=0.1)
    both = simulate_pools([SimPool(dear), SimPool(cheaper, price=cheap)], start, cfg, _CheapFirst())
    assert not both.missed
    if workers == 1:
        # one GPU is all it needs: every Spot try goes to the cheap pool, as if it were alone there
        alone = simulate(cheaper, start, cfg, SlackAware())
        assert both.cost == pytest.approx(cheap * alone.spot_hours + cfg.price_ratio * alone.on_demand_hours)


def test_a_slow_cheap_pool_near_the_deadline_does_not_cause_a_miss() -> None:
    # found by the multi-pool no-miss property: half speed burns slack beyond one shard per tick
    cfg = SimConfig(work_h=1.0, deadline_h=2.1, changeover_h=0.1, shard_h=1 / 150)
    pools = [SimPool(Trace("none", 195.0, (0,))), SimPool(Trace("slow", 195.0, (1,)), price=0.5, speed=0.5)]
    assert not simulate_pools(pools, 0, cfg, SlackAware()).missed


def test_two_pools_cost_less_than_the_better_single_pool_on_average() -> None:
    # issue 13's target, on two unseen synthetic 8-GPU traces of different price and availability
    a = gang(11, 8, mean_up_h=2.0, mean_down_h=2.0)
    b = gang(12, 8, mean_up_h=1.0, mean_down_h=3.0)
    cfg = SimConfig(work_h=32, deadline_h=10, workers=4, changeover_h=0.2)
    starts = range(0, 2000, 100)

    def mean(pools: list[SimPool]) -> float:
        return sum(simulate_pools(pools, t, cfg, SlackAware()).cost for t in starts) / len(starts)

    single = min(mean([SimPool(a)]), mean([SimPool(b, price=0.8)]))
    both = mean([SimPool(a), SimPool(b, price=0.8)])
    assert both < single
    assert both <= simulate(a, 0, cfg, OnDemand()).cost
