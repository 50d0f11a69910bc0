"""The tuning tool's gap split (docs/simulator.md, *Third round*): on-demand hours by Spot presence."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim.engine import SimConfig, simulate
from airflow_deadline_batch.sim.policies import OnDemand, UniformProgress
from airflow_deadline_batch.sim.traces import Trace
from airflow_deadline_batch.sim.tuning import multi_gpu_row, on_demand_hours_by_spot


def test_on_demand_hours_are_split_by_whether_spot_was_there() -> None:
    # Spot missing for the first hour, then there; 1 h of work plus a 0.1 h changeover on on-demand
    trace = Trace("late-spot", 1800.0, (0, 0) + (1,) * 10)
    cfg = SimConfig(work_h=1.0, deadline_h=4.0, changeover_h=0.1, shard_h=0.25)
    run = simulate(trace, 0, cfg, OnDemand(), record=True)
    there, missing = on_demand_hours_by_spot(trace, 0, run)
    assert (there, missing) == pytest.approx((0.1, 1.0))
    assert there + missing == pytest.approx(run.on_demand_hours)


def test_a_run_without_on_demand_has_none_either_way() -> None:
    trace = Trace("spot", 1800.0, (1,) * 12)
    cfg = SimConfig(work_h=1.0, deadline_h=4.0, changeover_h=0.1, shard_h=0.25)
    run = simulate(trace, 0, cfg, UniformProgress(), record=True)
    assert run.on_demand_hours == 0
    assert on_demand_hours_by_spot(trace, 0, run) == (0.0, 0.0)


def test_the_multi_gpu_score_rows_each_candidate_against_up_and_on_demand() -> None:
    # two candidates on one small flapping row: the default and a zero cost cap (never dearer)
    trace = Trace("flap", 600.0, (2, 2, 0, 0, 0, 2, 0, 2, 2, 2, 0, 0) * 4)
    cfg = SimConfig(work_h=4.0, deadline_h=4.0, workers=2, changeover_h=0.1, shard_h=0.25)
    rows = multi_gpu_row((trace, cfg, 3, (PolicyParams(), PolicyParams(cost_cap=0.0)), "slack_aware"))
    assert len(rows) == 2
    for over_up, worst_over_od, mean_over_od, misses in rows:
        assert over_up > 0 and mean_over_od <= worst_over_od and misses == 0
    assert rows[1][1] <= 1.0 + 1e-9  # the zero cap: no run dearer than on-demand only


def test_the_multi_gpu_score_takes_the_research_policy_by_name() -> None:
    trace = Trace("flap", 600.0, (2, 2, 0, 0, 0, 2, 0, 2, 2, 2, 0, 0) * 4)
    cfg = SimConfig(work_h=4.0, deadline_h=4.0, workers=2, changeover_h=0.1, shard_h=0.25)
    ((over_up, worst_over_od, mean_over_od, misses),) = multi_gpu_row(
        (trace, cfg, 3, (PolicyParams(),), "mdp")
    )
    assert over_up > 0 and mean_over_od <= worst_over_od and misses == 0
