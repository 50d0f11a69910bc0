"""Unit tests of the placement rule: safety, escalation, mixing, hysteresis, timeouts."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.placement import (
    MIN_STARTUP_TIMEOUT_S,
    JobSnapshot,
    PlacementDecision,
    PolicyParams,
    choose_pool,
    cost_room_s,
    line_slack_s,
    od_need_s,
    spot_risk_s,
    spot_waste_s,
    up_lead_s,
)
from airflow_deadline_batch.core.pools import PoolKind

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
    )
    values.update(overrides)
    return JobSnapshot(**values)  # type: ignore[arg-type]


def test_plenty_of_slack_and_spot_available_goes_to_spot() -> None:
    decision = choose_pool(snap())
    assert decision.pool is PoolKind.SPOT
    assert decision.slack_s == pytest.approx(10 * H - 4.1 * H)
    assert decision.last_safe_spot_start is not None
    assert decision.last_safe_spot_start > NOW
    assert "slack" in decision.reason


def test_no_slack_for_a_spot_try_escalates_to_on_demand() -> None:
    # 4 h of work, 0.1 h changeover: 4.1 h on-demand; a Spot try risks 0.35 h more.
    decision = choose_pool(snap(deadline=NOW + dt.timedelta(hours=4.3)))
    assert decision.pool is PoolKind.ON_DEMAND
    assert decision.last_safe_spot_start is None


def test_spot_missing_and_expected_capacity_short_escalates_with_the_rate_rule() -> None:
    # Needs 4 h of work in 5 h: 0.8 workers, prior availability 0.5 x 0.8 expects 0.4.
    policy = PolicyParams(rate_rule=True, availability_discount=0.8)
    decision = choose_pool(snap(deadline=NOW + dt.timedelta(hours=5), spot_available=False), policy)
    assert decision.pool is PoolKind.ON_DEMAND


def test_spot_missing_escalates_when_slack_reaches_the_reserve() -> None:
    # 4 h work, 0.1 h changeover: reserve 6 x 0.1 + 0.10 x 4 = 1.0 h on top of 0.35 h of risk.
    waits = choose_pool(snap(deadline=NOW + dt.timedelta(hours=5.5), spot_available=False))
    escalates = choose_pool(snap(deadline=NOW + dt.timedelta(hours=5.4), spot_available=False))
    assert (waits.pool, escalates.pool) == (PoolKind.SPOT, PoolKind.ON_DEMAND)


def test_short_lived_spot_is_not_worth_a_fresh_start() -> None:
    kwargs = dict(spot_available=True, spot_mean_run_s=0.1 * H)
    assert choose_pool(snap(**kwargs)).pool is PoolKind.SPOT  # plenty of slack: wait for better
    late = choose_pool(snap(**kwargs, deadline=NOW + dt.timedelta(hours=4.6)))
    assert late.pool is PoolKind.ON_DEMAND
    assert "Spot is missing" in late.reason


def test_spot_missing_with_high_observed_availability_waits() -> None:
    decision = choose_pool(
        snap(deadline=NOW + dt.timedelta(hours=6), spot_available=False, spot_availability=1.0)
    )
    assert decision.pool is PoolKind.SPOT
    assert decision.startup_timeout_s >= MIN_STARTUP_TIMEOUT_S


def test_mixing_adds_on_demand_workers_only_until_expected_capacity_suffices() -> None:
    # 4 workers, 20 h of work left in 10 h: about 2.1 workers' worth needed; each Spot worker is
    # expected to deliver 0.25 x 0.8 = 0.2 of a worker.
    base = dict(remaining_work_s=20 * H, parallelism=4, spot_available=False, spot_availability=0.25)
    policy = PolicyParams(rate_rule=True, availability_discount=0.8)
    assert choose_pool(snap(**base, on_demand_workers=0), policy).pool is PoolKind.ON_DEMAND
    assert choose_pool(snap(**base, on_demand_workers=1), policy).pool is PoolKind.ON_DEMAND
    assert choose_pool(snap(**base, on_demand_workers=2), policy).pool is PoolKind.SPOT


def test_hysteresis_keeps_a_running_on_demand_try_near_the_threshold() -> None:
    # Slack 0.5 h; a fresh Spot try needs 0.35 h, coming back from on-demand needs 0.2 h more.
    kwargs = dict(deadline=NOW + dt.timedelta(hours=1.6), remaining_work_s=1 * H)
    fresh = choose_pool(snap(**kwargs))
    held = choose_pool(snap(**kwargs, previous_pool=PoolKind.ON_DEMAND, running=True))
    assert fresh.pool is PoolKind.SPOT
    assert held.pool is PoolKind.ON_DEMAND


def test_a_running_on_demand_try_moves_to_spot_only_when_spot_runs_repay_the_switch() -> None:
    # 0.1 h changeover + 0.2 h of uncommitted work thrown away: Spot must run 2.5 x 0.3 h = 0.75 h.
    kwargs = dict(previous_pool=PoolKind.ON_DEMAND, running=True, running_progress_s=0.2 * H)
    short = choose_pool(snap(**kwargs, spot_mean_run_s=0.5 * H))
    long = choose_pool(snap(**kwargs, spot_mean_run_s=1.0 * H))
    fresh = choose_pool(
        snap(running_progress_s=0.0, previous_pool=PoolKind.ON_DEMAND, running=True, spot_mean_run_s=0.5 * H)
    )
    assert short.pool is PoolKind.ON_DEMAND
    assert "repay" in short.reason
    assert long.pool is PoolKind.SPOT
    assert fresh.pool is PoolKind.SPOT  # only the changeover is thrown away: 0.25 h suffices
    assert (
        choose_pool(snap(**kwargs, spot_mean_run_s=0.5 * H), PolicyParams(switch_run_factor=0)).pool
        is PoolKind.SPOT
    )


def test_line_slack_spends_the_initial_slack_uniformly_and_is_off_without_the_job_start() -> None:
    start = NOW - dt.timedelta(hours=5)
    # Window 10 h, 8 h of work on 1 worker, 0.1 h changeover: initial slack 1.9 h, half left now.
    line = line_slack_s(snap(deadline=NOW + dt.timedelta(hours=5), started_at=start, total_work_s=8 * H))
    assert line == pytest.approx(0.95 * H)
    assert line_slack_s(snap(total_work_s=8 * H)) == 0.0
    assert line_slack_s(snap(started_at=start)) == 0.0


def test_the_waiting_reserve_is_capped_by_the_line_so_a_tight_job_can_wait_at_its_start() -> None:
    # 8 h of work in 10 h, d = 0.2 h: slack 1.8 h; the plain reserve 6 d + 10 % of 8 h = 2.0 h is
    # above it, so without the cap the job goes on-demand at its very start.
    kwargs = dict(
        deadline=NOW + dt.timedelta(hours=10),
        remaining_work_s=8 * H,
        changeover_s=0.2 * H,
        spot_available=False,
    )
    policy = PolicyParams(decision_interval_s=600)
    uncapped = choose_pool(snap(**kwargs), policy)
    capped = choose_pool(snap(**kwargs, started_at=NOW, total_work_s=8 * H), policy)
    assert uncapped.pool is PoolKind.ON_DEMAND
    assert capped.pool is PoolKind.SPOT  # wait: reserve 0.8 x 1.8 h = 1.44 h < slack 1.8 h - risk
    late = choose_pool(
        snap(
            **{**kwargs, "deadline": NOW + dt.timedelta(hours=8.9)},
            started_at=NOW - dt.timedelta(hours=1.1),
            total_work_s=8 * H,
        ),
        policy,
    )
    assert late.pool is PoolKind.ON_DEMAND  # slack 0.7 h is under the line's reserve plus the tick


def test_re_deciding_every_tick_puts_only_one_tick_at_risk() -> None:
    policy = PolicyParams(decision_interval_s=300)
    kwargs = dict(deadline=NOW + dt.timedelta(hours=4.25), shard_work_s=1 * H)  # slack 540 s
    assert choose_pool(snap(**kwargs)).pool is PoolKind.ON_DEMAND  # decided once: 1.1 h at risk
    assert choose_pool(snap(**kwargs), policy).pool is PoolKind.SPOT
    tight = dict(deadline=NOW + dt.timedelta(hours=4.18), shard_work_s=1 * H)  # slack 288 s
    kept = choose_pool(snap(**tight, previous_pool=PoolKind.SPOT, running=True), policy)
    assert kept.pool is PoolKind.ON_DEMAND


def test_notice_reduces_the_work_at_risk_and_sets_the_grace_period() -> None:
    kwargs = dict(deadline=NOW + dt.timedelta(hours=4.4), shard_work_s=0.5 * H)
    assert choose_pool(snap(**kwargs)).pool is PoolKind.ON_DEMAND
    with_notice = choose_pool(snap(**kwargs, notice_s=0.4 * H))
    assert with_notice.pool is PoolKind.SPOT
    assert with_notice.grace_period_s == int(0.4 * H)
    assert choose_pool(snap()).grace_period_s > 0


def test_od_need_includes_list_scheduling_imbalance() -> None:
    s = snap(remaining_work_s=8 * H, parallelism=4, shard_work_s=1 * H)
    assert od_need_s(s) == pytest.approx(0.1 * H + 2 * H + 0.75 * H)


def test_naive_datetimes_and_bad_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        snap(now=dt.datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="parallelism"):
        snap(parallelism=0)
    with pytest.raises(ValueError, match="remaining_work_s"):
        snap(remaining_work_s=-1.0)


def test_past_deadline_goes_on_demand_with_minimum_timeout() -> None:
    decision = choose_pool(snap(deadline=NOW - dt.timedelta(hours=1)))
    assert decision.pool is PoolKind.ON_DEMAND
    assert decision.slack_s < 0
    assert decision.startup_timeout_s == MIN_STARTUP_TIMEOUT_S


def test_a_try_closer_to_the_last_safe_spot_start_than_a_pods_shortest_wait_goes_on_demand() -> None:
    # 4 h of work, 0.1 h changeover: on-demand needs 4.1 h, a fresh Spot try risks 0.35 h more
    # (changeover + one shard); the room to wait for Spot is what is left of the deadline
    def at_room(room_s: float, policy: PolicyParams | None = None) -> PlacementDecision:
        deadline = NOW + dt.timedelta(seconds=4.45 * H + room_s)
        return choose_pool(snap(deadline=deadline), policy or PolicyParams())

    close = at_room(MIN_STARTUP_TIMEOUT_S - 10)
    assert close.pool is PoolKind.ON_DEMAND and close.last_safe_spot_start is None
    assert "shortest wait for capacity" in close.reason
    roomy = at_room(MIN_STARTUP_TIMEOUT_S + 10)
    assert roomy.pool is PoolKind.SPOT
    assert roomy.last_safe_spot_start is not None
    # the pod's wait (its startup timeout) ends by the last safe Spot start
    assert NOW + dt.timedelta(seconds=roomy.startup_timeout_s) <= roomy.last_safe_spot_start
    # the simulator re-decides every tick and its waiting is cut at the last safe start: unchanged
    assert at_room(MIN_STARTUP_TIMEOUT_S - 10, PolicyParams(decision_interval_s=30)).pool is PoolKind.SPOT


@settings(max_examples=200, deadline=None)
@given(
    work_h=st.floats(0.0, 50.0),
    left_h=st.floats(0.0, 60.0),
    shard_h=st.floats(0.0, 2.0),
    d_h=st.floats(0.0, 0.5),
    p=st.integers(1, 16),
    available=st.booleans(),
    prev=st.sampled_from([None, PoolKind.SPOT, PoolKind.ON_DEMAND]),
    running=st.booleans(),
    avail=st.none() | st.floats(0.0, 1.0),
)
def test_a_spot_decision_always_leaves_room_to_finish_on_demand(
    work_h: float,
    left_h: float,
    shard_h: float,
    d_h: float,
    p: int,
    available: bool,
    prev: PoolKind | None,
    running: bool,
    avail: float | None,
) -> None:
    s = snap(
        deadline=NOW + dt.timedelta(hours=left_h),
        remaining_work_s=work_h * H,
        shard_work_s=shard_h * H,
        changeover_s=d_h * H,
        parallelism=p,
        spot_available=available,
        previous_pool=prev,
        running=running,
        spot_availability=avail,
    )
    decision = choose_pool(s)
    if decision.pool is PoolKind.SPOT:
        # Even if the try burns its changeover and loses its whole shard, on-demand still makes it.
        assert decision.last_safe_spot_start is not None
        worst = (0.0 if running and prev is PoolKind.SPOT else d_h * H) + shard_h * H
        assert left_h * H - worst >= od_need_s(s) - 1e-6
    assert decision.startup_timeout_s >= MIN_STARTUP_TIMEOUT_S


def test_risk_is_what_a_choice_can_burn_before_the_next_decision() -> None:
    tick = PolicyParams(decision_interval_s=600)
    one_minute = dict(shard_work_s=60.0, changeover_s=0.2 * H)
    # waiting for missing Spot burns the whole tick, however small the shard
    assert spot_risk_s(snap(**one_minute, spot_available=False), tick) == 600
    # a fresh Spot try with capacity: its changeover plus one shard, at most one tick
    assert spot_risk_s(snap(**one_minute), tick) == 600
    assert spot_risk_s(snap(shard_work_s=60.0, changeover_s=60.0), tick) == 120
    # a running Spot try still in its changeover risks what is left of it, not just the shard
    running = dict(one_minute, previous_pool=PoolKind.SPOT, running=True)
    assert spot_risk_s(snap(**running, changeover_left_s=300.0), tick) == 360
    assert spot_risk_s(snap(**running, changeover_left_s=0.0), tick) == 60
    assert spot_risk_s(snap(**running), tick) == 600  # unknown: the whole changeover is ahead
    assert spot_risk_s(snap(**running, changeover_left_s=300.0)) == 360  # decided once per try
    # several workers: only the whole tick bounds what the job's slack loses
    assert spot_risk_s(snap(shard_work_s=60.0, changeover_s=60.0, parallelism=2), tick) == 600


def test_the_cost_cap_takes_spot_only_while_its_worst_waste_fits_the_room() -> None:
    cap = PolicyParams(cost_cap=0.01, decision_interval_s=600, cap_holds=False)
    # on-demand only: 3 x (4 h + 0.1 h) = 12.3 Spot-h; 1 % of it is 0.123 Spot-h = 442.8 s of room
    costed = dict(price_ratio=3.0, total_work_s=4 * H)
    assert cost_room_s(snap(**costed, cost_excess_s=0.0), cap) == pytest.approx(442.8)
    assert cost_room_s(snap(**costed, cost_excess_s=0.0)) is None  # off by default
    assert cost_room_s(snap(total_work_s=4 * H, cost_excess_s=0.0), cap) is None  # price unknown
    # a fresh try (0.1 h changeover + 0.25 h shard) wastes up to a whole tick, 600 s > 442.8 s
    assert choose_pool(snap(**costed, cost_excess_s=0.0), cap).pool is PoolKind.ON_DEMAND
    small = dict(costed, shard_work_s=60.0, changeover_s=120.0)  # a try wastes 180 s at most
    assert spot_waste_s(snap(**small, cost_excess_s=0.0), cap) == 180
    assert choose_pool(snap(**small, cost_excess_s=0.0), cap).pool is PoolKind.SPOT
    assert choose_pool(snap(**small, cost_excess_s=300.0), cap).pool is PoolKind.ON_DEMAND
    # two other workers on Spot: their worst waste counts too
    assert spot_waste_s(snap(**small, spot_workers=2), cap) == 540
    # leaving a running on-demand try throws its progress away at on-demand price
    moving = dict(small, previous_pool=PoolKind.ON_DEMAND, running=True, running_progress_s=50.0)
    assert spot_waste_s(snap(**moving), cap) == 180 + 3 * 50


def test_the_cost_cap_holds_a_worker_instead_of_buying_on_demand_while_slack_is_above_the_reserve() -> None:
    cap = PolicyParams(cost_cap=0.01, decision_interval_s=600)
    assert cap.cap_holds  # the default
    # a fresh try wastes up to 600 s, the room is 442.8 s: the cap blocks it; slack 5.9 h is far
    # above the reserve (6 x 0.1 h + 10 % of 4 h = 1 h) plus the tick, so the worker holds (free)
    blocked = dict(price_ratio=3.0, total_work_s=4 * H, cost_excess_s=0.0)
    decision = choose_pool(snap(**blocked), cap)
    assert (decision.pool, decision.hold) == (PoolKind.SPOT, True)
    assert "hold" in decision.reason
    # a Spot try the cap allows is a real try, never a hold
    allowed = choose_pool(snap(**blocked, shard_work_s=60.0, changeover_s=120.0), cap)
    assert (allowed.pool, allowed.hold) == (PoolKind.SPOT, False)
    # slack under the reserve plus the tick: on-demand, as without holds (slack 1.1 h here)
    tight = choose_pool(snap(**blocked, deadline=NOW + dt.timedelta(hours=5.2)), cap)
    assert (tight.pool, tight.hold) == (PoolKind.ON_DEMAND, False)
    # a running on-demand try is kept (holding would throw its progress away)
    od = dict(blocked, previous_pool=PoolKind.ON_DEMAND, running=True, running_progress_s=50.0)
    assert choose_pool(snap(**od), cap).pool is PoolKind.ON_DEMAND
    # a running Spot try the cap stops is held, not moved to on-demand
    spot = dict(blocked, previous_pool=PoolKind.SPOT, running=True, changeover_left_s=0.0)
    spot["cost_excess_s"] = 400.0  # 42.8 s of room left, the try may waste a whole tick
    assert choose_pool(snap(**spot), cap).hold
    # without a decision interval (an operator decides once per try) nobody re-decides a hold
    once = PolicyParams(cost_cap=0.01)
    assert choose_pool(snap(**blocked), once).pool is PoolKind.ON_DEMAND
    assert not choose_pool(snap(**blocked), once).hold


def test_on_demand_tries_return_to_spot_in_doubling_rounds() -> None:
    # gang8-902 (docs/simulator.md, cap slice): all 8 workers left on-demand for Spot at once and
    # the gang was reclaimed within a tick, five times; with return_doubling one moves while no
    # other Spot try is proven past its changeover, then as many as have passed it
    rule = PolicyParams(return_doubling=True)
    moving = dict(
        parallelism=4,
        remaining_work_s=8 * H,
        previous_pool=PoolKind.ON_DEMAND,
        running=True,
        running_progress_s=60.0,
        spot_mean_run_s=10 * H,
    )
    assert choose_pool(snap(**moving), rule).pool is PoolKind.SPOT  # the first one moves
    one_starting = dict(moving, spot_workers=1, spot_workers_starting=1)
    decision = choose_pool(snap(**one_starting), rule)
    assert decision.pool is PoolKind.ON_DEMAND and "still starting" in decision.reason
    assert choose_pool(snap(**one_starting)).pool is PoolKind.SPOT  # off by default
    # fewer starting than proven past their changeover: one more moves (1, 1, 2, 4, ... per round)
    two_proven = dict(moving, spot_workers=3, spot_workers_starting=1)
    assert choose_pool(snap(**two_proven), rule).pool is PoolKind.SPOT
    one_proven = dict(moving, spot_workers=2, spot_workers_starting=1)
    assert choose_pool(snap(**one_proven), rule).pool is PoolKind.ON_DEMAND
    # a fresh start (nothing to throw away) is never held back by the rule
    fresh = dict(one_starting, previous_pool=None, running=False, running_progress_s=0.0)
    assert choose_pool(snap(**fresh), rule).pool is PoolKind.SPOT


def _late_in_the_window(**overrides: object) -> JobSnapshot:
    """18 h into a 20 h window of 16 h of work (``d`` = 0.1 h), re-decided every 10 minutes."""
    values: dict[str, object] = dict(
        now=NOW,
        deadline=NOW + dt.timedelta(hours=2),
        started_at=NOW - dt.timedelta(hours=18),
        total_work_s=16 * H,
    )
    values.update(overrides)
    return snap(**values)


def test_up_lead_is_committed_work_beyond_the_uniform_line() -> None:
    # the line is 16 h x 18 / 20 = 14.4 h; 14.4 h committed (1.6 h left) is exactly on it
    assert up_lead_s(_late_in_the_window(remaining_work_s=1.6 * H)) == pytest.approx(0.0, abs=1e-6)
    assert up_lead_s(_late_in_the_window(remaining_work_s=1.0 * H)) == pytest.approx(0.6 * H)
    # 0.2 h from now the line is 16 h x 18.2 / 20 = 14.56 h
    assert up_lead_s(_late_in_the_window(remaining_work_s=1.0 * H), 0.2 * H) == pytest.approx(0.44 * H)
    assert up_lead_s(snap()) is None  # no start / total work: unknown


def test_the_waiting_reserve_does_not_escalate_a_job_ahead_of_the_uniform_line_with_the_floor() -> None:
    # slack 0.3 h: above the tick (the risk of waiting), under the tick plus the reserve (0.8 x the
    # line slack, 0.31 h); on UP's line, where UP itself still waits
    tick = 600.0
    on_the_line = _late_in_the_window(remaining_work_s=1.6 * H, spot_available=False)
    default = choose_pool(on_the_line, PolicyParams(decision_interval_s=tick))
    assert default.pool is PoolKind.ON_DEMAND and "reserve" in default.reason
    floor = PolicyParams(decision_interval_s=tick, up_wait_floor=True)
    assert choose_pool(on_the_line, floor).pool is PoolKind.SPOT  # waits for Spot
    # behind the line: the reserve escalates as before
    behind = _late_in_the_window(remaining_work_s=1.65 * H, spot_available=False)
    assert choose_pool(behind, floor).pool is PoolKind.ON_DEMAND
    # the safety rule still decides the last safe moment: slack under the tick escalates
    # (19.5 h in, on the line: slack 0, under the tick)
    end = dict(deadline=NOW + dt.timedelta(hours=0.5), started_at=NOW - dt.timedelta(hours=19.5))
    last = _late_in_the_window(remaining_work_s=0.4 * H, spot_available=False, **end)
    assert up_lead_s(last) == pytest.approx(0.0, abs=1e-6)
    decision = choose_pool(last, floor)
    assert decision.pool is PoolKind.ON_DEMAND and "worst case" in decision.reason


def test_a_running_on_demand_try_returns_to_spot_where_uniform_progress_would_with_the_floor() -> None:
    # slack 0.46 h covers the tick (0.17 h) but not the return margin (2 d + 0.3 x 0.39 h line
    # slack); ahead of UP's line 2 d from now (14.56 h), where UP goes back to Spot
    tick = 600.0
    od = dict(previous_pool=PoolKind.ON_DEMAND, running=True, running_progress_s=60.0)
    ahead = _late_in_the_window(remaining_work_s=1.44 * H, **od)
    assert choose_pool(ahead, PolicyParams(decision_interval_s=tick)).pool is PoolKind.ON_DEMAND
    floor = PolicyParams(decision_interval_s=tick, up_return_floor=True)
    assert choose_pool(ahead, floor).pool is PoolKind.SPOT
    # just behind that line: the margin holds it on on-demand
    behind = _late_in_the_window(remaining_work_s=1.45 * H, **od)
    assert choose_pool(behind, floor).pool is PoolKind.ON_DEMAND
    # with Spot missing it stays on on-demand
    assert choose_pool(replace(ahead, spot_available=False), floor).pool is PoolKind.ON_DEMAND
