"""The job view counts a race's workers (``operators.placement.leased_workers``, issue 13).

``core.job_view`` places a leased shard's worker on the shard's ``last_pool``. A racer is a second
worker of its shard, on on-demand; and a racer promoted to the primary lease (its Spot try ended
first) runs on on-demand while ``last_pool`` still names the Spot pool. Both skewed what the other
shards' decisions see: the job's on-demand workers (the expected service rate of
``core.placement.breakdown``) and its Spot workers (``in_storm``'s one-probe rule, the cost cap's
Spot waste). A real store and a real plan; the rows are the store's own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.core.placement import breakdown
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input

pytestmark = pytest.mark.integration

START = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ManifestStore]:
    manifest_store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        yield manifest_store
    finally:
        manifest_store.close()


def planned(store: ManifestStore, tmp_path: Path) -> str:
    """A job of three shards and three workers, its Spot and on-demand pools the local ones."""
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(mixed_input(60, seed=5).write(tmp_path / "in.jsonl")),
            deadline=START + dt.timedelta(hours=1),
            output_uri=str(tmp_path / "out"),
            microbatch_size=4,
            max_shards=3,
            max_invalid_fraction=0.5,
            workers=3,
            pools=default_local_pools(),
        ),
    )
    assert plan.shards == 3
    return plan.job_id


def test_a_racer_counts_as_an_on_demand_worker_of_the_job(store: ManifestStore, tmp_path: Path) -> None:
    job_id = planned(store, tmp_path)
    store.claim_shard(job_id, 0, ttl_s=600, worker="spot-0", pool="local-spot")
    before = read_job_view(store, job_id, now=START)
    store.claim_race(job_id, 0, ttl_s=600, worker="racer-0", pool="local-on-demand")
    view = read_job_view(store, job_id, now=START)
    assert (before.on_demand_shards, before.spot_shards) == (frozenset(), {0})
    assert (view.on_demand_shards, view.spot_shards) == ({0}, {0})  # two workers on shard 0
    # what shard 1's decision sees: one worker of the job on on-demand (the racer), one on Spot
    seen, unseen = view.snapshot(1), before.snapshot(1)
    assert (seen.on_demand_workers, seen.spot_workers) == (1, 1)
    assert unseen.on_demand_workers == 0
    # the skew: an on-demand worker is sure capacity, so the expected service rate was too low
    assert breakdown(seen).expected_rate > breakdown(unseen).expected_rate


def test_a_promoted_racer_counts_on_its_own_pool_not_the_spot_tries(
    store: ManifestStore, tmp_path: Path
) -> None:
    job_id = planned(store, tmp_path)
    spot = store.claim_shard(job_id, 0, ttl_s=600, worker="spot-0", pool="local-spot")
    store.claim_race(job_id, 0, ttl_s=600, worker="racer-0", pool="local-on-demand")
    store.release(spot, AttemptOutcome.PREEMPTED, "Spot reclaim")  # the racer takes the primary lease
    shard = store.get_shard(job_id, 0)
    # the store names the promoted racer's pool as the shard's (store/leases.py)
    assert shard.race_attempt_id is None and shard.last_pool == "local-on-demand"
    view = read_job_view(store, job_id, now=START)
    assert (view.on_demand_shards, view.spot_shards) == ({0}, frozenset())
    seen = view.snapshot(1)
    assert (seen.on_demand_workers, seen.spot_workers) == (1, 0)  # no Spot worker blocks a probe
    unchanged = dataclasses.replace(seen, on_demand_workers=0, spot_workers=1)  # as core.job_view had it
    assert breakdown(seen).expected_rate > breakdown(unchanged).expected_rate
