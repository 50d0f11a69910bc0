"""The tail race with real worker processes (issue 13): a racer on another pool beats a stalled try.

The original worker commits a microbatch, writes the next one and stalls before committing it
(the worker's ``ADB_FAULT_PAUSE_AFTER_WRITE`` hook: a Spot node gone slow); a ``--race`` worker
takes the racing lease beside its live lease and runs the shard from the cursor. Once the racer
has won a microbatch the original is let go: its commit is refused (or it finds the shard done)
and it exits on its own, 0, as ``lost_race``, without a failure. The job then publishes and
``deadline-batch verify`` finds one outcome per record.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.local.runner import RunOptions, run_job
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore, Progress
from tests.e2e.conftest import run_cli, wait_for
from tests.helpers.inputs import mixed_input
from tests.helpers.racing import racer_claimed, renew_primary_lease, wait_racer_claimed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WAIT_S = 60.0  # generous: a loaded 2-core CI machine starts Python slowly


def start_worker(
    url: str, job_id: str, log: Path, *args: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "airflow_deadline_batch.worker", "--job", job_id, "--shard", "0", *args],
            env={**os.environ, "ADB_STORE_URL": url, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )


def test_a_racer_beats_a_stalled_try_which_then_exits_on_its_own(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    source = mixed_input(30, seed=13)
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(source.write(tmp_path / "in.jsonl")),
            deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
            output_uri=str(tmp_path / "out"),
            microbatch_size=4,
            max_shards=1,
            max_invalid_fraction=0.5,
            lease_ttl_s=20.0,
        ),
    )
    job_id = plan.job_id
    assert store.get_shard(job_id, 0).num_microbatches >= 4
    stalled = tmp_path / "stalled"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        original = start_worker(
            url,
            job_id,
            tmp_path / "original.log",
            "--pool",
            "local-spot",
            env={"ADB_FAULT_PAUSE_AFTER_WRITE": str(stalled), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1"},
        )
        procs.append(original)
        wait_for(
            stalled.exists, timeout_s=WAIT_S, what="the original to stall before committing microbatch 1"
        )
        racer = start_worker(
            url,
            job_id,
            tmp_path / "racer.log",
            "--pool",
            "local-on-demand",
            "--race",
            env={"ADB_ECHO_DELAY_S": "0.02"},
        )
        procs.append(racer)
        wait_racer_claimed(store, job_id, racer, timeout_s=WAIT_S)
        # the racer resumed at the cursor and won microbatch 1, which the original had written
        wait_for(lambda: store.get_shard(job_id, 0).cursor >= 2, timeout_s=WAIT_S, what="the racer's commit")
        Path(f"{stalled}.resume").touch()  # the original goes on: to a refused commit, or a done shard
        assert racer.wait(timeout=WAIT_S) == 0, (tmp_path / "racer.log").read_text()
        assert original.wait(timeout=WAIT_S) == 0, (tmp_path / "original.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    attempts = {a.worker.split(":")[-1]: a for a in store.list_attempts(job_id)}
    first, second = attempts[str(original.pid)], attempts[str(racer.pid)]
    assert (first.outcome, second.outcome) == (AttemptOutcome.LOST_RACE, AttemptOutcome.SUCCEEDED)
    assert second.speculative and not first.speculative
    assert first.failure_class is None  # the loser's try is no failure
    shard = store.get_shard(job_id, 0)
    assert shard.state is ShardState.SUCCEEDED and shard.failures == 0
    by_seq = {c.seq: c.attempt_id for c in store.list_commits(job_id) if c.shard_index == 0}
    assert sorted(by_seq) == list(range(shard.num_microbatches))  # one commit per microbatch
    assert by_seq[0] == first.attempt_id
    assert {by_seq[seq] for seq in range(1, shard.num_microbatches)} == {second.attempt_id}

    finalize_job(store, job_id)
    verified = run_cli("verify", job_id, "--store", url, "--json", cwd=tmp_path)
    assert verified.code == 0, verified.describe()
    report = verified.json()
    assert report["published"] is True
    store.close()


def test_the_runner_races_its_tail_spot_try_and_the_job_verifies(tmp_path: Path) -> None:
    """``deadline-batch run``'s loop: once the job's clock reaches its tail, the running Spot try races."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    start = dt.datetime.now(dt.timezone.utc)
    clock = ManualClock(start)
    job: dict[str, str] = {}
    stalled = tmp_path / "stalled"
    resume = Path(f"{stalled}.resume")

    def near_the_deadline(progress: Progress) -> None:
        # the first try runs on Spot; then the job's clock jumps to 2 minutes before the deadline
        if progress.shards_by_state.get(ShardState.LEASED.value) and clock.now() == start:
            clock.set(start + dt.timedelta(minutes=58))
        # the Spot tries stall before committing microbatch 1, their leases renewed, until a racer
        # has claimed: unstalled, they finished (~10 s) before a racer starting on a loaded machine
        # could claim, and nothing raced
        if stalled.exists() and not resume.exists():
            shards = [s.shard_index for s in store.list_shards(job["job_id"])]
            if any(racer_claimed(store, job["job_id"], index) for index in shards):
                resume.touch()
            else:
                for index in shards:
                    renew_primary_lease(store, job["job_id"], index)

    summary = run_job(
        store,
        PlanRequest(
            input_uri=str(mixed_input(40, seed=3).write(tmp_path / "in.jsonl")),
            deadline=start + dt.timedelta(hours=1),
            output_uri=str(tmp_path / "out"),
            microbatch_size=4,
            max_shards=2,
            max_invalid_fraction=0.5,
            workers=3,
        ),
        # 0.5 s a record: a Spot try runs ~10 s; the racer, resumed at the cursor, does not stall
        # (its try is let go as soon as it claims)
        RunOptions(
            workers=3,
            worker_env={
                "ADB_ECHO_DELAY_S": "0.5",
                "ADB_FAULT_PAUSE_AFTER_WRITE": str(stalled),
                "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1",
            },
            lease_ttl_s=10.0,
        ),
        clock=clock,
        on_progress=near_the_deadline,
        on_plan=lambda plan: job.update(job_id=plan.job_id),
    )
    assert summary.state == "completed", summary
    # every try before the jump was placed on Spot: an on-demand launch is the racer
    assert summary.placements["on_demand"] >= 1, summary
    attempts = store.list_attempts(job["job_id"])
    # the racer took the racing lease: its attempt row is speculative, on the on-demand pool, and
    # raced a Spot try of the same shard
    racers = [a for a in attempts if a.speculative]
    assert racers and all(a.pool == "local-on-demand" for a in racers), attempts
    raced = {a.shard_index for a in attempts if not a.speculative and a.pool == "local-spot"}
    assert {a.shard_index for a in racers} <= raced
    assert all(a.outcome in (AttemptOutcome.SUCCEEDED, AttemptOutcome.LOST_RACE) for a in attempts)
    assert not [a for a in attempts if a.failure_class is not None]  # no try failed
    verified = run_cli("verify", job["job_id"], "--store", url, "--json", cwd=tmp_path)
    assert verified.code == 0, verified.describe()
    store.close()
