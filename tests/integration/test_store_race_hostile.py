"""Both attempts of a race commit the same microbatches at once, round after round (issue 13, hostile).

Two threads, each with its own store connection (its own ``ManifestStore``), one the primary and
one the racer, start together and commit every microbatch from the cursor as fast as they can,
then complete the shard. Whatever the interleaving, on SQLite and PostgreSQL: one commit per
microbatch, the shard succeeded, exactly one attempt succeeded and the other ended ``lost_race``
(no failure class), no attempt running, no budget spent.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.exceptions import LeaseLost, ShardNotClaimable, StoreError
from airflow_deadline_batch.store import JobRow, Lease, ManifestStore
from tests.integration.test_store_race import claim, commit, new_job, race

pytestmark = pytest.mark.integration

ROUNDS = 25
MICROBATCHES = 4


def run_attempt(store: ManifestStore, lease: Lease, go: threading.Event, seed: int, out: list[str]) -> None:
    """Commit from the cursor to the end and complete; record how the attempt stopped."""
    jitter = random.Random(seed)
    go.wait()
    seq = lease.cursor
    try:
        while seq < MICROBATCHES:
            if jitter.random() < 0.3:
                threading.Event().wait(jitter.random() / 1000)  # a sub-millisecond stagger, not a sync
            try:
                lease = commit(store, lease, seq)
                seq += 1
            except LeaseLost:
                raise
            except StoreError as exc:
                ahead = exc.fields.get("expected_seq")
                if not isinstance(ahead, int) or ahead <= seq:
                    raise
                seq = ahead
        store.complete_shard(lease)
        out.append("completed")
    except LeaseLost as exc:
        out.append("lost_race" if exc.fields.get("lost_race") else f"lease_lost: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported by the test's assertion
        out.append(f"error: {type(exc).__name__}: {exc}")


def test_simultaneous_commits_of_both_attempts_keep_one_commit_per_microbatch(store: ManifestStore) -> None:
    twin = ManifestStore.open(store.url)
    try:
        for n in range(ROUNDS):
            job = new_job(store, MICROBATCHES)
            primary = claim(store, job)
            racer = race(twin, job)
            go = threading.Event()
            ends: list[list[str]] = [[], []]
            threads = [
                threading.Thread(target=run_attempt, args=(store, primary, go, 2 * n, ends[0])),
                threading.Thread(target=run_attempt, args=(twin, racer, go, 2 * n + 1, ends[1])),
            ]
            for thread in threads:
                thread.start()
            go.set()
            for thread in threads:
                thread.join(timeout=60)
                assert not thread.is_alive(), f"round {n}: an attempt hung"
            stops = [e[0] for e in ends]
            assert "completed" in stops and not [s for s in stops if s.startswith("error")], (n, stops)

            shard = store.get_shard(job.job_id, 0)
            assert shard.state is ShardState.SUCCEEDED and shard.failures == 0, (n, shard)
            assert shard.race_attempt_id is None
            seqs = Counter(c.seq for c in store.list_commits(job.job_id))
            assert seqs == Counter(range(MICROBATCHES)), (n, seqs)
            tries = {a.attempt_id: a for a in store.list_attempts(job.job_id)}
            outcomes = sorted(t.outcome.value for t in tries.values())
            assert outcomes == sorted([AttemptOutcome.SUCCEEDED.value, AttemptOutcome.LOST_RACE.value]), (
                n,
                outcomes,
            )
            assert all(t.failure_class is None for t in tries.values()), (n, tries)
            winner = next(t for t in tries.values() if t.outcome is AttemptOutcome.SUCCEEDED)
            assert shard.last_pool == winner.pool, (n, shard.last_pool, winner.pool)
    finally:
        twin.close()


def ask(
    twin: ManifestStore, job: JobRow, racer: bool, go: threading.Event, granted: list[str], refused: list[str]
) -> None:
    """One launch: a racing claim or a plain claim, once ``go`` is set."""
    go.wait()
    try:
        (race if racer else claim)(twin, job)
        granted.append("race" if racer else "claim")
    except ShardNotClaimable as exc:
        refused.append(str(exc.fields["reason"]))


def test_racers_and_claims_launched_at_once_grant_one_racing_lease(store: ManifestStore) -> None:
    """Eight processes' worth of connections ask at once: one racer at most; no claim while it lives."""
    stores = [ManifestStore.open(store.url) for _ in range(8)]
    try:
        for n in range(5):
            job = new_job(store, MICROBATCHES)
            claim(store, job, ttl_s=30.0)
            go = threading.Event()
            granted: list[str] = []
            refused: list[str] = []
            threads = [
                threading.Thread(target=ask, args=(twin, job, i % 4 != 3, go, granted, refused))
                for i, twin in enumerate(stores)
            ]
            for thread in threads:
                thread.start()
            go.set()
            for thread in threads:
                thread.join(timeout=60)
            assert granted == ["race"], (n, granted, refused)
            assert sorted(set(refused)) == ["leased", "racing"], (n, refused)
            running = [a for a in store.list_attempts(job.job_id) if a.outcome is AttemptOutcome.RUNNING]
            assert len(running) == 2 and sum(a.speculative for a in running) == 1, (n, running)
    finally:
        for twin in stores:
            twin.close()
