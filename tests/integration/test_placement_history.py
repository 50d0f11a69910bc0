"""Placement learns a pool from earlier jobs: a pool declared reliable but seen flaky is avoided.

The first job's Spot tries on a pool are preempted (rows in ``adb_attempts``); the second job, on
the same pool names, places with them as the prior of its rates (``ManifestStore.pool_history``
through ``read_job_view``), on SQLite and PostgreSQL.
"""

from __future__ import annotations

import datetime as dt

from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.operators.placement import TryAction, decide_for_try, read_job_view
from airflow_deadline_batch.store import ManifestStore, NewJob
from tests.helpers.shards import uniform_shards

UTC = dt.timezone.utc
ON_DEMAND = PoolSpec(name="gpu-on-demand", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0)
RELIABLE = {"kind": PoolKind.SPOT, "price_per_gpu_hour": 1.0, "preemptions_per_hour": 0.1}
SPOT_A = PoolSpec(name="spot-a", **RELIABLE)  # type: ignore[arg-type]
SPOT_B = PoolSpec(name="spot-b", **{**RELIABLE, "price_per_gpu_hour": 1.2})  # type: ignore[arg-type]


def make_job(store: ManifestStore, pools: list[PoolSpec], key: str) -> str:
    """A six-hour job of 6 shards of 30 GPU-minutes, 2 workers: slack for Spot all the way."""
    job, _ = store.create_job(
        NewJob(
            deadline=dt.datetime.now(UTC) + dt.timedelta(hours=6),
            input_uri="/data/in.jsonl",
            input_sha256="0" * 64,
            input_lines=60,
            input_total_lines=60,
            output_uri=f"/data/{key}",
            config={"workers": 2, "engine": "echo", "pools": [p.to_dict() for p in pools]},
        ),
        uniform_shards(6, microbatches=5, est_work_s=1800.0),
        None,
    )
    return job.job_id


def preempt(store: ManifestStore, job_id: str, pool: str, tries: int) -> None:
    for n in range(tries):
        lease = store.claim_shard(job_id, n % 6, ttl_s=60, worker=f"w{n}", pool=pool)
        store.release(lease, AttemptOutcome.PREEMPTED, "spot reclaimed")


def place(store: ManifestStore, job_id: str, shard: int = 0):  # type: ignore[no-untyped-def]
    view = read_job_view(store, job_id, now=dt.datetime.now(UTC))
    decision = decide_for_try(view, store.get_shard(job_id, shard))
    assert decision.action is TryAction.RUN and decision.pool is not None
    return decision


def test_a_pool_seen_flaky_by_an_earlier_job_sends_the_next_one_on_demand(store: ManifestStore) -> None:
    pools = [SPOT_A, ON_DEMAND]
    before = make_job(store, pools, "before")
    assert place(store, before).pool == SPOT_A  # declared reliable, nothing seen: Spot

    first = make_job(store, pools, "first")
    preempt(store, first, SPOT_A.name, tries=12)
    second = make_job(store, pools, "second")
    decision = place(store, second)
    assert decision.pool == ON_DEMAND
    assert "expected to cost" in decision.reason
    # the job's own tries are not history, and only finished tries on the named pool count
    assert store.pool_history([SPOT_A.name], exclude_job=first)[SPOT_A.name].tries == 0
    history = store.pool_history([SPOT_A.name, SPOT_B.name], exclude_job=second)
    assert (history[SPOT_A.name].tries, history[SPOT_A.name].preemptions) == (12, 12)
    assert history[SPOT_B.name].tries == 0
    assert store.pool_history([SPOT_A.name], exclude_job=second, limit=5)[SPOT_A.name].tries == 5


def test_with_two_spot_pools_the_next_job_moves_to_the_other_one(store: ManifestStore) -> None:
    pools = [SPOT_A, SPOT_B, ON_DEMAND]
    before = make_job(store, pools, "before")
    assert place(store, before).pool == SPOT_A  # the cheaper of two reliable pools

    first = make_job(store, pools, "first")
    preempt(store, first, SPOT_A.name, tries=12)
    second = make_job(store, pools, "second")
    decision = place(store, second)
    assert decision.pool == SPOT_B
    assert decision.placement is not None and decision.placement.spot_pool == SPOT_B.name
