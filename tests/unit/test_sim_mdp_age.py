"""The table with the spell's age (sim/mdp.py ``AgeTable``) and its twins (sim/online_bound.py).

With one hazard for every age phase the table is the memoryless one, value for value; with memory
its value equals a brute force over every online policy that sees the chain's state (spell there
or not and its age phase), an expectimax over the engine itself; the policy run through the engine
costs on average what the table says, and never misses.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from airflow_deadline_batch.sim.engine import SimConfig, simulate
from airflow_deadline_batch.sim.mdp import TIE, AgeRates, AgeTable, Rates, Table
from airflow_deadline_batch.sim.online_bound import (
    AgeTableAlone,
    AgeTableByAge,
    age_twin,
    chain_optimum,
    chain_table,
    exact_grid,
    fit_ages,
)
from airflow_deadline_batch.sim.spells import measure
from airflow_deadline_batch.sim.traces import Trace, semi_markov

#: spells that end fast while young and seldom once old (present and absent), two age buckets
MEMORY = AgeRates(((3.0, 0.3), (4.0, 0.2)), (0.0, 0.5))
TINY_JOBS = ((0.5, 1.5, 0.1), (0.75, 1.5, 0.2))


def _config(work: float, deadline: float, changeover: float) -> SimConfig:
    return SimConfig(work_h=work, deadline_h=deadline, changeover_h=changeover, price_ratio=3.0)


@pytest.mark.parametrize("credit_commits", [False, True])
def test_one_hazard_for_every_age_is_the_memoryless_table(credit_commits: bool) -> None:
    cfg = _config(4.0, 8.0, 0.2)
    grid = exact_grid(cfg, 300.0 / 3600.0)
    ages = AgeRates(((0.7,) * 4, (0.4,) * 4), (0.0, 0.5, 1.0, 2.0))
    memoryless = Table(grid, cfg, Rates.of(0.4, 0.7, grid.step_h), grid.steps, credit_commits=credit_commits)
    table = AgeTable(grid, cfg, ages, grid.steps, credit_commits=credit_commits)
    for z in range(8):
        s = z // 4
        np.testing.assert_allclose(table.idle[:, z], memoryless.idle[:, s], rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(table.running[:, :, z], memoryless.running[:, :, s], rtol=1e-12, atol=1e-9)
        for t, m, r, j in ((grid.steps, 0, 16, 0), (40, 1, 7, 9), (10, 2, 3, 20)):
            assert table.action(t, z, m, r, j) == memoryless.action(t, s, m, r, j)


def test_the_phases_outlast_their_buckets_as_the_hazards_say() -> None:
    ages = AgeRates(((1.0, 0.5, 0.1), (2.0, 0.2, 0.05)), (0.0, 0.5, 1.5))
    g = ages.generator()
    np.testing.assert_allclose(g.sum(axis=1), 0.0, atol=1e-12)
    # phase 0 of a present spell: left for phase 1 with the chance e^{-h w} a constant hazard gives
    leave = g[3, 4] / (g[3, 4] + g[3, 0])
    assert leave == pytest.approx(math.exp(-2.0 * 0.5))
    p = ages.transition(0.25)
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    np.testing.assert_allclose(ages.stationary() @ p, ages.stationary(), atol=1e-12)


@pytest.mark.parametrize(("work", "deadline", "changeover"), TINY_JOBS)
def test_the_table_with_age_is_the_online_optimum_on_tiny_jobs(
    work: float, deadline: float, changeover: float
) -> None:
    cfg = _config(work, deadline, changeover)
    gap_s = 600.0
    grid = exact_grid(cfg, gap_s / 3600.0)
    table = AgeTable(grid, cfg, MEMORY, grid.steps, credit_commits=True)
    step = MEMORY.transition(gap_s / 3600.0)
    up = table.up.tolist()
    values = []
    for z in range(4):
        best = chain_optimum(cfg, gap_s, step.tolist(), up, z)
        # the table adds TIE (1e-6) per step waited, so that a tie goes to progress
        assert float(table.idle[grid.steps][z, grid.shards]) == pytest.approx(best, abs=TIE * grid.steps)
        values.append(best)
    # the memory matters: a young present spell is worth less than an old one
    assert values[2] > values[3] + 1e-3


def test_the_policy_costs_what_its_table_says_and_never_misses() -> None:
    """Every trace of the chain up to the deadline, weighted, through the engine (a young present
    spell first); the phases given to the policy are the trace's own. Told only the spell's age
    (``AgeTableByAge``) the table's policy never misses either and costs no less."""
    cfg = _config(0.5, 1.0, 0.1)
    gap_s = 600.0
    grid = exact_grid(cfg, gap_s / 3600.0)
    step = MEMORY.transition(gap_s / 3600.0)
    ticks = math.ceil(cfg.deadline_h * 3600 / gap_s - 1e-9)
    mean = by_age = 0.0
    for rest in itertools.product(range(4), repeat=ticks - 1):
        path = (2, *rest)
        weight = math.prod(step[a, b] for a, b in itertools.pairwise(path))
        phases = tuple(z % 2 for z in path) + (0,)
        trace = Trace("all", gap_s, tuple(int(z >= 2) for z in path) + (0,))
        result = simulate(trace, 0, cfg, AgeTableAlone(MEMORY, phases, 0))
        told_age = simulate(trace, 0, cfg, AgeTableByAge(MEMORY, trace, 0))
        assert not result.missed and not told_age.missed
        mean += weight * result.cost
        by_age += weight * told_age.cost
    value = float(chain_table(cfg, grid, MEMORY).idle[grid.steps][2, grid.shards])
    assert mean == pytest.approx(value, abs=TIE * grid.steps)
    assert by_age >= mean - TIE * grid.steps


def test_a_twin_keeps_the_fitted_memory() -> None:
    """A semi-Markov trace's fitted hazards fall with age; its twin's spells have them again."""
    trace = semi_markov(5, hours=3000.0, gap_s=300.0, mean_up_h=2.0, mean_down_h=1.5, shape=0.5)
    ages = fit_ages(trace)
    assert ages.hazards[1][0] > 3 * ages.hazards[1][3]
    twin, phases = age_twin(trace, ages, hours=3000.0, seed=2)
    assert len(phases) == len(twin.capacity)
    # a new spell starts in phase 0 (rarely further: it began early in the tick and aged already)
    fresh = [
        p for c, p, prev in zip(twin.capacity[1:], phases[1:], twin.capacity[:-1], strict=True) if c != prev
    ]
    assert sum(p == 0 for p in fresh) > 0.9 * len(fresh)
    up, down = measure([twin])
    for fitted, kind in ((ages.hazards[1], up), (ages.hazards[0], down)):
        rates = kind.per_h()
        assert rates[0] is not None and rates[3] is not None
        assert rates[0] > 2 * rates[3]
        assert rates[3] == pytest.approx(fitted[3], rel=0.35)


def test_bad_hazards_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="one hazard per age bucket"):
        AgeRates(((1.0,), (1.0, 2.0)), (0.0, 1.0))
    with pytest.raises(ValueError, match="finite rate > 0"):
        AgeRates(((1.0, 0.0), (1.0, 2.0)), (0.0, 1.0))


def test_each_states_choice_is_the_inductions_minimum() -> None:
    """``values`` (what the policy asks at a state) against ``layer`` (what the induction stored)."""
    cfg = _config(1.0, 2.5, 0.2)
    grid = exact_grid(cfg, 600.0 / 3600.0)
    table = AgeTable(grid, cfg, MEMORY, grid.steps, credit_commits=True)
    for t, z, r in itertools.product(range(1, grid.steps + 1), range(4), range(1, grid.shards + 1)):
        assert min(table.values(t, z, 0, r, 0)) == pytest.approx(table.idle[t][z, r], abs=1e-9)
        for j in range(table.width):
            for m, mode in ((1, 0), (2, 1)):
                stored = table.running[t][mode, z, r, j]
                assert min(table.values(t, z, m, r, j)) == pytest.approx(stored, abs=1e-9)
