"""Spell memory (docs/simulator.md, *Seventh round*): the hazard by spell age, the semi-Markov
traces, the age-conditioned estimate (``core.calibration.SpellAges``) and slack_aware with it."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.calibration import SpellAges
from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.sim import spells, traces
from airflow_deadline_batch.sim.engine import SimConfig, simulate
from airflow_deadline_batch.sim.policies import slack_aware_at
from airflow_deadline_batch.sim.study import Setting, extra_targets, run_row
from airflow_deadline_batch.sim.study import main as study_main
from airflow_deadline_batch.sim.traces import Trace
from airflow_deadline_batch.sim.tuning import semi_markov_cases
from tests.unit.test_sim_no_miss import _Checked, scenarios

AGES = dict(spell_age_wait=True, spell_age_return=True, spell_age_run=True)


def test_spell_lengths_leave_out_the_cut_spells_and_the_hazard_counts_ticks_at_risk() -> None:
    # half-hour ticks: present 2, absent 1, present 2, absent 4, present 1
    trace = Trace("hand", 1800.0, (1, 1, 0, 1, 1, 0, 0, 0, 0, 2))
    assert spells.spell_lengths(trace) == ([2], [1, 4])
    up, down = spells.measure([trace])
    assert down.ends == [1, 0, 1, 0, 0, 0]  # ended at ages 0 h and 1.5 h
    assert down.at_risk == [1.0, 0.5, 1.0, 0.0, 0.0, 0.0]  # hours at risk per bucket
    assert down.per_h() == [1.0, 0.0, 1.0, None, None, None]
    assert down.memoryless_per_h() == pytest.approx(2 / 2.5)
    assert up.per_h()[:2] == [0.0, 2.0] and up.memoryless_per_h() == pytest.approx(1.0)


def test_a_markov_trace_is_memoryless_and_a_heavy_tailed_one_is_not() -> None:
    markov = spells.measure([traces.markov(0.5, 0.5, 4000.0, seed=3)])
    heavy = spells.measure([traces.semi_markov(3, hours=4000.0, mean_up_h=2.0, mean_down_h=2.0, shape=0.5)])
    for h in markov:
        fit = h.memoryless_per_h()
        assert fit is not None
        assert all(0.75 < (rate or 0) / fit < 1.25 for rate in h.per_h()[:5])
    for h in heavy:
        fit = h.memoryless_per_h()
        young, old = h.per_h()[0], h.per_h()[4]
        assert fit is not None and young is not None and old is not None
        assert young / fit > 2.0 and old / fit < 0.6


@pytest.mark.parametrize("law, shape", [("weibull", 0.5), ("weibull", 0.7), ("lognormal", 1.2)])
def test_semi_markov_spells_have_the_asked_means_and_a_seed_fixes_the_trace(law: str, shape: float) -> None:
    def draw(seed: int) -> Trace:
        return traces.semi_markov(seed, hours=6000.0, mean_up_h=3.0, mean_down_h=1.5, shape=shape, law=law)

    trace = draw(5)
    up, down = spells.spell_lengths(trace)
    gap_h = trace.gap_s / 3600
    assert sum(up) * gap_h / len(up) == pytest.approx(3.0, rel=0.15)
    assert sum(down) * gap_h / len(down) == pytest.approx(1.5, rel=0.15)
    assert trace == draw(5)
    assert trace.capacity != draw(6).capacity


def test_semi_markov_names_the_fix_for_a_bad_law() -> None:
    with pytest.raises(ValueError, match="use 'weibull' or 'lognormal'"):
        traces.semi_markov(1, law="pareto")


def test_spell_ages_keep_the_seen_spells_and_give_the_expected_rest_by_age() -> None:
    ages = SpellAges(half_life_hours=1e9)
    for present, hours in [(True, 5.0), (False, 1.0), (True, 1.0), (False, 1.0), (True, 3.0), (False, 0.5)]:
        ages = ages.observe(present, hours)
    # the first spell (5 h) was cut by the start: not kept
    assert [length for length, _ in ages.up_spells] == [1.0, 3.0]
    assert [length for length, _ in ages.down_spells] == [1.0, 1.0]
    assert (ages.present, ages.age_hours) == (False, 0.5)
    # present spells of 1 h and 3 h (mean 2 h) and 2 prior spells of an exponential of mean 2 h
    assert ages.rest_hours(True, 0.0) == pytest.approx(2.0)
    prior = 2 * math.exp(-1.0)
    assert ages.rest_hours(True, 2.0) == pytest.approx((prior * 2.0 + 1.0) / (prior + 1.0))
    # the current spell is an absence of 0.5 h; a presence would be starting now
    assert ages.age_factor(True) == 1.0
    assert ages.age_factor(False) == pytest.approx(ages.rest_hours(False, 0.5) / ages.rest_hours(False, 0.0))
    assert SpellAges().age_factor(True) == 1.0  # nothing seen
    # within 1.5 h a present spell of age 0 ends if it is the 1 h one, or the prior's share
    chance, memoryless = ages.end_chance(True, 0.0, 1.5)
    assert memoryless == pytest.approx(1 - math.exp(-0.75))
    assert chance == pytest.approx((1.0 + 2 * memoryless) / 4.0)
    assert ages.age_factor(False, 1.5) == pytest.approx(
        ages.end_chance(False, 0.5, 1.5)[1] / ages.end_chance(False, 0.5, 1.5)[0]
    )


def test_spell_ages_see_that_an_old_spell_lasts_on_heavy_tailed_spells_only() -> None:
    def factor_at(trace: Trace, age_h: float) -> float:
        ages = SpellAges(half_life_hours=1e9)
        for cap in trace.capacity:
            ages = ages.observe(cap > 0, trace.gap_s / 3600)
        return ages.rest_hours(True, age_h) / ages.rest_hours(True, 0.0)

    def odds_at(trace: Trace, age_h: float) -> float:
        ages = SpellAges(half_life_hours=1e9)
        for cap in trace.capacity:
            ages = ages.observe(cap > 0, trace.gap_s / 3600)
        chance, memoryless = ages.end_chance(True, age_h, 1.0)
        return memoryless / chance

    heavy = traces.semi_markov(2, hours=1500.0, mean_up_h=2.0, mean_down_h=2.0, shape=0.5, gap_s=600.0)
    memoryless = traces.markov(0.5, 0.5, 1500.0, seed=2)
    assert factor_at(heavy, 3.0) > 1.5
    assert 0.8 < factor_at(memoryless, 3.0) < 1.2
    # by the chance to end within an hour a young heavy-tailed spell is shorter than memoryless
    assert odds_at(heavy, 0.0) < 0.8 and odds_at(heavy, 3.0) > 1.5
    assert 0.8 < odds_at(memoryless, 0.0) < 1.2 and 0.8 < odds_at(memoryless, 3.0) < 1.2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario=scenarios(),
    params=st.sampled_from(
        [
            PolicyParams(**AGES),
            PolicyParams(spell_age_wait=True, spell_age_cap=4.0),
            PolicyParams(spell_age_return=True, spell_age_run=True, spell_age_cap=4.0),
            PolicyParams(**AGES, cost_cap=0.01),
            PolicyParams(**AGES, spell_age_horizon_h=1.0, spell_age_cap=8.0),
        ]
    ),
    start=st.integers(0, 500),
)
def test_slack_aware_never_misses_with_the_spell_age_rules(
    scenario: tuple[Trace, SimConfig], params: PolicyParams, start: int
) -> None:
    # the last-safe-decision invariant at every decision (``_Checked``) and no miss
    trace, cfg = scenario
    result = simulate(trace, start % len(trace.capacity), cfg, _Checked(params))
    assert not result.missed, (result.finish_h, cfg.deadline_h)


def test_slack_aware_reads_the_spell_age_from_its_persisted_prior_on() -> None:
    trace = traces.semi_markov(3, mean_up_h=3.0, mean_down_h=2.0, shape=0.5)
    cfg = SimConfig(work_h=16, deadline_h=30, changeover_h=0.1)
    costs = [
        [simulate(trace, s, cfg, slack_aware_at([trace], s, 1, params)).cost for s in range(600, 4000, 400)]
        for params in (PolicyParams(), PolicyParams(**AGES))
    ]
    assert costs[0] != costs[1]


def test_study_runs_candidates_on_the_starts_of_slack_aware() -> None:
    trace = traces.semi_markov(4, hours=100.0, mean_up_h=1.0, mean_down_h=1.0, gap_s=600.0)
    setting = Setting(1, 4.0, 6.0, 0.1, starts=3)
    row = run_row(trace, setting, params=(PolicyParams(), PolicyParams(**AGES)))
    # the default's candidate is slack_aware itself, run for run
    assert row["candidate1"].mean_cost == row["slack_aware"].mean_cost
    line = extra_targets([(trace.name, setting, row)], "candidate2")
    assert row["candidate2"].starts == 3 and line["candidate2_misses_where_omniscient_meets"] == 0


def test_study_names_the_fix_for_bad_params(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        study_main(["--synthetic", "--params", '{"spell_age_cap": 0.5}'])
    assert "--params needs PolicyParams as JSON" in capsys.readouterr().err


def test_the_semi_markov_set_has_the_tuning_settings() -> None:
    cases = semi_markov_cases()
    assert len(cases) == 36
    assert {c.workers for _, c, _ in cases} == {1, 4}
    assert all(max(t.capacity) == c.workers for t, c, _ in cases)


def test_succession_is_near_zero_for_independent_spells_and_positive_for_regimes() -> None:
    # hand-made: present spells of 1, 1, 4, 4 ticks (log lengths centred: −c, −c, +c, +c) and
    # absent ones all of 2 (centred to 0: no weight); cut ends
    hand = Trace("hand", 600.0, (0, 1, 0, 0, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0))
    assert spells.spell_lengths(hand) == ([1, 1, 4, 4], [2, 2, 2])
    r, pairs = spells.succession(hand)
    assert pairs == 5 and r == pytest.approx(1 / 3)  # pairs (−c, −c), (−c, +c), (+c, +c)
    independent = traces.semi_markov(3, hours=4000.0, mean_up_h=2.0, mean_down_h=2.0, shape=0.5)
    r, pairs = spells.succession(independent)
    assert r is not None and abs(r) < 0.08 and pairs > 1000
    r, pairs = spells.succession(traces.regime_switching(1, hours=4000.0))  # spell means drift daily
    assert r is not None and r > 0.15 and pairs > 500
    assert spells.succession(traces.constant(1, 10.0)) == (None, 0)
