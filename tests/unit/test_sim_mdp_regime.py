"""The table told the hidden regime (sim/mdp.py ``RegimeRates``) and the regime twins (sim/online_bound.py).

With one regime, or identical ones, the regime chain is the age chain and its table the table with
age, value for value; with regimes its value equals a brute force over every online policy that
sees the chain's state; the fit over successive spells finds the regimes of a chain that has them,
and its twin's spells come in runs where the semi-Markov twin's do not.
"""

from __future__ import annotations

import numpy as np
import pytest

from airflow_deadline_batch.sim import spells
from airflow_deadline_batch.sim.engine import SimConfig
from airflow_deadline_batch.sim.mdp import TIE, AgeRates, AgeTable, RegimeRates
from airflow_deadline_batch.sim.online_bound import (
    age_twin,
    chain_optimum,
    chain_twin,
    exact_grid,
    fit_ages,
    fit_regimes,
    regime_twin,
)
from airflow_deadline_batch.sim.predictability import score_twin

#: spells that end fast while young and seldom once old (present and absent), two age buckets
MEMORY = AgeRates(((3.0, 0.3), (4.0, 0.2)), (0.0, 0.5))
#: two regimes with the same shape by age: regime 0's present spells end 4 × as fast as regime 1's
#: and its absences 2 × as slow (unequal factors: a fit that mixes up regime and kind fails),
#: switching at a quarter of Spot's returns; rates well under the tick's, so that the sampled
#: trace keeps its spells
EDGES = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
SHAPE = (1.0, 0.6, 0.5, 0.4, 0.3, 0.25)
SHORT = AgeRates((tuple(0.5 * x for x in SHAPE), tuple(2.0 * x for x in SHAPE)), EDGES)
LONG = AgeRates((tuple(1.0 * x for x in SHAPE), tuple(0.5 * x for x in SHAPE)), EDGES)
RUNS = RegimeRates((SHORT, LONG), ((0.75, 0.25), (0.25, 0.75)))


def _config(work: float, deadline: float, changeover: float) -> SimConfig:
    return SimConfig(work_h=work, deadline_h=deadline, changeover_h=changeover, price_ratio=3.0)


def test_one_regime_is_the_age_chain_and_its_table_exactly() -> None:
    cfg = _config(2.0, 4.0, 0.2)
    grid = exact_grid(cfg, 600.0 / 3600.0)
    one = RegimeRates((MEMORY,), ((1.0,),))
    np.testing.assert_array_equal(one.generator(), MEMORY.generator())
    np.testing.assert_array_equal(one.up, MEMORY.up)
    age = AgeTable(grid, cfg, MEMORY, grid.steps, credit_commits=True)
    regime = AgeTable(grid, cfg, one, grid.steps, credit_commits=True)
    np.testing.assert_array_equal(regime.idle, age.idle)
    np.testing.assert_array_equal(regime.running, age.running)


def test_identical_regimes_are_the_table_with_age() -> None:
    """Whatever the switch chances, regimes with the same hazards lump to the age chain."""
    cfg = _config(2.0, 4.0, 0.1)
    grid = exact_grid(cfg, 600.0 / 3600.0)
    twins = RegimeRates((MEMORY, MEMORY, MEMORY), ((0.5, 0.3, 0.2), (0.0, 1.0, 0.0), (0.1, 0.1, 0.8)))
    g = twins.generator()
    np.testing.assert_allclose(g.sum(axis=1), 0.0, atol=1e-12)
    age = AgeTable(grid, cfg, MEMORY, grid.steps, credit_commits=True)
    regime = AgeTable(grid, cfg, twins, grid.steps, credit_commits=True)
    for z in range(12):
        np.testing.assert_allclose(regime.idle[:, z], age.idle[:, z % 4], rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(regime.running[:, :, z], age.running[:, :, z % 4], rtol=1e-12, atol=1e-9)


def test_a_present_spell_ends_in_its_regime_and_spot_returns_into_the_switched_one() -> None:
    g = RUNS.generator()
    b = len(EDGES)
    present_young = b  # regime 0, Spot there, phase 0
    assert g[present_young, 0] == pytest.approx(SHORT.hazards[1][0])  # ends into regime 0's absence
    assert g[present_young, 2 * b] == 0.0  # never into regime 1's
    absent_young = 0
    assert g[absent_young, b] == pytest.approx(0.75 * SHORT.hazards[0][0])
    assert g[absent_young, 2 * b + b] == pytest.approx(0.25 * SHORT.hazards[0][0])
    np.testing.assert_allclose(RUNS.stationary() @ RUNS.transition(0.25), RUNS.stationary(), atol=1e-12)


@pytest.mark.parametrize(("work", "deadline", "changeover"), [(0.5, 1.5, 0.1), (0.75, 1.5, 0.2)])
def test_the_table_with_regimes_is_the_online_optimum_on_tiny_jobs(
    work: float, deadline: float, changeover: float
) -> None:
    chain = RegimeRates((MEMORY, AgeRates(((0.5, 0.5), (6.0, 6.0)), (0.0, 0.5))), ((0.6, 0.4), (0.3, 0.7)))
    cfg = _config(work, deadline, changeover)
    gap_s = 600.0
    grid = exact_grid(cfg, gap_s / 3600.0)
    table = AgeTable(grid, cfg, chain, grid.steps, credit_commits=True)
    step = chain.transition(gap_s / 3600.0)
    values = []
    for z in (0, 2, 4, 6):  # each kind's and regime's young spell
        best = chain_optimum(cfg, gap_s, step.tolist(), table.up.tolist(), z)
        assert float(table.idle[grid.steps][z, grid.shards]) == pytest.approx(best, abs=TIE * grid.steps)
        values.append(best)
    # the regime matters: a young present spell of the long-absence, short-presence regime is dearer
    assert values[3] > values[1] + 1e-3


def test_the_fit_finds_the_regimes_and_the_twin_keeps_their_runs() -> None:
    """A long trace drawn from two regimes: the fit over successive spells gets their switch
    chances and hazards back; its twin's successive spells correlate as the trace's do, where the
    semi-Markov twin's (independent spells) do not; and the hidden state forecasts beyond ``age``."""
    trace, _ = chain_twin("runs", 120.0, RUNS, 4000.0, seed=3)
    chain = fit_regimes(trace, regimes=2)
    assert chain.switch[0][0] == pytest.approx(0.75, abs=0.1)
    assert chain.switch[1][1] == pytest.approx(0.75, abs=0.1)
    # each regime's factor per kind (the present spells' 1/4, the absent ones' 2 ×)
    short, long = chain.regimes
    assert long.hazards[1][0] < 0.35 * short.hazards[1][0]
    assert 1.5 * short.hazards[0][0] < long.hazards[0][0] < 3.0 * short.hazards[0][0]
    assert short.hazards[1][0] == pytest.approx(SHORT.hazards[1][0], rel=0.25)
    real, _ = spells.succession(trace)
    double, states = regime_twin(trace, chain, hours=4000.0, seed=4)
    twin_r, _ = spells.succession(double)
    age_r, _ = spells.succession(age_twin(trace, fit_ages(trace), hours=4000.0, seed=4)[0])
    assert real is not None and twin_r is not None and age_r is not None
    assert real > 0.1 and twin_r == pytest.approx(real, abs=0.06) and abs(age_r) < 0.05
    b = chain.buckets
    four_h = score_twin(double, [z // (2 * b) * b + z % b for z in states])[1]
    assert four_h.mean["phase"]["logloss"] < 0.97 * four_h.mean["age"]["logloss"]


def test_the_first_round_fits_each_regime_to_its_own_spells() -> None:
    """One EM round from the split by length: regime 0 holds each kind's shorter spells, so both
    its hazards are the higher, each kind's factor on its own kind (not another regime's)."""
    trace, _ = chain_twin("runs", 120.0, RUNS, 1000.0, seed=5)
    short, long = fit_regimes(trace, regimes=2, rounds=1).regimes
    for kind in (0, 1):
        assert short.hazards[kind][0] > 1.5 * long.hazards[kind][0]


def test_bad_regimes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="same age buckets"):
        RegimeRates((MEMORY, SHORT), ((0.5, 0.5), (0.5, 0.5)))
    with pytest.raises(ValueError, match="switch must be 2 x 2"):
        RegimeRates((SHORT, LONG), ((1.0,), (1.0,)))
    with pytest.raises(ValueError, match="sum 1"):
        RegimeRates((SHORT, LONG), ((0.5, 0.6), (0.5, 0.5)))
    with pytest.raises(ValueError, match="regimes must be >= 1"):
        fit_regimes(chain_twin("runs", 300.0, RUNS, 100.0, seed=1)[0], regimes=0)
