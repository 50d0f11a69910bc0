"""``ManifestStore.fail_shard``: what a sensor after the shard tasks does with a shard whose Airflow
task failed for good, on SQLite and PostgreSQL. The store is the truth for records: a committed
shard stays succeeded; any other unfinished shard fails for good, fenced against a worker left behind."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.exceptions import LeaseLost
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.triggers.completeness import CompletenessStatus, evaluate_progress, plain
from tests.helpers.commits import commit, commit_rest
from tests.integration.test_store import new_job

pytestmark = [pytest.mark.integration]

REASON = "its Airflow task shard[{}] failed for good (no retry left)"


def test_unfinished_shards_fail_for_good_and_a_committed_one_stays_succeeded(store: ManifestStore) -> None:
    job, _ = store.create_job(*new_job(shards=4))
    job_id = job.job_id
    done = store.claim_shard(job_id, 0, ttl_s=600, worker="w:0")
    store.complete_shard(commit_rest(store, done))  # committed, then its task was lost
    held = commit(store, store.claim_shard(job_id, 1, ttl_s=600, worker="w:1"), 0)  # still leased
    preempted = store.claim_shard(job_id, 3, ttl_s=600, worker="w:3")
    store.abandon_attempt(job_id, 3, preempted.attempt_id, "killed", failure=FailureClass.PREEMPTED)
    before = {s.shard_index: s for s in store.list_shards(job_id)}
    assert before[2].state is ShardState.PENDING and before[3].state is ShardState.RETRYABLE_FAILURE

    after = {i: store.fail_shard(job_id, i, REASON.format(i)) for i in range(4)}

    assert after == {
        0: ShardState.SUCCEEDED,
        1: ShardState.TERMINAL_FAILURE,
        2: ShardState.TERMINAL_FAILURE,
        3: ShardState.TERMINAL_FAILURE,
    }
    shards = {s.shard_index: s for s in store.list_shards(job_id)}
    assert shards[0] == before[0]  # untouched: not even its epoch moved
    for index in (1, 2, 3):
        assert shards[index].state is ShardState.TERMINAL_FAILURE
        assert shards[index].last_error == REASON.format(index)
        assert shards[index].epoch == before[index].epoch + 1 and shards[index].lease_attempt_id is None
    # the worker its task left behind is fenced: its attempt ended, its next commit refused
    attempt = next(a for a in store.list_attempts(job_id) if a.attempt_id == held.attempt_id)
    assert attempt.outcome is AttemptOutcome.LOST_LEASE and "shard[1] failed for good" in str(attempt.error)
    with pytest.raises(LeaseLost):
        commit(store, held, 1)
    # a repeat changes nothing: the first reason stands
    assert store.fail_shard(job_id, 1, "again") is ShardState.TERMINAL_FAILURE
    assert store.get_shard(job_id, 1).last_error == REASON.format(1)
    # no shard can run any more: the wait is over, and finalization publishes the job partial
    event = evaluate_progress(job_id, plain(store.progress(job_id)))
    assert event is not None and event.status is CompletenessStatus.FAILED


def test_a_stopped_job_keeps_its_shards_as_they_are(store: ManifestStore) -> None:
    job, _ = store.create_job(*new_job(shards=2))
    store.cancel_job(job.job_id, reason="cancelled by on-call")

    assert store.fail_shard(job.job_id, 0, REASON.format(0)) is ShardState.PENDING
    shard = store.get_shard(job.job_id, 0)
    assert shard.state is ShardState.PENDING and shard.last_error is None
