"""Production's availability rule (core.calibration.PoolAvailability): time Spot tries ran against
time they waited for capacity in vain, over a prior; and the pod classifier that feeds it."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.client import models as k8s

from airflow_deadline_batch.core.calibration import (
    CAPACITY_MISSING_S,
    PoolAvailability,
    PoolHistory,
    availability_prior,
    gave_up_waiting,
)
from airflow_deadline_batch.operators.shard import scheduling_wait, unschedulable_reason

fractions = st.floats(min_value=0.0, max_value=1.0)
seconds = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)


@given(prior=fractions, present=seconds, absent=seconds, hours=st.floats(min_value=0.01, max_value=100))
def test_the_estimate_is_a_fraction(prior: float, present: float, absent: float, hours: float) -> None:
    value = PoolAvailability(prior=prior, prior_hours=hours).observe(present_s=present, absent_s=absent).value
    assert 0.0 <= value <= 1.0


@given(prior=fractions, share=fractions, scale=st.floats(min_value=1e3, max_value=1e6))
def test_with_much_evidence_it_converges_to_the_observed_share(
    prior: float, share: float, scale: float
) -> None:
    hours = 1.0
    total = scale * hours * 3600.0  # evidence `scale` times the prior's weight
    value = PoolAvailability(prior=prior, prior_hours=hours).observe(
        present_s=share * total, absent_s=(1 - share) * total
    )
    assert value.value == pytest.approx(share, abs=2.0 / scale)


@given(prior=fractions, share=fractions, little=st.floats(min_value=0.0, max_value=36.0))
def test_with_little_evidence_the_prior_dominates(prior: float, share: float, little: float) -> None:
    # at most 36 s of tries against a prior worth an hour: within 1 % of the prior
    value = PoolAvailability(prior=prior).observe(present_s=share * little, absent_s=(1 - share) * little)
    assert value.value == pytest.approx(prior, abs=0.01)


@given(present=seconds, absent=seconds, more=st.floats(min_value=1.0, max_value=1e6))
def test_waiting_in_vain_only_lowers_it(present: float, absent: float, more: float) -> None:
    before = PoolAvailability().observe(present_s=present, absent_s=absent)
    assert before.observe(absent_s=more).value < before.value
    assert before.observe(present_s=more).value > before.value


def test_a_pool_is_out_of_capacity_after_a_give_up_until_a_try_starts_or_time_passes() -> None:
    fresh = PoolAvailability()
    assert fresh.available(now_s=1000.0)
    gave_up = fresh.observe(absent_s=600.0, gave_up_s=1000.0)
    assert not gave_up.available(now_s=1000.0 + CAPACITY_MISSING_S - 1)
    assert gave_up.available(now_s=1000.0 + CAPACITY_MISSING_S)
    assert gave_up.observe(present_s=5.0, started_s=1010.0).available(now_s=1020.0)
    assert not gave_up.observe(present_s=5.0, started_s=990.0).available(now_s=1020.0)  # started before


def test_earlier_jobs_are_the_prior_scaled_down_when_long() -> None:
    assert availability_prior(0.5).value == 0.5
    short = availability_prior(0.5, PoolHistory(pool="p", spot_s=0.0, wait_s=3 * 3600.0, unschedulable=6))
    assert short.value == pytest.approx(0.5 / 4)  # an hour of prior at 0.5 against 3 h of waiting
    long = availability_prior(0.5, PoolHistory(pool="p", spot_s=30 * 3600.0, wait_s=90 * 3600.0, tries=9))
    assert (long.present_s + long.absent_s) / 3600.0 == pytest.approx(24.0)  # capped, shares kept
    assert long.present_s / (long.present_s + long.absent_s) == pytest.approx(0.25)
    carried = availability_prior(0.5, PoolHistory(pool="p", last_unschedulable_s=50.0, last_start_s=40.0))
    assert (carried.last_unschedulable_s, carried.last_start_s) == (50.0, 40.0)


def test_bad_priors_are_refused() -> None:
    with pytest.raises(ValueError, match="within"):
        PoolAvailability(prior=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        PoolHistory(pool="p", wait_s=-1.0)


CREATED = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def pod(
    *,
    capacity: str = "spot",
    phase: str = "Pending",
    scheduled: str = "False",
    reason: str = "Unschedulable",
    after_s: float = 0.0,
) -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(
            name="shard-0",
            labels={"deadline-batch.io/capacity": capacity, "deadline-batch.io/pool": "spot-a"},
            creation_timestamp=CREATED,
        ),
        status=k8s.V1PodStatus(
            phase=phase,
            conditions=[
                k8s.V1PodCondition(
                    type="PodScheduled",
                    status=scheduled,
                    reason=reason,
                    message="0/3 nodes are available",
                    last_transition_time=CREATED + dt.timedelta(seconds=after_s),
                )
            ],
        ),
    )


@pytest.mark.parametrize(
    ("kwargs", "waits"),
    [
        ({}, True),
        ({"capacity": "on-demand"}, False),  # on-demand capacity is not what Spot availability measures
        ({"phase": "Running", "scheduled": "True", "reason": ""}, False),
        ({"scheduled": "True", "reason": ""}, False),  # scheduled, pulling its image
        ({"reason": "SchedulingGated"}, False),
    ],
)
def test_only_a_spot_pod_no_node_fits_waits_for_capacity(kwargs: dict[str, Any], waits: bool) -> None:
    reason = unschedulable_reason(pod(**kwargs))
    assert (reason is not None) is waits
    if waits:
        assert reason is not None and "0/3 nodes are available" in reason
    assert unschedulable_reason(None) is None


@pytest.mark.parametrize(
    ("kwargs", "wait_s"),
    [
        ({"phase": "Running", "scheduled": "True", "after_s": 300.0}, 300.0),
        ({"phase": "Succeeded", "scheduled": "True", "after_s": 2.0}, 2.0),
        ({"phase": "Running", "scheduled": "True", "after_s": 1.0}, None),  # whole seconds: maybe none
        ({"phase": "Running", "scheduled": "True", "after_s": 300.0, "capacity": "on-demand"}, None),
        ({"after_s": 300.0}, None),  # still waiting: unschedulable_reason's case
    ],
)
def test_a_spot_pod_scheduled_after_waiting_tells_how_long(
    kwargs: dict[str, Any], wait_s: float | None
) -> None:
    found = scheduling_wait(pod(**kwargs))
    if wait_s is None:
        assert found is None
    else:
        assert found is not None and (found[1] - found[0]).total_seconds() == wait_s


def test_only_a_wait_with_a_failure_class_gave_up() -> None:
    assert gave_up_waiting("transient") and not gave_up_waiting(None)
