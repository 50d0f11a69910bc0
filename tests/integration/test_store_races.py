"""Races between real processes on the manifest store (SQLite and PostgreSQL).

Two forked processes meet at a barrier and then hit the store at the same instant, round after
round; each round must have exactly one winner.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

import pytest

from airflow_deadline_batch.exceptions import LeaseLost, ShardNotClaimable, StoreError
from airflow_deadline_batch.store import Lease, ManifestStore, NewJob, NewShard
from tests.helpers.commits import commit
from tests.helpers.schema import head_revision

pytestmark = pytest.mark.integration

ROUNDS = 20
RACERS = 2
JOIN_TIMEOUT_S = 120
CTX = mp.get_context("fork")  # fork is fast, and each child opens its own store (no shared connections)


def plan(shards: int, microbatches: int, key: str | None = None) -> tuple[NewJob, list[NewShard]]:
    job = NewJob(
        deadline=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc),
        input_uri="file:///in.jsonl",
        input_sha256="e" * 64,
        input_lines=shards,
        input_total_lines=shards,
        output_uri="file:///out",
        config={"max_attempts": 3},
        idempotency_key=key,
    )
    return job, [
        NewShard(
            shard_index=i,
            byte_start=i,
            byte_end=i + 1,
            first_line=i + 1,
            line_count=1,
            records=1,
            num_microbatches=microbatches,
            input_sha256="0" * 64,
        )
        for i in range(shards)
    ]


Race = Callable[[ManifestStore, int], str]


def _racer(url: str, race: Race, barrier: Any, results: Any, racer: int) -> None:
    store = ManifestStore(url)
    try:
        for round_ in range(ROUNDS):
            barrier.wait(timeout=60)
            try:
                outcome = race(store, round_)
            except Exception as exc:  # reported to the parent, which asserts on it
                outcome = f"{type(exc).__name__}: {exc}"
            results.put((round_, racer, outcome))
    finally:
        store.close()


def run_race(url: str, race: Race) -> dict[int, list[str]]:
    """Run ``race`` in two processes for ROUNDS rounds; outcomes per round."""
    return run_roles(url, [race] * RACERS)


def run_roles(url: str, roles: list[Race]) -> dict[int, list[str]]:
    """Run ``roles[i]`` in process ``i``, all meeting at a barrier each round; outcomes per round, by role."""
    barrier = CTX.Barrier(len(roles))
    results = CTX.Queue()
    procs = [
        CTX.Process(target=_racer, args=(url, race, barrier, results, i)) for i, race in enumerate(roles)
    ]
    for proc in procs:
        proc.start()
    rounds: dict[int, list[str]] = {}
    try:
        for _ in range(ROUNDS * len(roles)):
            round_, racer_id, outcome = results.get(timeout=JOIN_TIMEOUT_S)
            rounds.setdefault(round_, [""] * len(roles))[racer_id] = outcome
    except queue.Empty:
        pytest.fail(f"racers stopped reporting; results so far: {rounds}")
    finally:
        for proc in procs:
            proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    assert [p.exitcode for p in procs] == [0] * len(roles)
    return rounds


def test_exactly_one_commit_per_seq_when_two_processes_race(store: ManifestStore, store_url: str) -> None:
    job, shards = plan(shards=1, microbatches=ROUNDS)
    row, _ = store.create_job(job, shards)
    lease = store.claim_shard(row.job_id, 0, ttl_s=600, worker="parent")

    def race(racer_store: ManifestStore, seq: int) -> str:
        try:
            commit(racer_store, lease, seq)
        except StoreError as exc:
            return "refused" if "duplicate or out-of-order" in str(exc) else f"error: {exc}"
        return "committed"

    rounds = run_race(store_url, race)
    for seq, outcomes in sorted(rounds.items()):
        assert sorted(outcomes) == ["committed", "refused"], f"seq {seq}: {outcomes}"
    commits = store.list_commits(row.job_id)
    assert [c.seq for c in commits] == list(range(ROUNDS))
    assert store.get_shard(row.job_id, 0).cursor == ROUNDS


def test_exactly_one_claim_wins_when_two_processes_race(store: ManifestStore, store_url: str) -> None:
    job, shards = plan(shards=ROUNDS, microbatches=1)
    row, _ = store.create_job(job, shards)

    def race(racer_store: ManifestStore, index: int) -> str:
        try:
            lease: Lease = racer_store.claim_shard(row.job_id, index, ttl_s=600, worker="racer")
        except ShardNotClaimable as exc:
            return f"refused:{exc.reason}"
        return f"leased:{lease.epoch}"

    rounds = run_race(store_url, race)
    for index, outcomes in sorted(rounds.items()):
        assert sorted(outcomes) == ["leased:1", "refused:leased"], f"shard {index}: {outcomes}"
    assert len(store.list_attempts(row.job_id)) == ROUNDS


def test_same_idempotency_key_from_two_processes_creates_one_job(
    store: ManifestStore, store_url: str
) -> None:
    def race(racer_store: ManifestStore, round_: int) -> str:
        job, shards = plan(shards=2, microbatches=1, key=f"race-{round_}")
        row, created = racer_store.create_job(job, shards)
        return f"{row.job_id}:{'created' if created else 'existing'}"

    rounds = run_race(store_url, race)
    for round_, outcomes in sorted(rounds.items()):
        ids = {o.split(":")[0] for o in outcomes}
        assert len(ids) == 1 and sorted(o.split(":")[1] for o in outcomes) == ["created", "existing"], (
            f"round {round_}: {outcomes}"
        )
    jobs = store.list_jobs(limit=1000)
    assert len(jobs) == ROUNDS
    assert all(len(store.list_shards(j.job_id)) == 2 for j in jobs)


def test_no_commit_lands_after_a_concurrent_cancel_returns(store: ManifestStore, store_url: str) -> None:
    """A worker commits as fast as it can while another process cancels the job: once cancel_job
    has returned, the commits it left are all there ever are (the in-flight one is fenced)."""
    microbatches = 10_000
    leases = []
    for _ in range(ROUNDS):
        job, shards = plan(shards=1, microbatches=microbatches)
        row, _ = store.create_job(job, shards)
        leases.append(store.claim_shard(row.job_id, 0, ttl_s=600, worker="parent"))

    def committer(racer_store: ManifestStore, round_: int) -> str:
        lease = leases[round_]
        for seq in range(microbatches):
            try:
                lease = commit(racer_store, lease, seq)
            except LeaseLost as exc:
                return f"{seq} ({'job is cancelled' in str(exc)})"
        return "never fenced"

    def canceller(racer_store: ManifestStore, round_: int) -> str:
        job_id = leases[round_].job_id
        deadline = time.monotonic() + 60
        while racer_store.get_shard(job_id, 0).cursor < 1 and time.monotonic() < deadline:
            pass  # cancel mid-stream, once the committer is under way
        racer_store.cancel_job(job_id)
        return f"{len(racer_store.list_commits(job_id))} (True)"

    rounds = run_roles(store_url, [committer, canceller])
    for round_, (committed, seen_after_cancel) in sorted(rounds.items()):
        assert committed == seen_after_cancel, f"round {round_}: {rounds[round_]}"
        assert len(store.list_commits(leases[round_].job_id)) == int(committed.split()[0])


def _migrate(url: str, barrier: Any) -> None:
    store = ManifestStore(url)
    barrier.wait(timeout=60)
    store.migrate()
    store.close()


def test_two_processes_can_migrate_at_once(store_url: str) -> None:
    barrier = CTX.Barrier(RACERS)
    procs = [CTX.Process(target=_migrate, args=(store_url, barrier)) for _ in range(RACERS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=JOIN_TIMEOUT_S)
    assert [p.exitcode for p in procs] == [0] * RACERS
    store = ManifestStore(store_url)
    try:
        assert store.schema_revision() == head_revision()
    finally:
        store.close()
