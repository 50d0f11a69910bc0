"""A stall is not a preemption: what a pool is learned to do (docs/design.md §4.4, issue 13).

Real subprocess workers on a Spot pool, real signals, SQLite and PostgreSQL. A worker SIGSTOPped
past its lease while another claim finishes the shard, then SIGCONTed, reports back alive: its
attempt ends ``stalled``, which neither the job view's learned preemptions (``spot_tries``) nor
what a later job learns of the pool (``pool_history``) counts. The same stall whose worker never
reports back (SIGKILLed while stopped) stays ``lost_lease``, a preemption; so does a SIGTERM
notice (``preempted``). In every case the progress report counts what the job view counts. Then
the store's side of the rule: reporting a stall changes the attempt row only, under its own ID
and epoch, and never gives a lease back; and the tail race's case, a primary that wakes after its
lease lapsed beside a live racer (which is promoted and finishes), is no preemption either.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.store import Lease, ManifestStore
from tests.integration.test_store_race import claim, commit, new_job, race
from tests.integration.test_worker import (
    EXIT_DONE,
    EXIT_RETRYABLE,
    Worker,
    Workers,
    create_test_job,
    input_lines,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPOT = PoolSpec(name="local-spot", kind=PoolKind.SPOT, price_per_gpu_hour=1.0, preemptions_per_hour=0.5)
ON_DEMAND = PoolSpec(name="local-on-demand", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0)
CONFIG = {"pools": [SPOT.to_dict(), ON_DEMAND.to_dict()], "workers": 1}


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    try:
        yield pool
    finally:
        pool.cleanup()  # SIGKILL ends a stopped worker too


def learned_preemptions(store: ManifestStore, job_id: str, later_id: str) -> tuple[int, int, int]:
    """Preemptions of ``job_id``: its job view's Spot tries, its progress report, ``later_id``'s prior."""
    view = read_job_view(store, job_id, now=dt.datetime.now(dt.timezone.utc))
    history = store.pool_history([SPOT.name], exclude_job=later_id)[SPOT.name]
    return view.spot_tries.preemptions, store.progress(job_id).preemptions, history.preemptions


def two_jobs(store: ManifestStore, tmp_path: Path) -> tuple[str, str]:
    """The job under attack, and a later job on the same pools (what it learns of the Spot pool)."""
    job = create_test_job(store, str(tmp_path / "data"), input_lines(6), microbatch_size=2, config=CONFIG)
    later = create_test_job(store, str(tmp_path / "later"), input_lines(1), microbatch_size=1, config=CONFIG)
    return job.job_id, later.job_id


def stop_past_its_lease(
    store: ManifestStore, store_url: str, job_id: str, tmp_path: Path, workers: Workers
) -> Worker:
    """A Spot worker SIGSTOPped between writing microbatch 1 and committing it, until its lease expired."""
    pause = tmp_path / "paused"
    first = workers.start(
        store_url,
        job_id,
        "--pool",
        SPOT.name,
        "--lease-ttl",
        "2",
        env={"ADB_FAULT_PAUSE_AFTER_WRITE": str(pause), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1"},
    )
    wait_until(pause.exists, "the first worker to write microbatch 1")
    first.kill(signal.SIGSTOP)  # it stopped heartbeating first: it holds no database lock
    expires = store.get_shard(job_id, 0).lease_expires_at
    assert expires is not None
    wait_until(lambda: store.db_time() > expires, "the stopped worker's lease to expire")
    return first


@pytest.mark.parametrize("reports_back", [True, False], ids=["resumed", "never-heard-from"])
def test_a_worker_stalled_past_its_lease_is_not_learned_as_a_preemption_of_its_pool(
    store: ManifestStore, store_url: str, tmp_path: Path, workers: Workers, reports_back: bool
) -> None:
    job_id, later_id = two_jobs(store, tmp_path)
    first = stop_past_its_lease(store, store_url, job_id, tmp_path, workers)
    second = workers.run(store_url, job_id, "--pool", SPOT.name)  # takes the shard over, finishes
    assert second.popen.returncode == EXIT_DONE, second.log
    stalled, done = store.list_attempts(job_id)
    assert (stalled.outcome, done.outcome) == (AttemptOutcome.LOST_LEASE, AttemptOutcome.SUCCEEDED)
    assert learned_preemptions(store, job_id, later_id) == (1, 1, 1)  # until its worker is heard from

    if reports_back:
        first.kill(signal.SIGCONT)
        Path(f"{tmp_path / 'paused'}.resume").touch()
        assert first.wait() == EXIT_RETRYABLE, first.log  # the exit code contract is unchanged
        expected, preemptions = AttemptOutcome.STALLED, 0
    else:  # the node went away with it: a real preemption, as far as anyone can tell
        first.kill(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        expected, preemptions = AttemptOutcome.LOST_LEASE, 1

    after = {a.attempt_id: a for a in store.list_attempts(job_id)}
    assert after[stalled.attempt_id].outcome is expected, first.log
    assert after[stalled.attempt_id].ended_at == stalled.ended_at  # when it lost the shard
    assert after[done.attempt_id].outcome is AttemptOutcome.SUCCEEDED
    assert store.get_shard(job_id, 0).state is ShardState.SUCCEEDED
    assert {c.attempt_id for c in store.list_commits(job_id) if c.seq > 0} == {done.attempt_id}
    view, progress, history = learned_preemptions(store, job_id, later_id)
    assert view == progress == history == preemptions
    tries = read_job_view(store, job_id, now=dt.datetime.now(dt.timezone.utc)).spot_tries
    assert tries.tries == 2  # the stalled try's Spot time still counts, without a preemption


def test_a_preemption_notice_is_still_learned_as_a_preemption(
    store: ManifestStore, store_url: str, tmp_path: Path, workers: Workers
) -> None:
    job_id, later_id = two_jobs(store, tmp_path)
    first = workers.start(store_url, job_id, "--pool", SPOT.name, "--engine-option", "delay_s_per_record=0.5")
    wait_until(lambda: store.get_shard(job_id, 0).cursor >= 1, "the first commit")
    first.kill(signal.SIGTERM)
    assert first.wait() == EXIT_RETRYABLE, first.log
    second = workers.run(store_url, job_id, "--pool", SPOT.name)
    assert second.popen.returncode == EXIT_DONE, second.log
    outcomes = [a.outcome for a in store.list_attempts(job_id)]
    assert outcomes == [AttemptOutcome.PREEMPTED, AttemptOutcome.SUCCEEDED]
    assert learned_preemptions(store, job_id, later_id) == (1, 1, 1)


# -- the store's side: a stall is reported under the attempt's own identity, on its row only ------


def test_reporting_a_stall_changes_the_ended_attempt_only_and_gives_no_lease_back(
    store: ManifestStore,
) -> None:
    job = new_job(store)
    stalled = claim(store, job, ttl_s=0.2)
    commit(store, stalled, 0)
    wait_until(lambda: store.db_time() > stalled.expires_at, "the lease to expire")
    taker = claim(store, job)  # takes over: the stalled attempt ends lost_lease
    before = store.get_shard(job.job_id, 0)

    def report(lease: Lease) -> ShardState | None:
        return store.fail_attempt(
            lease, FailureClass.PREEMPTED, "lost its lease", outcome=AttemptOutcome.STALLED
        )

    def outcomes() -> dict[str, AttemptOutcome]:
        return {a.attempt_id: a.outcome for a in store.list_attempts(job.job_id)}

    assert report(dataclasses.replace(stalled, epoch=taker.epoch)) is None  # not its identity
    assert outcomes()[stalled.attempt_id] is AttemptOutcome.LOST_LEASE
    assert report(stalled) is None  # it held no lease, and it holds none now
    assert store.get_shard(job.job_id, 0) == before  # shard, epoch, lease and cursor untouched
    assert outcomes() == {
        stalled.attempt_id: AttemptOutcome.STALLED,
        taker.attempt_id: AttemptOutcome.RUNNING,
    }
    [row] = [a for a in store.list_attempts(job.job_id) if a.attempt_id == stalled.attempt_id]
    assert row.error == (
        f"lease expired; taken over at epoch {taker.epoch}; its worker reported back alive: lost its lease"
    )
    commit(store, taker, 1)  # the taker's lease is as live as before
    assert report(stalled) is None and outcomes()[stalled.attempt_id] is AttemptOutcome.STALLED  # once

    store.release(taker, AttemptOutcome.PREEMPTED, "notice")
    assert report(taker) is None
    assert outcomes()[taker.attempt_id] is AttemptOutcome.PREEMPTED  # a preemption is never a stall
    assert store.progress(job.job_id).preemptions == 1


def test_a_stalled_worker_whose_lease_nobody_took_ends_stalled_and_frees_the_shard(
    store: ManifestStore,
) -> None:
    job = new_job(store)
    lease = claim(store, job, ttl_s=0.2)
    wait_until(lambda: store.db_time() > lease.expires_at, "the lease to expire")
    after = store.fail_attempt(
        lease, FailureClass.PREEMPTED, "lost its lease", outcome=AttemptOutcome.STALLED
    )
    assert after is ShardState.RETRYABLE_FAILURE
    shard = store.get_shard(job.job_id, 0)
    assert (shard.state, shard.failures, shard.lease_attempt_id) == (ShardState.RETRYABLE_FAILURE, 0, None)
    assert [a.outcome for a in store.list_attempts(job.job_id)] == [AttemptOutcome.STALLED]
    assert store.progress(job.job_id).preemptions == 0


def test_a_primary_stalled_past_its_lease_beside_its_racer_is_not_a_preemption(store: ManifestStore) -> None:
    """The tail race's case: the primary wakes after its lease lapsed, the racer is promoted and finishes."""
    pools = [PoolSpec(name="spot", kind=PoolKind.SPOT), PoolSpec(name="on-demand", kind=PoolKind.ON_DEMAND)]
    job = new_job(store, microbatches=2, config={"pools": [p.to_dict() for p in pools]})
    primary = claim(store, job, ttl_s=0.3)  # on "spot"
    racer = race(store, job)
    wait_until(lambda: store.db_time() > primary.expires_at, "the primary's lease to lapse")
    woke = store.fail_attempt(
        primary, FailureClass.PREEMPTED, "lost its lease", outcome=AttemptOutcome.STALLED
    )
    assert woke is ShardState.LEASED  # the racer holds the shard now
    assert store.get_shard(job.job_id, 0).lease_attempt_id == racer.attempt_id
    commit(store, racer, 0)
    commit(store, racer, 1)
    store.complete_shard(racer)
    rows = {a.attempt_id: a.outcome for a in store.list_attempts(job.job_id)}
    assert rows == {primary.attempt_id: AttemptOutcome.STALLED, racer.attempt_id: AttemptOutcome.SUCCEEDED}
    view = read_job_view(store, job.job_id, now=dt.datetime.now(dt.timezone.utc))
    assert (view.spot_tries.tries, view.spot_tries.preemptions, store.progress(job.job_id).preemptions) == (
        1,
        0,
        0,
    )
    assert store.pool_history(["spot"])["spot"].preemptions == 0
