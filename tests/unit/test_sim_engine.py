"""Simulator accounting and each policy's decisions on hand-made traces."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim.engine import Mode, SimConfig, View, on_demand_makespan, simulate
from airflow_deadline_batch.sim.omniscient import exact_optimum, lower_bound, relaxation_bound
from airflow_deadline_batch.sim.policies import POLICIES, Greedy, OnDemand, SlackAware, UniformProgress
from airflow_deadline_batch.sim.traces import (
    Trace,
    constant,
    flapping,
    from_segments,
    gang,
    multi_gpu_suite,
    regime_switching,
)

CFG = SimConfig(work_h=4.0, deadline_h=8.0, workers=1, changeover_h=0.1, price_ratio=3.0, shard_h=0.25)
ONLINE = [OnDemand, Greedy, UniformProgress, SlackAware]


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize(
    "trace", [constant(0, 20), constant(16, 20), flapping(3, hours=20)], ids=["zero", "full", "flapping"]
)
def test_on_demand_cost_is_exactly_work_plus_one_changeover_per_worker(workers: int, trace: Trace) -> None:
    cfg = SimConfig(
        work_h=8.0, deadline_h=10.0, workers=workers, changeover_h=0.2, price_ratio=3.0, shard_h=0.5
    )
    result = simulate(trace, 0, cfg, OnDemand())
    assert result.cost == pytest.approx((8.0 + workers * 0.2) * 3.0, rel=1e-12)
    assert result.finish_h == pytest.approx(on_demand_makespan(cfg))
    assert not result.missed and result.spot_hours == 0


@pytest.mark.parametrize("policy", ONLINE)
@pytest.mark.parametrize("seed", [1, 2])
def test_work_is_conserved_and_cost_is_price_times_time(policy: type, seed: int) -> None:
    trace = regime_switching(seed, hours=40, mean_up_h=1.0, mean_down_h=1.0)
    cfg = SimConfig(work_h=6.0, deadline_h=9.0, workers=2, changeover_h=0.1, price_ratio=3.0, shard_h=0.5)
    r = simulate(trace, 0, cfg, policy())
    assert r.work_done_h == pytest.approx(cfg.work_h)
    assert r.cost == pytest.approx(r.spot_hours + 3.0 * r.on_demand_hours)
    # every billed hour is a changeover, committed work or destroyed (redone) work
    billed = r.spot_hours + r.on_demand_hours
    assert billed == pytest.approx(r.work_done_h + r.redone_hours + r.changeover_hours)
    assert r.changeover_hours <= r.starts * 0.1 + 1e-9


def test_full_spot_runs_on_spot_only_for_every_spot_policy() -> None:
    for policy in (Greedy, UniformProgress, SlackAware):
        r = simulate(constant(1, 20), 0, CFG, policy())
        assert r.on_demand_hours == 0, policy.name
        assert r.cost == pytest.approx(4.1)
        assert r.preemptions == 0


def test_zero_spot_greedy_waits_then_goes_on_demand_for_good_just_in_time() -> None:
    r = simulate(constant(0, 20, gap_s=360), 0, CFG, Greedy())
    assert r.spot_hours == 0 and not r.missed
    assert r.starts == 1
    assert CFG.deadline_h - 0.1 - r.finish_h < 0.1 + 1e-9  # started within a tick of the last moment


def test_zero_spot_uniform_progress_follows_the_line_from_the_start() -> None:
    r = simulate(constant(0, 20, gap_s=360), 0, CFG, UniformProgress(), record=True)
    assert r.switches[0][2] == "on_demand" and r.switches[0][0] == pytest.approx(0.1)
    assert not r.missed


def test_drop_near_the_deadline_preempts_and_every_policy_still_finishes() -> None:
    # Spot for 3.9 h, then nothing: the last shard is lost, the safety net must save the deadline.
    trace = from_segments([(3.9, 1), (20, 0)], gap_s=300)
    cfg = SimConfig(work_h=4.0, deadline_h=4.6, workers=1, changeover_h=0.1, price_ratio=3.0, shard_h=0.5)
    for policy in (Greedy, UniformProgress, SlackAware):
        r = simulate(trace, 0, cfg, policy())
        assert not r.missed, policy.name
        assert r.on_demand_hours > 0, policy.name


def test_flapping_spot_costs_changeovers_and_more_than_on_demand_for_baselines() -> None:
    trace = flapping(11, hours=60, gap_s=60, p_up=0.5, mean_spell_ticks=3)
    cfg = SimConfig(work_h=4.0, deadline_h=6.0, workers=1, changeover_h=0.1, price_ratio=3.0, shard_h=0.25)
    greedy = simulate(trace, 0, cfg, Greedy())
    ours = simulate(trace, 0, cfg, SlackAware())
    assert greedy.starts > 5
    up = simulate(trace, 0, cfg, UniformProgress())
    on_demand = simulate(trace, 0, cfg, OnDemand())
    assert greedy.cost > on_demand.cost  # Spot runs shorter than a changeover are worse than none
    # Uniform Progress (sticky on-demand, as in the authors' code) is hard to beat on flapping
    # capacity; ours stays within 2 % of it (known weakness: both cost more than on-demand here)
    assert ours.cost <= 1.02 * up.cost
    assert not ours.missed and not greedy.missed


def test_preemption_destroys_only_the_uncommitted_part_of_the_shard() -> None:
    # 0.1 h changeover + 0.4 h of a 0.5 h shard, then capacity vanishes for good.
    trace = from_segments([(0.5, 1), (10, 0)], gap_s=360)
    cfg = SimConfig(work_h=2.0, deadline_h=8.0, workers=1, changeover_h=0.1, price_ratio=3.0, shard_h=0.5)
    r = simulate(trace, 0, cfg, Greedy())
    assert r.preemptions == 1
    assert r.redone_hours == pytest.approx(0.4)
    assert r.spot_hours == pytest.approx(0.5)


def test_omniscient_is_a_lower_bound_of_every_policy() -> None:
    trace = regime_switching(5, hours=200, mean_up_h=3.0, mean_down_h=2.0)
    cfg = SimConfig(work_h=8.0, deadline_h=11.0, workers=1, changeover_h=0.2, price_ratio=3.0, shard_h=0.25)
    for tick in range(0, 2000, 250):
        bound = lower_bound(trace, tick, cfg).cost
        for policy in ONLINE:
            assert simulate(trace, tick, cfg, policy()).cost >= bound - 1e-9


def test_registry_names_match_policies() -> None:
    assert {name: cls.name for name, cls in POLICIES.items()} == {name: name for name in POLICIES}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    work=st.floats(0.5, 6.0),
    extra=st.floats(0.0, 4.0),
    workers=st.integers(1, 3),
    d=st.sampled_from([0.05, 0.1, 0.2]),
    shard=st.sampled_from([0.1, 0.25, 0.5]),
    gap=st.sampled_from([60.0, 300.0, 600.0]),
    kind=st.sampled_from(["regime", "flap"]),
)
def test_safety_net_never_misses_a_deadline_feasible_on_demand(
    seed: int, work: float, extra: float, workers: int, d: float, shard: float, gap: float, kind: str
) -> None:
    base = SimConfig(work_h=work, deadline_h=1.0, workers=workers, changeover_h=d, shard_h=shard)
    cfg = SimConfig(
        work_h=work,
        deadline_h=on_demand_makespan(base) + extra,
        workers=workers,
        changeover_h=d,
        shard_h=shard,
    )
    assert cfg.on_demand_feasible()
    if kind == "regime":
        trace = regime_switching(seed, hours=30, gap_s=gap, capacity=workers, mean_up_h=0.7, mean_down_h=0.7)
    else:
        trace = flapping(seed, hours=30, gap_s=gap, capacity=workers)
    for policy in (Greedy, SlackAware, UniformProgress):
        r = simulate(trace, seed % 50, cfg, policy())
        assert not r.missed, (policy.name, r.finish_h, cfg.deadline_h)


class _Scripted:
    """A policy that plays a fixed list of modes, one per tick (to enumerate every schedule)."""

    name = "scripted"

    def __init__(self, plan: tuple[Mode, ...]) -> None:
        self.plan = plan

    def reset(self, config: SimConfig, gap_h: float) -> None:
        pass

    def decide(self, view: View) -> list[Mode]:
        return [self.plan[view.tick] if view.tick < len(self.plan) else Mode.ON_DEMAND]


@pytest.mark.parametrize(
    ("caps", "d", "shard"),
    [
        ((1, 1, 0, 1, 1, 1, 0), 0.1, 0.25),
        ((0, 1, 1, 1, 0, 1, 1), 0.2, 0.25),
        ((1, 0, 1, 0, 1, 1, 1), 0.1, 0.125),
        ((1, 1, 1, 1, 1, 1, 1), 0.2, 0.5),
    ],
)
def test_exact_optimum_equals_the_best_of_every_schedule(
    caps: tuple[int, ...], d: float, shard: float
) -> None:
    trace = Trace("hand", 600.0, caps)
    cfg = SimConfig(work_h=0.5, deadline_h=7 / 6, workers=1, changeover_h=d, price_ratio=3.0, shard_h=shard)
    best = min(
        r.cost
        for plan in itertools.product([Mode.NONE, Mode.SPOT, Mode.ON_DEMAND], repeat=len(caps))
        if not (r := simulate(trace, 0, cfg, _Scripted(plan))).missed
    )
    exact = exact_optimum(trace, 0, cfg)
    assert exact.exact and exact.cost == pytest.approx(best, abs=1e-9)
    assert relaxation_bound(trace, 0, cfg).cost <= exact.cost + 1e-9


def test_relaxation_bound_is_below_every_policy_with_several_workers() -> None:
    trace = regime_switching(8, hours=200, capacity=3, mean_up_h=2.0, mean_down_h=2.0)
    cfg = SimConfig(work_h=12.0, deadline_h=6.0, workers=3, changeover_h=0.2, price_ratio=3.0, shard_h=0.25)
    for tick in range(0, 2000, 400):
        bound = relaxation_bound(trace, tick, cfg).cost
        for policy in ONLINE:
            assert simulate(trace, tick, cfg, policy()).cost >= bound - 1e-9


def test_multi_gpu_suite_has_all_or_nothing_and_partial_capacity() -> None:
    suite = multi_gpu_suite(3, capacity=4)
    assert len({t.name for t in suite}) == len(suite)
    for trace in suite:
        assert set(trace.capacity) <= set(range(5))
        assert 0 in trace.capacity and 4 in trace.capacity
    assert any(0 < c < 4 for t in suite for c in t.capacity)
    assert set(gang(1, 4, all_or_nothing=1.0).capacity) == {0, 4}
    assert gang(1, 4) == gang(1, 4)  # seeded


def test_slack_aware_keeps_a_running_on_demand_shard_through_a_short_spot_blip() -> None:
    # Outage, then one 10-minute Spot tick in the middle of on-demand work, then outage again.
    trace = from_segments([(1.0, 0), (1 / 6, 1), (6.0, 0), (10.0, 1)], gap_s=600.0)
    cfg = SimConfig(work_h=3.0, deadline_h=5.0, changeover_h=0.2)
    result = simulate(trace, 0, cfg, SlackAware())
    assert not result.missed
    assert result.spot_hours == 0.0  # the blip does not repay throwing away the on-demand shard
    assert result.redone_hours == 0.0
    eager = simulate(trace, 0, cfg, SlackAware(PolicyParams(switch_run_factor=0.0)))
    assert eager.spot_hours > 0 and eager.redone_hours > 0 and eager.cost > result.cost
