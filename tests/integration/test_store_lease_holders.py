"""``ManifestStore.lease_holders``: the shard's running attempts that hold its lease or its racing
lease, on SQLite and PostgreSQL (what the pod operator reads to end the attempts of a pod that ended)."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.exceptions import StoreError
from airflow_deadline_batch.store import ManifestStore
from tests.integration.test_store import new_job

pytestmark = [pytest.mark.integration]


def test_lease_holders_are_the_running_attempts_holding_the_shard(store: ManifestStore) -> None:
    job, _ = store.create_job(*new_job(shards=2))
    assert store.lease_holders(job.job_id, 0) == []  # pending: nobody holds it
    spot = store.claim_shard(job.job_id, 0, ttl_s=600, worker="spot-pod:1", pool="spot")
    racer = store.claim_race(job.job_id, 0, ttl_s=600, worker="spot-pod-race:1", pool="on-demand")
    store.claim_shard(job.job_id, 1, ttl_s=600, worker="other:1", pool="spot")
    held = store.lease_holders(job.job_id, 0)
    assert [(a.attempt_id, a.worker, a.speculative) for a in held] == [
        (spot.attempt_id, "spot-pod:1", False),
        (racer.attempt_id, "spot-pod-race:1", True),
    ]
    # the Spot attempt ends: the racer is promoted to the lease and is the one holder left
    assert store.abandon_attempt(job.job_id, 0, spot.attempt_id, "pod ended", failure=FailureClass.PREEMPTED)
    [left] = store.lease_holders(job.job_id, 0)
    assert left.attempt_id == racer.attempt_id and left.outcome is AttemptOutcome.RUNNING
    # a second abandon of the ended attempt changes nothing (fenced by its ID)
    assert not store.abandon_attempt(
        job.job_id, 0, spot.attempt_id, "again", failure=FailureClass.DETERMINISTIC
    )
    ended = next(a for a in store.list_attempts(job.job_id) if a.attempt_id == spot.attempt_id)
    assert (ended.outcome, ended.failure_class) == (AttemptOutcome.ABANDONED, "preempted")
    assert [a.attempt_id for a in store.lease_holders(job.job_id, 0)] == [racer.attempt_id]


def test_lease_holders_of_a_missing_shard_name_the_fix(store: ManifestStore) -> None:
    job, _ = store.create_job(*new_job(shards=1))
    with pytest.raises(StoreError, match="has no shard 7; check the shard index"):
        store.lease_holders(job.job_id, 7)
