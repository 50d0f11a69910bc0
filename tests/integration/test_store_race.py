"""The tail race in the store (issue 13): one racing lease beside the primary, first commit wins.

On SQLite and PostgreSQL alike: who may race, what two interleaved attempts commit, how the
loser ends (``lost_race``, no failure counted), completion by either, and no third attempt
taking over from a live racer; then random interleavings of the two attempts' operations
checked against the invariants (one commit per seq, a monotone cursor, one terminal outcome).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.exceptions import LeaseLost, ShardNotClaimable, StoreError
from airflow_deadline_batch.store import JobRow, Lease, ManifestStore, NewJob, NewShard
from tests.helpers.commits import commit

pytestmark = pytest.mark.integration

MICROBATCHES = 3


def new_job(
    store: ManifestStore, microbatches: int = MICROBATCHES, config: dict[str, Any] | None = None
) -> JobRow:
    job, _ = store.create_job(
        NewJob(
            deadline=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc),
            input_uri="file:///in.jsonl",
            input_sha256="e" * 64,
            input_lines=1,
            input_total_lines=1,
            output_uri="file:///out",
            config={"max_attempts": 3, **(config or {})},
        ),
        [
            NewShard(
                shard_index=0,
                byte_start=0,
                byte_end=1,
                first_line=1,
                line_count=1,
                records=1,
                num_microbatches=microbatches,
                input_sha256="0" * 64,
            )
        ],
    )
    return job


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)  # polling interval


def claim(store: ManifestStore, job: JobRow, ttl_s: float = 30.0) -> Lease:
    return store.claim_shard(job.job_id, 0, ttl_s=ttl_s, worker="primary", pool="spot")


def race(store: ManifestStore, job: JobRow, ttl_s: float = 30.0) -> Lease:
    return store.claim_race(job.job_id, 0, ttl_s=ttl_s, worker="racer", pool="on-demand")


def outcomes(store: ManifestStore, job: JobRow) -> dict[str, AttemptOutcome]:
    return {a.attempt_id: a.outcome for a in store.list_attempts(job.job_id)}


def refusal(call: Callable[[], object]) -> str:
    with pytest.raises(ShardNotClaimable) as info:
        call()
    return str(info.value.fields["reason"])


# -- who may race -----------------------------------------------------------------------------------


def test_a_racer_needs_a_live_primary_lease(store: ManifestStore) -> None:
    job = new_job(store)
    assert refusal(lambda: race(store, job)) == "not_running"  # pending: claim it instead
    primary = claim(store, job, ttl_s=0.2)
    wait_for(lambda: store.db_time() > primary.expires_at, what="the primary lease to expire")
    assert refusal(lambda: race(store, job)) == "not_running"


def test_one_racer_at_most_and_it_is_recorded_as_speculative(store: ManifestStore) -> None:
    job = new_job(store)
    primary = claim(store, job)
    racer = race(store, job)
    assert (racer.epoch, racer.cursor) == (primary.epoch, 0)  # the epoch is not bumped
    assert refusal(lambda: race(store, job)) == "racing"
    attempts = {a.attempt_id: a for a in store.list_attempts(job.job_id)}
    assert attempts[racer.attempt_id].speculative and not attempts[primary.attempt_id].speculative
    assert attempts[racer.attempt_id].outcome is AttemptOutcome.RUNNING
    assert store.get_shard(job.job_id, 0).attempts == 2


def test_a_dead_racer_may_be_replaced(store: ManifestStore) -> None:
    job = new_job(store)
    claim(store, job)
    dead = race(store, job, ttl_s=0.2)
    wait_for(lambda: store.db_time() > dead.expires_at, what="the racing lease to expire")
    fresh = race(store, job)
    assert outcomes(store, job)[dead.attempt_id] is AttemptOutcome.LOST_LEASE
    with pytest.raises(LeaseLost):
        store.heartbeat(dead, 30.0)
    store.heartbeat(fresh, 30.0)


def test_no_racer_for_a_succeeded_shard_or_an_inactive_job(store: ManifestStore) -> None:
    job = new_job(store, microbatches=1)
    primary = claim(store, job)
    commit(store, primary, 0)
    assert refusal(lambda: race(store, job)) == "committed"  # only completing is left
    store.complete_shard(primary)
    assert refusal(lambda: race(store, job)) == "succeeded"
    other = new_job(store)
    claim(store, other)
    store.cancel_job(other.job_id)
    assert refusal(lambda: race(store, other)) == "job_inactive"


# -- two attempts, one shard ------------------------------------------------------------------------


def test_interleaved_commits_give_one_commit_per_seq_and_the_loser_ends_without_a_failure(
    store: ManifestStore,
) -> None:
    job = new_job(store)
    primary = claim(store, job)
    commit(store, primary, 0)
    racer = race(store, job)
    assert racer.cursor == 1  # the racer resumes at the cursor
    commit(store, racer, 1)  # the racer is first on seq 1: it wins it
    with pytest.raises(LeaseLost) as lost:
        commit(store, primary, 1)
    assert lost.value.fields["lost_race"] is True
    assert outcomes(store, job)[primary.attempt_id] is AttemptOutcome.LOST_RACE
    shard = store.get_shard(job.job_id, 0)
    # the winner holds the shard alone, as its primary lease; nothing spent the budget
    assert (shard.state, shard.lease_attempt_id, shard.race_attempt_id) == (
        ShardState.LEASED,
        racer.attempt_id,
        None,
    )
    assert shard.failures == 0 and shard.cursor == 2
    assert all(a.failure_class is None for a in store.list_attempts(job.job_id))
    with pytest.raises(LeaseLost):  # the loser can do nothing more
        store.heartbeat(primary, 30.0)
    commit(store, racer, 2)
    store.complete_shard(racer)
    commits = store.list_commits(job.job_id)
    assert [(c.seq, c.attempt_id) for c in commits] == [
        (0, primary.attempt_id),
        (1, racer.attempt_id),
        (2, racer.attempt_id),
    ]


@pytest.mark.parametrize("winner", ["primary", "racer"])
def test_either_attempt_completes_and_the_other_is_ended(store: ManifestStore, winner: str) -> None:
    job = new_job(store, microbatches=2)
    primary = claim(store, job)
    racer = race(store, job)
    first, second = (primary, racer) if winner == "primary" else (racer, primary)
    commit(store, first, 0)
    commit(store, first, 1)
    store.complete_shard(first)
    shard = store.get_shard(job.job_id, 0)
    assert shard.state is ShardState.SUCCEEDED and shard.race_attempt_id is None
    ended = outcomes(store, job)
    assert (ended[first.attempt_id], ended[second.attempt_id]) == (
        AttemptOutcome.SUCCEEDED,
        AttemptOutcome.LOST_RACE,
    )
    with pytest.raises(LeaseLost):
        commit(store, second, 0)
    assert store.release(second, AttemptOutcome.PREEMPTED) is False  # the loser's exit changes nothing
    assert store.get_shard(job.job_id, 0).state is ShardState.SUCCEEDED


def test_no_third_attempt_takes_over_while_the_racer_lives(store: ManifestStore) -> None:
    job = new_job(store, microbatches=1)
    primary = claim(store, job, ttl_s=0.2)
    racer = race(store, job)
    wait_for(lambda: store.db_time() > primary.expires_at, what="the primary lease to expire")
    assert refusal(lambda: claim(store, job)) == "leased"
    store.heartbeat(racer, 30.0)  # the racer keeps racing on its own lease
    commit(store, racer, 0)
    store.complete_shard(racer)
    assert outcomes(store, job)[primary.attempt_id] is AttemptOutcome.LOST_RACE
    assert store.get_shard(job.job_id, 0).state is ShardState.SUCCEEDED


def test_a_preempted_primary_hands_the_shard_to_its_racer(store: ManifestStore) -> None:
    job = new_job(store, microbatches=1)
    primary = claim(store, job)
    racer = race(store, job)
    assert store.fail_attempt(primary, "preempted", "spot reclaimed") is ShardState.LEASED
    shard = store.get_shard(job.job_id, 0)
    assert (shard.lease_attempt_id, shard.race_attempt_id, shard.epoch) == (
        racer.attempt_id,
        None,
        racer.epoch,
    )
    assert refusal(lambda: claim(store, job)) == "leased"
    commit(store, racer, 0)
    store.complete_shard(racer)


def test_a_primary_whose_racer_died_frees_the_shard_as_before(store: ManifestStore) -> None:
    job = new_job(store)
    primary = claim(store, job)
    dead = race(store, job, ttl_s=0.2)
    wait_for(lambda: store.db_time() > dead.expires_at, what="the racing lease to expire")
    assert store.fail_attempt(primary, "preempted", "spot reclaimed") is ShardState.RETRYABLE_FAILURE
    shard = store.get_shard(job.job_id, 0)
    assert shard.race_attempt_id is None and shard.lease_attempt_id is None
    assert outcomes(store, job)[dead.attempt_id] is AttemptOutcome.LOST_LEASE
    claim(store, job)


def test_cancelling_the_job_fences_both_attempts(store: ManifestStore) -> None:
    job = new_job(store)
    primary = claim(store, job)
    racer = race(store, job)
    store.cancel_job(job.job_id)
    for lease in (primary, racer):
        with pytest.raises(LeaseLost):
            commit(store, lease, 0)
    assert set(outcomes(store, job).values()) == {AttemptOutcome.LOST_LEASE}
    assert store.get_shard(job.job_id, 0).race_attempt_id is None


# -- random interleavings ---------------------------------------------------------------------------


@dataclass
class Actor:
    """One of the two attempts, as its worker sees it."""

    lease: Lease
    next_seq: int
    alive: bool = True
    committed: list[int] = field(default_factory=list)


OPS = st.lists(
    st.tuples(st.sampled_from(["commit", "heartbeat", "complete", "race"]), st.sampled_from([0, 1])),
    min_size=1,
    max_size=14,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_interleavings_keep_the_invariants(store: ManifestStore, ops: list[tuple[str, int]]) -> None:
    job = new_job(store)
    first = claim(store, job)
    actors: list[Actor] = [Actor(first, first.cursor)]
    cursor = 0
    for op, who in ops:
        if op == "race":
            try:
                lease = race(store, job)
            except ShardNotClaimable as exc:
                assert exc.fields["reason"] in {"racing", "committed", "succeeded", "not_running"}
            else:
                actors.append(Actor(lease, lease.cursor))
            continue
        recent = actors[-2:]  # the primary of the moment and the latest racer
        actor = recent[min(who, len(recent) - 1)]
        if not actor.alive:
            continue
        try:
            if op == "commit" and actor.next_seq < MICROBATCHES:
                commit(store, actor.lease, actor.next_seq)
                actor.committed.append(actor.next_seq)
                actor.next_seq += 1
            elif op == "heartbeat":
                store.heartbeat(actor.lease, 30.0)
            elif op == "complete" and actor.next_seq == MICROBATCHES:
                store.complete_shard(actor.lease)
                actor.alive = False
        except LeaseLost:
            actor.alive = False
        except StoreError as exc:  # the rival committed ahead and then left: resume at the cursor
            assert exc.fields.get("expected_seq", -1) > actor.next_seq, exc
            actor.next_seq = exc.fields["expected_seq"]
        shard = store.get_shard(job.job_id, 0)
        assert shard.cursor >= cursor  # monotone
        cursor = shard.cursor
        holders = {shard.lease_attempt_id, shard.race_attempt_id} - {None}
        assert (
            len(holders) <= 2
            and all(a.lease.attempt_id in holders for a in actors if a.alive)
            or (shard.state is ShardState.SUCCEEDED)
        )
    commits = [c for c in store.list_commits(job.job_id) if c.shard_index == 0]
    shard = store.get_shard(job.job_id, 0)
    assert [c.seq for c in commits] == list(range(shard.cursor))  # exactly one commit per seq
    by_seq = {c.seq: c.attempt_id for c in commits}
    for actor in actors:  # every commit an attempt was told succeeded is the one recorded
        assert all(by_seq[seq] == actor.lease.attempt_id for seq in actor.committed)
    ended = store.list_attempts(job.job_id)
    assert sum(a.outcome is AttemptOutcome.SUCCEEDED for a in ended) == (shard.state is ShardState.SUCCEEDED)
    if shard.state is ShardState.SUCCEEDED:
        assert all(a.outcome is not AttemptOutcome.RUNNING for a in ended)
    assert shard.failures == 0 and all(a.failure_class is None for a in ended)
    for actor in actors:  # an attempt that lost the race can do nothing more
        if (
            next(a for a in ended if a.attempt_id == actor.lease.attempt_id).outcome
            is AttemptOutcome.LOST_RACE
        ):
            with pytest.raises(LeaseLost):
                store.heartbeat(actor.lease, 30.0)


# -- whose pool the shard names ---------------------------------------------------------------------


def test_a_racer_that_completes_the_shard_is_its_last_pool(store: ManifestStore) -> None:
    job = new_job(store, microbatches=1)
    claim(store, job)
    racer = race(store, job)
    assert store.get_shard(job.job_id, 0).last_pool == "spot"  # the racer has won nothing yet
    commit(store, racer, 0)
    store.complete_shard(racer)
    assert store.get_shard(job.job_id, 0).last_pool == "on-demand"


def test_a_primary_that_completes_a_raced_shard_keeps_its_pool(store: ManifestStore) -> None:
    job = new_job(store, microbatches=1)
    primary = claim(store, job)
    race(store, job)
    commit(store, primary, 0)
    store.complete_shard(primary)
    assert store.get_shard(job.job_id, 0).last_pool == "spot"


@pytest.mark.parametrize("how", ["preempted", "lost_race"])
def test_a_promoted_racer_is_the_shards_last_pool(store: ManifestStore, how: str) -> None:
    job = new_job(store)
    primary = claim(store, job)
    racer = race(store, job)
    if how == "preempted":
        store.fail_attempt(primary, "preempted", "spot reclaimed")
    else:
        commit(store, racer, 0)
        with pytest.raises(LeaseLost):
            commit(store, primary, 0)
    shard = store.get_shard(job.job_id, 0)
    assert (shard.lease_attempt_id, shard.last_pool) == (racer.attempt_id, "on-demand")


def test_a_live_racer_holds_a_gpu_of_its_own_pool(store: ManifestStore) -> None:
    pools = [{"name": "spot", "kind": "spot"}, {"name": "on-demand", "kind": "on_demand"}]
    job = new_job(store, config={"pools": pools})
    primary = claim(store, job)
    assert store.tenant_gpus_in_use(job.tenant) == {"spot": 1}
    racer = race(store, job, ttl_s=0.2)
    assert store.tenant_gpus_in_use(job.tenant) == {"spot": 1, "on_demand": 1}
    wait_for(lambda: store.db_time() > racer.expires_at, what="the racing lease to expire")
    assert store.tenant_gpus_in_use(job.tenant) == {"spot": 1}
    store.heartbeat(race(store, job), 30.0)
    store.fail_attempt(primary, "preempted", "spot reclaimed")  # the racer is promoted
    assert store.tenant_gpus_in_use(job.tenant) == {"on_demand": 1}
    assert store.tenant_gpus_in_use(job.tenant, exclude_job=job.job_id) == {}
