"""When the local runner races a running Spot try (``local.runner.race_pool``, issue 13).

A real store and a real plan; the job view is read at chosen instants (``now``), so the slack,
not the wall clock, decides whether the safety rule escalates the running try, and
``core.placement.should_speculate`` whether racing beats escalating.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.core.pools import PoolKind, PoolSpec, default_local_pools
from airflow_deadline_batch.local.runner import race_pool
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input

pytestmark = pytest.mark.integration

START = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
DEADLINE = START + dt.timedelta(hours=1)
TAIL = DEADLINE - dt.timedelta(minutes=2)  # little slack left: the safety rule escalates


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ManifestStore]:
    manifest_store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        yield manifest_store
    finally:
        manifest_store.close()


def planned(store: ManifestStore, tmp_path: Path, pools: tuple[PoolSpec, ...] | None = None) -> str:
    source = tmp_path / f"in-{len(store.list_jobs())}.jsonl"
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(mixed_input(40, seed=3).write(source)),
            deadline=DEADLINE,
            output_uri=str(tmp_path / "out"),
            microbatch_size=4,
            max_shards=2,  # shards of ~50 s of work: short against the 20 s changeover
            max_invalid_fraction=0.5,
            workers=2,
            pools=pools or default_local_pools(),
        ),
    )
    return plan.job_id


def decide(store: ManifestStore, job_id: str, pool: str, at: dt.datetime) -> PoolSpec | None:
    view = read_job_view(store, job_id, now=at, parallelism=2)
    return race_pool(view, store.get_shard(job_id, 0), pool)


def test_a_tail_spot_try_the_rule_escalates_races_on_demand(store: ManifestStore, tmp_path: Path) -> None:
    job_id = planned(store, tmp_path)
    store.claim_shard(job_id, 0, ttl_s=600, worker="w", pool="local-spot")
    assert decide(store, job_id, "local-spot", START) is None  # plenty of slack: Spot goes on alone
    pool = decide(store, job_id, "local-spot", TAIL)
    assert pool is not None and pool.kind is PoolKind.ON_DEMAND


def test_no_race_for_an_on_demand_try_or_a_shard_already_raced(store: ManifestStore, tmp_path: Path) -> None:
    job_id = planned(store, tmp_path)
    store.claim_shard(job_id, 0, ttl_s=600, worker="w", pool="local-on-demand")
    assert decide(store, job_id, "local-on-demand", TAIL) is None
    other = planned(store, tmp_path)
    store.claim_shard(other, 0, ttl_s=600, worker="w", pool="local-spot")
    store.claim_race(other, 0, ttl_s=600, worker="r", pool="local-on-demand")
    assert decide(store, other, "local-spot", TAIL) is None  # one racer per shard at most


def test_no_race_when_the_gain_does_not_beat_the_cost(store: ManifestStore, tmp_path: Path) -> None:
    spot, on_demand = default_local_pools()
    # Spot preempted every few seconds: the running try almost never wins, the duplicate is waste
    stormy = PoolSpec(**{**spot.__dict__, "preemptions_per_hour": 1200.0})
    job_id = planned(store, tmp_path, (stormy, on_demand))
    store.claim_shard(job_id, 0, ttl_s=600, worker="w", pool=stormy.name)
    assert decide(store, job_id, stormy.name, TAIL) is None
