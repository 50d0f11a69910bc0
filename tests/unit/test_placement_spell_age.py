"""The spell-age rules of ``choose_pool`` (docs/simulator.md, *Seventh round*): the waiting reserve,
the return margin and the learned spell length scaled by ``JobSnapshot.spell_age_factor``."""

from __future__ import annotations

import datetime as dt

import pytest

from airflow_deadline_batch.core.placement import JobSnapshot, PolicyParams, SpotOption, choose_pool
from airflow_deadline_batch.core.pools import PoolKind
from tests.unit.test_placement import NOW, H, snap

WAIT = PolicyParams(spell_age_wait=True)
RETURN = PolicyParams(spell_age_return=True)
RUN = PolicyParams(spell_age_run=True)


def missing(hours: float, factor: float | None) -> JobSnapshot:
    return snap(deadline=NOW + dt.timedelta(hours=hours), spot_available=False, spell_age_factor=factor)


def test_an_outage_that_has_lasted_escalates_sooner_and_a_fresh_one_waits_longer() -> None:
    # 4 h work, d = 0.1 h: reserve 6 d + 10 % of 4 h = 1.0 h on top of 0.35 h of risk; slack 1.4 h
    assert choose_pool(missing(5.5, None), WAIT).pool is PoolKind.SPOT
    assert choose_pool(missing(5.5, 1.0), WAIT).pool is PoolKind.SPOT
    # twice the usual rest of an outage: reserve 2.0 h, escalate
    old = choose_pool(missing(5.5, 2.0), WAIT)
    assert old.pool is PoolKind.ON_DEMAND and "reserve" in old.reason
    # the factor is capped: 10 × reads as 2 ×, so slack 2.4 h (above 2.35 h) still waits
    assert choose_pool(missing(6.5, 10.0), WAIT).pool is PoolKind.SPOT
    assert choose_pool(missing(6.4, 10.0), WAIT).pool is PoolKind.ON_DEMAND
    # half the usual rest: reserve 0.5 h, slack 0.9 h waits where the plain rule escalates
    assert choose_pool(missing(5.0, 0.5)).pool is PoolKind.ON_DEMAND
    assert choose_pool(missing(5.0, 0.5), WAIT).pool is PoolKind.SPOT


def test_the_age_rules_are_off_by_default_and_with_several_spot_pools() -> None:
    assert choose_pool(missing(5.5, 2.0)).pool is PoolKind.SPOT
    assert choose_pool(missing(5.5, 2.0), RETURN).pool is PoolKind.SPOT  # only the wait rule reads it
    pools = (SpotOption(name="a", available=False), SpotOption(name="b", available=False))
    several = snap(
        deadline=NOW + dt.timedelta(hours=5.5), spot_available=False, spell_age_factor=2.0, spot_pools=pools
    )
    assert choose_pool(several, WAIT).pool is PoolKind.SPOT


def test_a_spell_that_has_lasted_takes_a_running_on_demand_try_back_with_less_margin() -> None:
    # slack 0.5 h; a fresh Spot try needs 0.35 h, coming back from on-demand 2 d = 0.2 h more
    held = dict(
        deadline=NOW + dt.timedelta(hours=1.6),
        remaining_work_s=1 * H,
        previous_pool=PoolKind.ON_DEMAND,
        running=True,
    )
    assert choose_pool(snap(**held, spell_age_factor=2.0)).pool is PoolKind.ON_DEMAND
    assert choose_pool(snap(**held, spell_age_factor=1.0), RETURN).pool is PoolKind.ON_DEMAND
    # twice the usual rest of the spell: margin 0.1 h, 0.45 h needed
    assert choose_pool(snap(**held, spell_age_factor=2.0), RETURN).pool is PoolKind.SPOT


def test_a_spell_that_has_lasted_repays_the_switch_from_on_demand() -> None:
    # changeover 0.1 h + 0.2 h uncommitted thrown away: Spot must run 2.5 × 0.3 h = 0.75 h; mean 0.5 h
    kwargs = dict(
        previous_pool=PoolKind.ON_DEMAND, running=True, running_progress_s=0.2 * H, spot_mean_run_s=0.5 * H
    )
    assert choose_pool(snap(**kwargs, spell_age_factor=2.0)).pool is PoolKind.ON_DEMAND
    assert choose_pool(snap(**kwargs, spell_age_factor=1.4), RUN).pool is PoolKind.ON_DEMAND
    moved = choose_pool(snap(**kwargs, spell_age_factor=1.6), RUN)
    assert moved.pool is PoolKind.SPOT


def test_bad_spell_age_inputs_name_the_fix() -> None:
    with pytest.raises(ValueError, match="spell_age_factor"):
        snap(spell_age_factor=0.0)
    with pytest.raises(ValueError, match="spell_age_factor"):
        snap(spell_age_factor=float("inf"))
    with pytest.raises(ValueError, match="spell_age_cap must be >= 1"):
        PolicyParams(spell_age_cap=0.5)
    with pytest.raises(ValueError, match="spell_age_horizon_h must be > 0"):
        PolicyParams(spell_age_horizon_h=0.0)
