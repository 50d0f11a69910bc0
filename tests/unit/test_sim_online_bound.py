"""The online bound (sim/online_bound.py): Markov traces, the oracle-rates table, its brute-force check.

The oracle with slack_aware's safety rule is held to the last-safe-decision invariant of
tests/unit/test_sim_no_miss.py; the table alone to the exact one (a Spot try preempted at the next
tick keeps what it committed during this one, and on-demand from there must still meet the
deadline), both checked from the engine's own state.
"""

from __future__ import annotations

import math

import pytest

from airflow_deadline_batch.sim.engine import Choice, Mode, SimConfig, View, simulate
from airflow_deadline_batch.sim.online_bound import (
    MarkovFit,
    OracleRates,
    TableAlone,
    exact_grid,
    expected_cost,
    fit_markov,
    online_optimum,
    oracle_table,
)
from airflow_deadline_batch.sim.policies import OnDemand
from airflow_deadline_batch.sim.study import Setting, extra_targets, run_row
from airflow_deadline_batch.sim.traces import markov
from tests.unit.test_sim_no_miss import slack_h, worst_burn_h

EPS = 1e-9


def test_fitted_rates_recover_the_true_ones_on_a_long_trace() -> None:
    trace = markov(0.4, 1.2, hours=4000.0, gap_s=300.0, seed=3)
    fit = fit_markov(trace)
    assert fit.up_to_down == pytest.approx(0.4, rel=0.08)
    assert fit.down_to_up == pytest.approx(1.2, rel=0.08)
    assert trace.availability() == pytest.approx(0.75, abs=0.02)


def test_markov_refuses_a_rate_of_zero() -> None:
    with pytest.raises(ValueError, match="rates must be > 0"):
        markov(0.0, 1.0)


def _exact_slack_after_h(view: View, choice: Choice) -> float:
    """Slack at the next tick if Spot is gone then: a Spot try keeps the commits of this tick."""
    cfg, slot = view.config, view.slots[0]
    commits = 0
    if choice is Mode.SPOT:
        changeover = slot.changeover_left_h if slot.mode is Mode.SPOT else cfg.changeover_h
        progress = slot.progress_h if slot.mode is Mode.SPOT else 0.0
        commits = max(0, math.floor((view.gap_h - changeover + progress) / cfg.shard_size_h + EPS))
    left = max(0.0, view.remaining_h - commits * cfg.shard_size_h)
    if left == 0.0:
        return math.inf  # it finishes in this tick
    return view.time_left_h - view.gap_h - (cfg.changeover_h + left)


class _CheckedOracle(OracleRates):
    def decide(self, view: View) -> list[Choice]:
        modes = list(super().decide(view))
        if modes[0] is not Mode.ON_DEMAND and (view.slots[0].busy or view.pending_shards > 0):
            assert slack_h(view) - worst_burn_h(view, modes) >= -EPS, (view.t_h, modes)
        return modes


class _CheckedTable(TableAlone):
    def decide(self, view: View) -> list[Choice]:
        modes = list(super().decide(view))
        if modes[0] is not Mode.ON_DEMAND and (view.slots[0].busy or view.pending_shards > 0):
            assert _exact_slack_after_h(view, modes[0]) >= -EPS, (view.t_h, modes)
        return modes


CASES = [  # (tick s, work h, deadline h, changeover h, rates up→down / down→up per hour)
    (600.0, 4.0, 5.0, 0.1, (1.0, 1.0)),
    (300.0, 4.0, 4.5, 0.2, (0.3, 2.0)),
    (60.0, 2.0, 2.4, 0.0, (2.0, 0.5)),
    (180.0, 3.0, 6.0, 0.2, (0.5, 0.2)),
]


@pytest.mark.parametrize(("gap_s", "work", "deadline", "changeover", "rates"), CASES)
def test_oracle_and_table_alone_never_miss(
    gap_s: float, work: float, deadline: float, changeover: float, rates: tuple[float, float]
) -> None:
    fit = MarkovFit(*rates)
    trace = markov(*rates, hours=200.0, gap_s=gap_s, seed=7)
    cfg = SimConfig(work_h=work, deadline_h=deadline, changeover_h=changeover, price_ratio=3.0)
    for start in range(0, len(trace.capacity) - 200, len(trace.capacity) // 8):
        for policy in (_CheckedOracle(fit), _CheckedTable(fit)):
            result = simulate(trace, start, cfg, policy)
            assert not result.missed, (policy.name, start, result.finish_h)


def test_table_alone_is_the_online_optimum_on_tiny_jobs() -> None:
    # brute force over every online policy (expectimax over the engine) = the table's own value
    # = the table's exact expected cost over every trace, and none above on-demand only
    fit = MarkovFit(1.5, 1.0)
    for work, deadline, changeover in ((0.5, 1.5, 0.1), (0.75, 1.5, 0.2)):
        cfg = SimConfig(work_h=work, deadline_h=deadline, changeover_h=changeover, price_ratio=3.0)
        grid = exact_grid(cfg, 600.0 / 3600)
        table = oracle_table(cfg, grid, fit)
        for first_up in (True, False):
            best = online_optimum(cfg, 600.0, fit, first_up)
            alone = expected_cost(lambda: TableAlone(fit), cfg, 600.0, fit, first_up)
            assert alone == pytest.approx(best, abs=1e-4)
            assert table.idle[grid.steps][int(first_up), grid.shards] == pytest.approx(best, abs=1e-4)
            with_rule = expected_cost(lambda: OracleRates(fit), cfg, 600.0, fit, first_up)
            assert best - 1e-9 <= with_rule <= (work + changeover) * 3.0 + 1e-9


def test_oracle_is_not_dearer_than_on_demand_on_average() -> None:
    fit = MarkovFit(0.8, 0.5)
    trace = markov(fit.up_to_down, fit.down_to_up, hours=400.0, gap_s=600.0, seed=11)
    cfg = SimConfig(work_h=8.0, deadline_h=12.0, changeover_h=0.2, price_ratio=3.0)
    starts = range(0, len(trace.capacity) - 100, len(trace.capacity) // 12)
    for policy in (OracleRates(fit), TableAlone(fit)):
        mean = sum(simulate(trace, s, cfg, policy).cost for s in starts) / len(starts)
        assert mean <= simulate(trace, 0, cfg, OnDemand()).cost


def test_exact_grid_refuses_fractional_seconds() -> None:
    cfg = SimConfig(work_h=1.0, deadline_h=2.0, changeover_h=0.1, shard_h=0.25)
    with pytest.raises(ValueError, match="whole seconds"):
        exact_grid(cfg, 1.5 / 3600)


def test_study_adds_mdp_only_when_asked() -> None:
    trace = markov(0.5, 1.0, hours=100.0, gap_s=600.0, seed=5)
    setting = Setting(1, 4.0, 6.0, 0.1, starts=2)
    assert "mdp" not in run_row(trace, setting)
    row = run_row(trace, setting, extra=("mdp",))
    line = extra_targets([(trace.name, setting, row)], "mdp")
    assert row["mdp"].starts == 2 and line["mdp_misses_where_omniscient_meets"] == 0
    assert line["mean_mdp_over_exact_optimum_n1"] >= 1.0 - 1e-9  # the exact optimum is a floor
