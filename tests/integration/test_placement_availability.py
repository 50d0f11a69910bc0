"""Placement learns a pool's Spot availability from tries that waited for capacity in vain.

A Spot try whose pod stayed unschedulable until its startup timeout is recorded as an
``unschedulable`` attempt (``ManifestStore.record_unschedulable``, what the pod operator calls);
the next decisions on that pool, of the same job or a later one (``ManifestStore.pool_history``
through ``read_job_view``), see the pool out of capacity for a while (``spot_available``) and its
availability lowered (``spot_availability``), so the rule with its rate rule on escalates to
on-demand where it would have waited for Spot at the prior. (The default policy has the rate rule
off, docs/simulator.md; there the learned availability ranks several Spot pools, and a pool out of
capacity is passed over or waited for.) On SQLite and PostgreSQL.
"""

from __future__ import annotations

import datetime as dt

import pytest

from airflow_deadline_batch.core.placement import PolicyParams
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.metrics import attempt_totals
from airflow_deadline_batch.operators.placement import (
    PlacementView,
    TryAction,
    TryDecision,
    decide_for_try,
    on_demand_pool,
    placement_snapshot,
    read_job_view,
)
from airflow_deadline_batch.service.settlement import attempt_usage
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.ui.model import cost_summary
from tests.integration.test_placement_history import make_job

UTC = dt.timezone.utc
ON_DEMAND = PoolSpec(name="gpu-on-demand", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0)
SPOT_A = PoolSpec(name="spot-a", kind=PoolKind.SPOT, price_per_gpu_hour=1.0, preemptions_per_hour=0.1)
SPOT_B = PoolSpec(name="spot-b", kind=PoolKind.SPOT, price_per_gpu_hour=1.2, preemptions_per_hour=0.1)
#: the rule with its rate rule: escalate while the capacity Spot is expected to give falls short
RATE_RULE = PolicyParams(rate_rule=True)


def wait_in_vain(store: ManifestStore, job_id: str, pool: str, tries: int, minutes: float) -> None:
    """``tries`` Spot pods of the job that each waited ``minutes`` for capacity and gave up now."""
    for n in range(tries):
        created = dt.datetime.now(UTC) - dt.timedelta(minutes=minutes)
        store.record_unschedulable(
            job_id, n % 6, pool=pool, worker=f"pod-{n}", created_at=created, error="0/3 nodes are available"
        )


def lease_started(store: ManifestStore, job_id: str) -> dt.datetime:
    [running] = [a for a in store.list_attempts(job_id) if a.outcome is AttemptOutcome.RUNNING]
    return running.started_at


def place(
    store: ManifestStore, job_id: str, policy: PolicyParams | None = None
) -> tuple[TryDecision, PlacementView]:
    view = read_job_view(store, job_id, now=dt.datetime.now(UTC))
    assert isinstance(view, PlacementView)
    decision = decide_for_try(view, store.get_shard(job_id, 0), policy=policy)
    assert decision.action is TryAction.RUN and decision.pool is not None
    return decision, view


def test_a_pool_whose_tries_waited_in_vain_sends_the_next_job_on_demand(store: ManifestStore) -> None:
    pools = [SPOT_A, ON_DEMAND]
    before, _ = place(store, make_job(store, pools, "before"), RATE_RULE)
    assert before.pool == SPOT_A and "Spot is available" in before.reason

    # a little waiting: the pool is out of capacity now, but the prior still expects enough of it
    glimpse = make_job(store, pools, "glimpse")
    wait_in_vain(store, glimpse, SPOT_A.name, tries=1, minutes=10)
    waits_job = make_job(store, pools, "waits")
    for policy in (RATE_RULE, None):
        waits, _ = place(store, waits_job, policy)
        assert waits.pool == SPOT_A and "wait for Spot" in waits.reason

    # three hours of waiting in vain: availability ~0.1, too little for the rate the work needs
    first = make_job(store, pools, "first")
    wait_in_vain(store, first, SPOT_A.name, tries=6, minutes=30)
    second = make_job(store, pools, "second")
    decision, view = place(store, second, RATE_RULE)
    assert decision.pool == ON_DEMAND
    assert "expected capacity is short" in decision.reason
    learned = view.pool_availability[SPOT_A.name]
    assert learned.value < 0.15 and not learned.available(view.now.timestamp())

    history = store.pool_history([SPOT_A.name], exclude_job=second)[SPOT_A.name]
    assert (history.tries, history.unschedulable) == (0, 7)  # a wait is not a Spot try
    assert history.wait_s / 3600.0 > 3.0
    assert store.pool_history([SPOT_A.name], exclude_job=second, limit=2)[SPOT_A.name].unschedulable == 2


def test_the_job_learns_from_its_own_waits_and_a_start_brings_the_pool_back(store: ManifestStore) -> None:
    pools = [SPOT_A, ON_DEMAND]
    job = make_job(store, pools, "job")
    wait_in_vain(store, job, SPOT_A.name, tries=6, minutes=30)
    decision, view = place(store, job, RATE_RULE)
    assert decision.pool == ON_DEMAND
    # the waits are no Spot tries of the job: no Spot time, no preemption, no storm
    assert view.pool_tries[SPOT_A.name].tries == 0 and view.spot_tries.tries == 0

    other = make_job(store, pools, "other")
    lease = store.claim_shard(other, 0, ttl_s=60, worker="w", pool=SPOT_A.name)  # capacity is back
    decision, view = place(store, job, RATE_RULE)
    assert view.pool_availability[SPOT_A.name].available(view.now.timestamp())
    assert decision.pool == SPOT_A and "Spot is available" in decision.reason
    store.release(lease, AttemptOutcome.PREEMPTED, "spot reclaimed")


def test_with_two_spot_pools_a_pool_out_of_capacity_is_passed_over(store: ManifestStore) -> None:
    pools = [SPOT_A, SPOT_B, ON_DEMAND]
    job = make_job(store, pools, "job")
    assert place(store, job)[0].pool == SPOT_A  # the cheaper one
    wait_in_vain(store, job, SPOT_A.name, tries=1, minutes=10)
    decision, view = place(store, job)
    assert decision.pool == SPOT_B
    assert decision.placement is not None and decision.placement.spot_pool == SPOT_B.name
    assert view.pool_availability[SPOT_B.name].absent_s == 0


def test_an_unschedulable_try_holds_no_lease_and_bills_nothing(store: ManifestStore) -> None:
    pools = [SPOT_A, ON_DEMAND]
    job_id = make_job(store, pools, "job")
    wait_in_vain(store, job_id, SPOT_A.name, tries=1, minutes=30)
    wait_in_vain(store, job_id, SPOT_A.name, tries=1, minutes=30)  # the same pod again: once
    [attempt] = store.list_attempts(job_id)
    assert attempt.outcome is AttemptOutcome.UNSCHEDULABLE and attempt.ended_at is not None
    assert (attempt.ended_at - attempt.started_at).total_seconds() > 29 * 60
    shard = store.get_shard(job_id, 0)
    assert shard.lease_attempt_id is None and shard.state.value == "pending"
    lease = store.claim_shard(job_id, 0, ttl_s=60, worker="w", pool=SPOT_A.name)  # the shard is free
    assert lease.epoch != attempt.epoch
    [usage] = [
        u
        for u in attempt_usage(store.get_job(job_id), store.list_attempts(job_id), [], {}, pools)
        if u.attempt_id == attempt.attempt_id
    ]
    assert usage.gpu_seconds == 0.0 and usage.cost == 0.0
    # nor do the gauges and the job page count the wait as GPU time (the claimed try runs now)
    view = read_job_view(store, job_id, now=dt.datetime.now(UTC) + dt.timedelta(minutes=10))
    tries = store.list_attempts(job_id)
    ran_s = (view.now - lease_started(store, job_id)).total_seconds()
    assert attempt_totals(view, tries, []).cost == pytest.approx(
        ran_s * SPOT_A.price_per_gpu_hour / 3600, rel=0.01
    )
    assert cost_summary(view, tries, []).spot_share == 1.0


def test_a_wait_that_ended_in_a_start_lowers_availability_but_leaves_the_pool_available(
    store: ManifestStore,
) -> None:
    pools = [SPOT_A, ON_DEMAND]
    first = make_job(store, pools, "first")
    now = dt.datetime.now(UTC)
    for n in range(6):  # each pod waited 30 min, then was scheduled and ran
        store.record_unschedulable(
            first,
            n,
            pool=SPOT_A.name,
            worker=f"pod-{n}",
            created_at=now - dt.timedelta(minutes=31),
            scheduled_at=now - dt.timedelta(minutes=1),
            error="waited to be scheduled",
        )
    waits = [a for a in store.list_attempts(first) if a.outcome is AttemptOutcome.UNSCHEDULABLE]
    assert len(waits) == 6 and all(a.failure_class is None for a in waits)  # no failed try
    second = make_job(store, pools, "second")
    history = store.pool_history([SPOT_A.name], exclude_job=second)[SPOT_A.name]
    assert history.unschedulable == 6 and history.last_unschedulable_s is None
    decision, view = place(store, second)
    learned = view.pool_availability[SPOT_A.name]
    assert learned.value < 0.15 and learned.available(view.now.timestamp())
    snapshot = placement_snapshot(view, 0, on_demand_pool(view))
    assert snapshot.spot_available and snapshot.spot_availability == learned.value
    assert decision.pool == SPOT_A and "Spot is available" in decision.reason
