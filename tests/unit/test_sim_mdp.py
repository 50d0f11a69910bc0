"""The research policy ``mdp`` (sim/mdp.py): no avoidable miss, and the table's choices.

The no-miss property is the one slack_aware is held to (tests/unit/test_sim_no_miss.py): at every
decision either on-demand from now still meets the deadline after the worst the choice can burn
before the next decision, or every worker is on on-demand; checked from the engine's own state.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.sim import traces
from airflow_deadline_batch.sim.engine import Choice, Mode, SimConfig, View, simulate
from airflow_deadline_batch.sim.mdp import IDLE, OD, SPOT, Grid, MarkovDecision, Rates, Table
from airflow_deadline_batch.sim.policies import OnDemand, make_policy
from airflow_deadline_batch.sim.traces import Trace
from airflow_deadline_batch.sim.tuning import main as tuning_main
from airflow_deadline_batch.sim.tuning import online_at
from tests.unit.test_sim_no_miss import scenarios, slack_h, worst_burn_h

EPS = 1e-9


class _Checked(MarkovDecision):
    """mdp, asserting the last-safe-decision invariant at every decision."""

    def decide(self, view: View) -> list[Choice]:
        modes = list(super().decide(view))
        off_on_demand = any(
            want is not Mode.ON_DEMAND and (slot.busy or view.pending_shards > 0)
            for want, slot in zip(modes, view.slots, strict=True)
        )
        if off_on_demand:
            assert slack_h(view) - worst_burn_h(view, modes) >= -EPS, (view.t_h, modes)
        return modes


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), start=st.integers(0, 500))
@example(  # two workers on one Spot GPU at zero slack (slack_aware's counterexample once)
    scenario=(
        Trace("one-of-two", 195.0, (1,)),
        SimConfig(work_h=2.0, deadline_h=2.0, workers=2, changeover_h=0.0, shard_h=0.2 / 15),
    ),
    start=0,
)
def test_mdp_never_misses_a_deadline_on_demand_meets(scenario: tuple[Trace, SimConfig], start: int) -> None:
    trace, cfg = scenario
    assert cfg.on_demand_feasible()
    result = simulate(trace, start % len(trace.capacity), cfg, _Checked())
    assert not result.missed, (result.finish_h, cfg.deadline_h)


@pytest.mark.parametrize("deadline", [52.0, 60.0])
def test_hourly_ticks_spot_for_48_h_then_gone_is_met(deadline: float) -> None:
    # issue 13's hourly trace: Spot for 48 h, then none
    trace = Trace("spot-then-gone", 3600.0, (1,) * 48 + (0,) * 100)
    cfg = SimConfig(work_h=48, deadline_h=deadline, changeover_h=0.2, shard_h=0.25)
    result = simulate(trace, 0, cfg, make_policy("mdp"))
    assert not result.missed and result.finish_h <= deadline


def _table(cfg: SimConfig, availability: float, run_h: float) -> tuple[Grid, Table]:
    grid = Grid.for_job(cfg, 300 / 3600)
    end = 1 / run_h
    rates = Rates.of(end, end * availability / (1 - availability), grid.step_h)
    return grid, Table(grid, cfg, rates, grid.steps)


def test_table_takes_long_lived_spot_and_keeps_it() -> None:
    cfg = SimConfig(work_h=8, deadline_h=12, changeover_h=0.1)
    grid, table = _table(cfg, availability=0.9, run_h=20.0)
    t, r = grid.steps, grid.shards
    assert table.action(t, 1, IDLE, r, 0) == SPOT
    assert table.action(t, 1, SPOT, r, grid.changeover_units + 1) == SPOT
    # on-demand running with plenty of time: long Spot spells repay the switch
    assert table.action(t, 1, OD, r, grid.changeover_units) == SPOT


def test_table_waits_for_spot_while_slack_lasts_then_goes_on_demand() -> None:
    cfg = SimConfig(work_h=8, deadline_h=12, changeover_h=0.1)
    grid, table = _table(cfg, availability=0.5, run_h=2.0)
    r = grid.shards
    assert table.action(grid.steps, 0, IDLE, r, 0) == IDLE  # 4 h of slack: Spot returns in ~2 h
    # one step before the last safe one (on-demand still fits after it) it must go on-demand
    last = next(t for t in range(1, grid.steps + 1) if (t - 1) * grid.step_h >= table.safe_h[r] - EPS)
    assert table.action(last - 1, 0, IDLE, r, 0) == OD
    assert table.action(last - 1, 1, IDLE, r, 0) == OD  # no room for a Spot try either


def test_table_skips_spot_that_ends_before_a_shard_commits() -> None:
    # spells of 3 minutes against a 6-minute changeover and 15-minute shards: Spot never commits
    cfg = SimConfig(work_h=8, deadline_h=12, changeover_h=0.1)
    grid, table = _table(cfg, availability=0.5, run_h=0.05)
    assert table.action(grid.steps, 1, IDLE, grid.shards, 0) != SPOT


def test_mdp_stays_near_on_demand_where_spot_spells_are_shorter_than_a_try() -> None:
    # the learned spell length is the longer of the posterior mean and the spell running now, so
    # the table still probes Spot a little here (docs/simulator.md, Fourth round): within 10 %
    trace = traces.flapping(6, hours=60.0, p_up=0.5)
    cfg = SimConfig(work_h=4, deadline_h=8, changeover_h=0.1)
    on_demand = simulate(trace, 0, cfg, OnDemand()).cost
    result = simulate(trace, 600, cfg, online_at("mdp", trace, 600, 1, MarkovDecision().params))
    assert not result.missed
    assert result.cost <= 1.10 * on_demand


def test_tuning_rejects_an_unknown_policy_with_the_names_to_use() -> None:
    with pytest.raises(SystemExit, match="slack_aware, mdp"):
        tuning_main(["--policy", "mpd"])
