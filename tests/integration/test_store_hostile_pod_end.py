"""An ended pod's abandon racing its own worker (hostile review s22), on SQLite and PostgreSQL.

``DeadlineShardPodOperator.end_pod_attempts`` abandons the running attempts of a pod it read as
ended. The read can be wrong about the worker (a pod force-deleted while its container still runs
is gone, ``None``, to the operator), so the abandon may land while that worker commits its last
microbatch or completes the shard. The store's fencing must make every interleaving harmless:

* an abandon before the completion refuses it (``LeaseLost``), spends no budget (the attempt
  committed), and the next attempt, finding every microbatch committed, completes the shard at once;
* an abandon after the completion changes nothing;
* run concurrently, exactly one of the two takes effect, and the attempt's outcome, the shard's
  state and the commits agree with it, for the shard's own attempt and for a racer's;
* an abandon racing a commit: the commit either lands (and the attempt then ends) or is refused, and
  a commit row exists exactly when the commit returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.exceptions import LeaseLost
from airflow_deadline_batch.store import Lease, ManifestStore
from tests.integration.test_store import commit, new_job

pytestmark = [pytest.mark.integration]
ROUNDS = 12  # interleavings tried per test (each a fresh job: a few ms on either database)


def abandon(store: ManifestStore, lease: Lease) -> bool:
    return store.abandon_attempt(
        lease.job_id,
        lease.shard_index,
        lease.attempt_id,
        "pod p ended (exit 137)",
        failure=FailureClass.PREEMPTED,
    )


def outcome_of(store: ManifestStore, lease: Lease) -> AttemptOutcome:
    [attempt] = [a for a in store.list_attempts(lease.job_id) if a.attempt_id == lease.attempt_id]
    return attempt.outcome


def all_committed(store: ManifestStore) -> Lease:
    """A one-shard job whose attempt committed both its microbatches and has yet to complete it."""
    job, _ = store.create_job(*new_job(shards=1, microbatches=2))
    lease = store.claim_shard(job.job_id, 0, ttl_s=600, worker="p:7", pool="spot")
    for seq in range(2):
        lease = commit(store, lease, seq)
    return lease


def test_an_abandon_before_the_completion_refuses_it_and_the_next_attempt_completes_at_once(
    store: ManifestStore,
) -> None:
    lease = all_committed(store)
    assert abandon(store, lease)
    with pytest.raises(LeaseLost):
        store.complete_shard(lease)
    shard = store.get_shard(lease.job_id, 0)
    assert (shard.state, shard.cursor, shard.failures) == (ShardState.RETRYABLE_FAILURE, 2, 0)
    nxt = store.claim_shard(lease.job_id, 0, ttl_s=600, worker="q:8", pool="on-demand")
    assert nxt.cursor == nxt.num_microbatches == 2  # nothing left to run: the worker completes at once
    store.complete_shard(nxt)
    assert store.get_shard(lease.job_id, 0).state is ShardState.SUCCEEDED
    commits = [c for c in store.list_commits(lease.job_id) if c.shard_index == 0]
    assert [(c.seq, c.attempt_id) for c in commits] == [(0, lease.attempt_id), (1, lease.attempt_id)]


def test_an_abandon_after_the_completion_changes_nothing(store: ManifestStore) -> None:
    lease = all_committed(store)
    store.complete_shard(lease)
    assert not abandon(store, lease)
    assert store.get_shard(lease.job_id, 0).state is ShardState.SUCCEEDED
    assert outcome_of(store, lease) is AttemptOutcome.SUCCEEDED
    assert store.lease_holders(lease.job_id, 0) == []


def race(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run both at once (released together); each one's result, or the exception it raised."""
    gate = threading.Barrier(2)
    results: list[Any] = [None, None]

    def run(i: int, call: Callable[[], Any]) -> None:
        gate.wait()
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - the race's loser: asserted by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a store call hung"
    return results[0], results[1]


@pytest.mark.parametrize("racer", [False, True], ids=["own-attempt", "racer"])
def test_an_abandon_racing_the_completion_lets_exactly_one_take_effect(
    store: ManifestStore, racer: bool
) -> None:
    for _ in range(ROUNDS):
        job, _ = store.create_job(*new_job(shards=1, microbatches=2))
        lease = store.claim_shard(job.job_id, 0, ttl_s=600, worker="p:7", pool="spot")
        if racer:  # the racer commits both microbatches; the Spot attempt stalls (lost_race at the end)
            lease = store.claim_race(job.job_id, 0, ttl_s=600, worker="p-race:9", pool="on-demand")
        for seq in range(2):
            lease = commit(store, lease, seq)
        completed, abandoned = race(
            lambda lease=lease: store.complete_shard(lease), lambda lease=lease: abandon(store, lease)
        )
        shard = store.get_shard(job.job_id, 0)
        if abandoned is True:
            assert isinstance(completed, LeaseLost), completed
            assert outcome_of(store, lease) is AttemptOutcome.ABANDONED
            assert shard.state is not ShardState.SUCCEEDED and shard.failures == 0
        else:
            assert abandoned is False and completed is None, (abandoned, completed)
            assert outcome_of(store, lease) is AttemptOutcome.SUCCEEDED
            assert shard.state is ShardState.SUCCEEDED
        assert [c.seq for c in store.list_commits(job.job_id) if c.shard_index == 0] == [0, 1]


def test_an_abandon_racing_a_commit_leaves_a_commit_row_exactly_when_the_commit_returned(
    store: ManifestStore,
) -> None:
    for _ in range(ROUNDS):
        job, _ = store.create_job(*new_job(shards=1, microbatches=2))
        lease = store.claim_shard(job.job_id, 0, ttl_s=600, worker="p:7", pool="spot")
        committed, abandoned = race(
            lambda lease=lease: commit(store, lease, 0), lambda lease=lease: abandon(store, lease)
        )
        assert abandoned is True, abandoned  # a commit never ends the attempt: the abandon always does
        rows = [c for c in store.list_commits(job.job_id) if c.shard_index == 0]
        shard = store.get_shard(job.job_id, 0)
        if isinstance(committed, Exception):
            assert isinstance(committed, LeaseLost), committed
            assert rows == [] and shard.cursor == 0
        else:
            assert [(c.seq, c.attempt_id) for c in rows] == [(0, lease.attempt_id)] and shard.cursor == 1
        assert outcome_of(store, lease) is AttemptOutcome.ABANDONED and shard.failures == 0
        assert shard.state is ShardState.RETRYABLE_FAILURE and shard.lease_attempt_id is None
