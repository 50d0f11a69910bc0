"""The research policy ``mdp`` (sim/mdp.py): no avoidable miss, and the table's choices.

The no-miss property is the one slack_aware is held to (tests/unit/test_sim_no_miss.py): at every
decision either on-demand from now still meets the deadline after the worst the choice can burn
before the next decision, or every worker is on on-demand; checked from the engine's own state.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim import traces
from airflow_deadline_batch.sim.engine import Choice, Mode, SimConfig, View, simulate
from airflow_deadline_batch.sim.mdp import IDLE, OD, SPOT, Grid, MarkovDecision, Rates, Table
from airflow_deadline_batch.sim.policies import OnDemand, make_policy
from airflow_deadline_batch.sim.traces import Trace
from airflow_deadline_batch.sim.tuning import MdpVariant, online_at
from airflow_deadline_batch.sim.tuning import main as tuning_main
from tests.unit import test_sim_cost_cap
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


#: mdp as it is, and each variant for its tail (docs/simulator.md, *Fifth round b*), all together last
VARIANTS: list[tuple[PolicyParams, MdpVariant]] = [
    (PolicyParams(), MdpVariant()),
    (PolicyParams(cost_cap=0.01), MdpVariant()),
    (PolicyParams(), MdpVariant(guards=True)),
    (PolicyParams(), MdpVariant(waste_price=1.0)),
    (PolicyParams(), MdpVariant(waste_price=2.0, waste_above=0.0)),
    (PolicyParams(cost_cap=0.0, return_doubling=True), MdpVariant(guards=True, waste_price=2.0)),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), start=st.integers(0, 500), variant=st.sampled_from(VARIANTS))
@example(  # two workers on one Spot GPU at zero slack (slack_aware's counterexample once)
    scenario=(
        Trace("one-of-two", 195.0, (1,)),
        SimConfig(work_h=2.0, deadline_h=2.0, workers=2, changeover_h=0.0, shard_h=0.2 / 15),
    ),
    start=0,
    variant=VARIANTS[0],
)
def test_mdp_never_misses_a_deadline_on_demand_meets(
    scenario: tuple[Trace, SimConfig], start: int, variant: tuple[PolicyParams, MdpVariant]
) -> None:
    trace, cfg = scenario
    assert cfg.on_demand_feasible()
    params, options = variant
    policy = _Checked(
        params, guards=options.guards, waste_price=options.waste_price, waste_above=options.waste_above
    )
    result = simulate(trace, start % len(trace.capacity), cfg, policy)
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


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario=test_sim_cost_cap.scenarios(),
    cap=st.sampled_from([0.0, 0.01, 0.05]),
    start=st.integers(0, 300),
    options=st.sampled_from([MdpVariant(), MdpVariant(guards=True, waste_price=1.0)]),
)
def test_mdp_under_the_cost_cap_stays_within_it_on_any_trace(
    scenario: tuple[Trace, SimConfig], cap: float, start: int, options: MdpVariant
) -> None:
    # the cap rule runs before the table, as for slack_aware; a running on-demand try the table
    # would stop to wait throws its progress away, so it is kept when that does not fit the room
    trace, cfg = scenario
    policy = MarkovDecision(
        PolicyParams(cost_cap=cap), guards=options.guards, waste_price=options.waste_price
    )
    result = simulate(trace, start % len(trace.capacity), cfg, policy)
    bound = test_sim_cost_cap._bound(trace, cfg, cap)
    assert not result.missed
    assert result.cost <= bound + 1e-9, (result.cost, bound)


@pytest.mark.parametrize("run_h", [0.3, 0.4])
def test_the_risk_term_skips_a_spot_try_that_only_pays_on_average(run_h: float) -> None:
    # spells of 0.3-0.4 h against a 6-minute changeover and 15-minute shards: expected cost takes
    # the try, a price on the work a preemption throws away does not
    cfg = SimConfig(work_h=8, deadline_h=12, changeover_h=0.1)
    grid = Grid.for_job(cfg, 300 / 3600)
    rates = Rates.of(1 / run_h, 1 / run_h, grid.step_h)
    plain = Table(grid, cfg, rates, grid.steps)
    averse = Table(grid, cfg, rates, grid.steps, waste_price=2.0)
    assert plain.action(grid.steps, 1, IDLE, grid.shards, 0) == SPOT
    assert averse.action(grid.steps, 1, IDLE, grid.shards, 0) != SPOT
    # long spells repay the try whatever the price on waste
    long = Table(grid, cfg, Rates.of(1 / 20, 1 / 20, grid.step_h), grid.steps, waste_price=2.0)
    assert long.action(grid.steps, 1, IDLE, grid.shards, 0) == SPOT


@pytest.mark.parametrize("waste_price", [0.0, 1.5])
def test_the_choice_of_one_state_is_the_layers_value(waste_price: float) -> None:
    # action() recomputes one state's choice outside the vectorised layer (risk term included):
    # the cheapest of its values is the table's value of that state, for every state
    cfg = SimConfig(work_h=1.5, deadline_h=3, changeover_h=0.1)
    grid = Grid.for_job(cfg, 300 / 3600)
    table = Table(grid, cfg, Rates.of(1 / 0.5, 1 / 0.5, grid.step_h), grid.steps, waste_price=waste_price)
    for t in range(1, grid.steps + 1):
        for s in (0, 1):
            for r in range(1, grid.shards + 1):
                assert min(table.values(t, s, IDLE, r, 0)) == pytest.approx(table.idle[t, s, r])
                for j in range(table.width):
                    for m, mode in ((SPOT, 0), (OD, 1)):
                        value = table.running[t, mode, s, r, j]
                        assert min(table.values(t, s, m, r, j)) == pytest.approx(value), (t, s, m, r, j)


def test_guards_and_the_risk_term_hold_mdp_near_on_demand_on_flapping_spot() -> None:
    # 3-minute spells against a 6-minute changeover: mdp probes the "expected" spells (1.127 x
    # on-demand at this start); the storm and expected-cost guards, or the risk term, stop it
    trace = traces.flapping(6, hours=60.0, p_up=0.5)
    cfg = SimConfig(work_h=4, deadline_h=8, changeover_h=0.1)
    on_demand = simulate(trace, 0, cfg, OnDemand()).cost
    plain, guarded, averse = (
        simulate(trace, 0, cfg, online_at(v, trace, 0, 1, PolicyParams())).cost
        for v in (MdpVariant(), MdpVariant(guards=True), MdpVariant(waste_price=1.0))
    )
    assert plain > 1.1 * on_demand
    assert guarded < plain and averse < plain
    assert averse <= 1.05 * on_demand


def test_mdp_options_need_the_mdp_policy_and_a_valid_price() -> None:
    with pytest.raises(SystemExit, match="add --policy mdp"):
        tuning_main(["--guards"])
    with pytest.raises(SystemExit, match="add --policy mdp"):
        tuning_main(["--waste-above", "0.02"])
    with pytest.raises(SystemExit, match="--waste-price must be >= 0"):
        tuning_main(["--policy", "mdp", "--waste-price", "-1"])
    with pytest.raises(ValueError, match="waste_price must be a finite number >= 0"):
        MarkovDecision(waste_price=-0.5)
    with pytest.raises(ValueError, match="waste_above must be >= 0"):
        MarkovDecision(waste_price=1.0, waste_above=-0.01)


def test_the_risk_term_applies_only_while_the_run_has_banked_less_than_waste_above() -> None:
    cfg = SimConfig(work_h=4, deadline_h=8, changeover_h=0.1)  # on-demand only: 3 × 4.1 = 12.3
    view = View(cfg, 0, 0.0, 0.1, 1, 4.0, 0, 16, (), ())
    policy = MarkovDecision(waste_price=2.0, waste_above=0.02)
    assert policy._waste_price(view, excess_s=0.0) == 2.0
    assert policy._waste_price(view, excess_s=-0.24 * 3600) == 2.0  # banked 0.24 < 0.246
    assert policy._waste_price(view, excess_s=-0.25 * 3600) == 0.0
    assert MarkovDecision(waste_price=2.0)._waste_price(view, excess_s=-100 * 3600) == 2.0
