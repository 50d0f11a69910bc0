"""``ManifestStore.placement_rows``: the rows ``read_job_view`` reads in one transaction are the
``list_*`` rows' columns in the ``list_*`` orders, and the view (and every shard's decision) built
from them is the one built from ``get_job`` + ``list_*`` + ``pool_history``, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.exceptions import JobNotFound
from airflow_deadline_batch.operators.placement import decide_for_try, job_view_of, read_job_view
from airflow_deadline_batch.store import ManifestStore, NewJob
from airflow_deadline_batch.store.placement_rows import AttemptFacts, CommitFacts
from tests.helpers.commits import commit
from tests.helpers.shards import uniform_shards

UTC = dt.timezone.utc
POOLS = (
    PoolSpec(name="spot-a", kind=PoolKind.SPOT, price_per_gpu_hour=1.0, preemptions_per_hour=0.5),
    PoolSpec(name="spot-b", kind=PoolKind.SPOT, price_per_gpu_hour=1.2, decode_tokens_per_s=1200.0),
    PoolSpec(name="od", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0),
)


def make_job(store: ManifestStore, name: str, shards: int = 6) -> str:
    job, _ = store.create_job(
        NewJob(
            deadline=dt.datetime.now(UTC) + dt.timedelta(hours=5),
            input_uri=f"/in/{name}.jsonl",
            input_sha256="0" * 64,
            input_lines=shards * 10,
            input_total_lines=shards * 10,
            output_uri=f"/out/{name}",
            config={"workers": 3, "max_attempts": 100, "pools": [p.to_dict() for p in POOLS]},
        ),
        uniform_shards(shards, microbatches=4, est_work_s=1200.0),
        None,
    )
    return job.job_id


def run_tries(store: ManifestStore, job_id: str) -> None:
    """Preempted tries (some with a commit) on both Spot pools and on-demand, waits for capacity
    (given up and scheduled), and two shards still leased."""
    now = dt.datetime.now(UTC)
    for n in range(14):
        pool = POOLS[n % 3].name
        lease = store.claim_shard(job_id, n % 6, ttl_s=600, worker=f"w{n}", pool=pool)
        if n % 3 == 1:
            commit(
                store,
                lease,
                lease.cursor,
                records=10,
                prompt_tokens=3000 + n,
                completion_tokens=1500 + 7 * n,
                elapsed_s=2.5 + n / 10,
                pool=pool,
            )
        if n < 12:
            store.release(lease, AttemptOutcome.PREEMPTED, "spot reclaimed")
    store.record_unschedulable(
        job_id, 2, pool="spot-b", worker="pod-x", created_at=now - dt.timedelta(minutes=20), error="0/3 nodes"
    )
    store.record_unschedulable(
        job_id,
        3,
        pool="spot-a",
        worker="pod-y",
        created_at=now - dt.timedelta(minutes=9),
        scheduled_at=now - dt.timedelta(minutes=2),
        error="waited",
    )


def test_placement_rows_are_the_list_rows_columns_and_build_the_same_view(store: ManifestStore) -> None:
    earlier = make_job(store, "earlier")
    run_tries(store, earlier)
    job_id = make_job(store, "job")
    run_tries(store, job_id)
    rows = store.placement_rows(job_id)
    assert rows.job == store.get_job(job_id)
    assert rows.shards == store.list_shards(job_id)
    listed_commits = store.list_commits(job_id)
    assert rows.commits == [
        CommitFacts(*(getattr(c, f) for f in CommitFacts._fields)) for c in listed_commits
    ]
    listed = store.list_attempts(job_id)
    assert rows.attempts == [AttemptFacts(*(getattr(a, f) for f in AttemptFacts._fields)) for a in listed]
    assert {a.outcome for a in rows.attempts} >= {AttemptOutcome.PREEMPTED, AttemptOutcome.UNSCHEDULABLE}
    assert rows.history == store.pool_history(["spot-a", "spot-b"], exclude_job=job_id)
    assert rows.history["spot-a"].tries > 0  # the earlier job's tries, not this one's

    now = dt.datetime.now(UTC)
    view = read_job_view(store, job_id, now=now)
    before = job_view_of(
        store.get_job(job_id),
        store.list_shards(job_id),
        listed_commits,
        listed,
        now=now,
        history=store.pool_history(["spot-a", "spot-b"], exclude_job=job_id),
    )
    fields = [f.name for f in dataclasses.fields(view)]
    assert {f: getattr(view, f) for f in fields} == {f: getattr(before, f) for f in fields}
    assert view.spot_tries.tries > 0 and view.calibration.estimate("spot-b").samples > 0
    for shard in store.list_shards(job_id):
        assert decide_for_try(view, shard) == decide_for_try(before, shard)


def test_placement_rows_with_named_spot_pools_and_of_an_unknown_job(store: ManifestStore) -> None:
    job_id = make_job(store, "job")
    assert store.placement_rows(job_id, spot_pools=[]).history == {}
    assert set(store.placement_rows(job_id, spot_pools=["spot-b"]).history) == {"spot-b"}
    with pytest.raises(JobNotFound, match="check the job ID"):
        store.placement_rows("no-such-job")
