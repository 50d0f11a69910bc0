"""Garbage in the learned Spot availability (issue 13, hostile): the decision must not crash, values clamp.

``PoolAvailability`` folds run and wait seconds; ``availability_prior`` folds earlier jobs'
``PoolHistory``; the store's ``unschedulable`` rows carry a pod's creation time from the
Kubernetes API server, whose clock is not the store's. NaN, infinities, negative and 1e308-second
values, and a pod "created" decades before its job, must leave an availability within [0, 1], a
pool that comes back once the store's clock says so, and a decision that still runs.
"""

from __future__ import annotations

import datetime as dt
import math

import pytest
import sqlalchemy as sa

from airflow_deadline_batch.core.calibration import (
    CAPACITY_MISSING_S,
    PoolAvailability,
    PoolHistory,
    SpotTries,
    availability_prior,
    spot_prior,
)
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.operators.placement import (
    PlacementView,
    TryAction,
    decide_for_try,
    read_job_view,
)
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.store.schema import attempts
from tests.integration.test_placement_history import make_job

pytestmark = pytest.mark.integration

UTC = dt.timezone.utc
NOW = 1.8e9
GARBAGE = [math.nan, math.inf, -math.inf, -1.0, -1e308, 1e308, 0.0]
SPOT = PoolSpec(name="spot-a", kind=PoolKind.SPOT, price_per_gpu_hour=1.0, preemptions_per_hour=0.1)
ON_DEMAND = PoolSpec(name="gpu-on-demand", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0)


def sane(value: float) -> bool:
    return math.isfinite(value) and 0.0 <= value <= 1.0


@pytest.mark.parametrize("present", GARBAGE)
@pytest.mark.parametrize("absent", GARBAGE)
def test_garbage_seconds_leave_the_availability_within_0_and_1(present: float, absent: float) -> None:
    learned = PoolAvailability()
    for _ in range(3):  # accumulate: two 1e308 add up to inf
        learned = learned.observe(present_s=present, absent_s=absent)
    assert sane(learned.value), (present, absent, learned)


def test_huge_run_time_on_both_sides_weighs_them_evenly() -> None:
    learned = PoolAvailability(prior=0.5).observe(present_s=1e308, absent_s=1e308)
    assert learned.value == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("gave_up", [math.nan, math.inf, 1e308, NOW + 10 * 365 * 86400.0])
def test_a_garbage_give_up_time_keeps_the_pool_out_no_longer_than_the_missing_window(gave_up: float) -> None:
    learned = PoolAvailability().observe(absent_s=600.0, gave_up_s=gave_up)
    assert learned.available(NOW + CAPACITY_MISSING_S + 1.0), learned


def test_a_garbage_start_time_does_not_hide_a_real_give_up() -> None:
    learned = PoolAvailability().observe(started_s=math.nan).observe(gave_up_s=NOW)
    assert not learned.available(NOW + 1.0)
    assert learned.available(NOW + CAPACITY_MISSING_S + 1.0)


@pytest.mark.parametrize("spot_s", [math.inf, 1e308, 3600.0])
@pytest.mark.parametrize("wait_s", [math.inf, 1e308, 0.0])
def test_huge_pool_history_gives_a_prior_within_0_and_1(spot_s: float, wait_s: float) -> None:
    history = PoolHistory(pool="spot-a", tries=1, spot_s=spot_s, wait_s=wait_s)
    assert sane(availability_prior(0.5, history).value)


def test_a_pod_created_decades_ago_waits_no_longer_than_its_jobs_window(store: ManifestStore) -> None:
    """The API server's clock (a pod's creation time) is not the store's: a wait counts no longer
    than its job's window (creation to deadline, 6 h here), not the 56 years the clock claims."""
    pools = [SPOT, ON_DEMAND]
    skewed = make_job(store, pools, "skewed")
    store.record_unschedulable(
        skewed,
        0,
        pool=SPOT.name,
        worker="pod-from-1970",
        created_at=dt.datetime(1970, 1, 2, tzinfo=UTC),
        error="0/3 nodes are available",
    )
    job = store.get_job(skewed)
    [row] = [a for a in store.list_attempts(skewed) if a.worker == "pod-from-1970"]
    assert row.ended_at is not None and row.ended_at - row.started_at <= job.deadline - job.created_at
    waited = store.pool_history([SPOT.name], exclude_job="none")[SPOT.name].wait_s
    assert waited <= 6 * 3600.0 + 60.0

    view = read_job_view(store, skewed, now=dt.datetime.now(UTC))
    assert isinstance(view, PlacementView)
    assert sane(view.pool_availability[SPOT.name].value)
    assert not view.pool_availability[SPOT.name].available(view.now.timestamp())  # it did give up now
    decision = decide_for_try(view, store.get_shard(skewed, 1))
    assert decision.action is TryAction.RUN and decision.pool is not None


@pytest.mark.parametrize("spot_s", [math.inf, 1e308, 0.0, 3600.0])
@pytest.mark.parametrize("preemptions", [0, 10**9])
def test_huge_pool_history_gives_a_finite_preemption_prior(spot_s: float, preemptions: int) -> None:
    history = PoolHistory(pool="spot-a", tries=max(1, preemptions), preemptions=preemptions, spot_s=spot_s)
    tries = spot_prior(0.1, history)
    assert math.isfinite(tries.prior_per_hour) and tries.prior_per_hour >= 0, tries
    assert math.isfinite(tries.prior_hours) and tries.prior_hours > 0, tries


@pytest.mark.parametrize("duration", [math.nan, math.inf, -math.inf, 1e308, -1.0])
def test_a_garbage_try_duration_leaves_a_finite_preemption_rate(duration: float) -> None:
    tries = SpotTries(prior_per_hour=0.1)
    for _ in range(3):
        tries = tries.observe(ended_s=NOW, duration_s=duration, preempted=True, commits=0)
    assert math.isfinite(tries.preemptions_per_hour) and tries.preemptions_per_hour >= 0, tries


@pytest.mark.parametrize("garbage", [math.nan])
def test_a_nan_in_pool_history_is_refused_whichever_field(garbage: float) -> None:
    for fields in ({"spot_s": garbage}, {"wait_s": garbage}):
        with pytest.raises(ValueError, match="must be >= 0"):
            PoolHistory(pool="spot-a", **fields)


def test_a_deciding_clock_a_day_ahead_does_not_count_a_day_of_spot_time(store: ManifestStore) -> None:
    job = make_job(store, [SPOT, ON_DEMAND], "ahead")
    store.claim_shard(job, 0, ttl_s=60, worker="w", pool=SPOT.name)  # running for a moment, store clock
    view = read_job_view(store, job, now=dt.datetime.now(UTC) + dt.timedelta(days=1))
    assert isinstance(view, PlacementView)
    assert view.pool_availability[SPOT.name].present_s < 3600.0


def test_corrupt_unschedulable_rows_neither_crash_the_decision_nor_poison_later_jobs(
    store: ManifestStore,
) -> None:
    """Rows no store writes (ended in year 9999, waits of 2000 years or negative), put there by hand."""
    pools = [SPOT, ON_DEMAND]
    earlier = make_job(store, pools, "corrupt")
    now = dt.datetime.now(UTC)
    rows = [
        (dt.datetime(1, 1, 2, tzinfo=UTC), now),  # a 2000-year wait, ended now
        (now - dt.timedelta(minutes=10), dt.datetime(9999, 12, 30, tzinfo=UTC)),  # ends in year 9999
        (now, now - dt.timedelta(hours=5)),  # a negative wait
    ]
    engine = sa.create_engine(store.url)
    try:
        with engine.begin() as conn:
            for n, (started, ended) in enumerate(rows):
                conn.execute(
                    sa.insert(attempts).values(
                        attempt_id=f"a-corrupt-{n}",
                        job_id=earlier,
                        shard_index=0,
                        epoch=-1,
                        worker=f"pod-corrupt-{n}",
                        pool=SPOT.name,
                        started_at=started,
                        ended_at=ended,
                        outcome="unschedulable",
                        error="corrupt",
                        failure_class="transient",
                    )
                )
    finally:
        engine.dispose()
    later = make_job(store, pools, "later")
    history = store.pool_history([SPOT.name], exclude_job=later)[SPOT.name]
    assert history.unschedulable == 2  # the row that ends in year 9999 is not from this store's clock
    view = read_job_view(store, later, now=dt.datetime.now(UTC))
    assert isinstance(view, PlacementView)
    learned = view.pool_availability[SPOT.name]
    assert sane(learned.value)
    assert learned.last_unschedulable_s is not None and learned.last_unschedulable_s <= view.now.timestamp()
    decision = decide_for_try(view, store.get_shard(later, 0))
    assert decision.action is TryAction.RUN and decision.pool is not None
