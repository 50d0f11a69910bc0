"""When the local runner races a running Spot try (``local.runner.race_pool``, issue 13).

A real store and a real plan; the job view is read at chosen instants (``now``), so the slack,
not the wall clock, decides whether the safety rule escalates the running try, and
``core.placement.should_speculate`` whether racing beats escalating.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec, default_local_pools
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.local.launcher import start_worker
from airflow_deadline_batch.local.runner import LocalRun, RunOptions, _Running, race_pool
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import wait_for
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


def test_the_run_races_only_once_no_shard_waits_for_a_worker(store: ManifestStore, tmp_path: Path) -> None:
    """``LocalRun.race_tail`` with a real Spot worker holding shard 0 and the job's clock at its tail."""
    job_id = planned(store, tmp_path)
    stalled = tmp_path / "stalled"
    run = LocalRun(store, job_id, RunOptions(workers=3, lease_ttl_s=30.0), ManualClock(TAIL))
    proc = start_worker(
        store.url,
        job_id,
        0,
        pool="local-spot",
        lease_ttl_s=30.0,
        env={"ADB_FAULT_PAUSE_AFTER_WRITE": str(stalled)},  # holds its live lease, committing nothing
    )
    try:
        run.pending.remove(0)
        run.running[0] = _Running(proc, PoolKind.SPOT, math.inf)
        wait_for(stalled.exists, timeout_s=60, what="the Spot worker to hold shard 0")
        with open(os.devnull, "ab") as devnull:
            run.race_tail(time.monotonic(), devnull)
            assert run.racing == {}  # shard 1 still waits for a worker: no duplicate takes one
            run.pending.clear()
            run.next_race_check = 0.0
            run.race_tail(time.monotonic(), devnull)
        assert list(run.racing) == [0] and run.racing[0].proc.pool == "local-on-demand"
        racer = run.racing[0].proc.popen
        wait_for(lambda: racer.poll() is not None, timeout_s=60, what="the racer to finish the shard")
        assert racer.returncode == 0
        assert store.get_shard(job_id, 0).state is ShardState.SUCCEEDED
    finally:
        for item in [*run.running.values(), *run.racing.values()]:
            if item.proc.popen.poll() is None:
                item.proc.popen.kill()
                item.proc.popen.wait()
        shutil.rmtree(run.messages_dir, ignore_errors=True)


def test_a_try_that_exits_0_without_finishing_its_shard_is_placed_again(
    store: ManifestStore, tmp_path: Path
) -> None:
    """Bug: a Spot try preempted while its racer was starting made the racer the shard's running
    try; the racer, finding nothing to race (no live lease), exits 0 without claiming, and the
    runner took a try that exited 0 for a finished shard: it was never placed again and the run
    ended with the job unfinished. Now the shard goes back to the queue unless the store has it
    done."""
    job_id = planned(store, tmp_path)
    run = LocalRun(store, job_id, RunOptions(workers=2, lease_ttl_s=30.0), ManualClock(TAIL))
    racer = start_worker(store.url, job_id, 0, pool="local-on-demand", lease_ttl_s=30.0, race=True)
    try:
        run.pending.remove(0)
        run.running[0] = _Running(racer, PoolKind.ON_DEMAND, math.inf)
        wait_for(lambda: racer.popen.poll() is not None, timeout_s=60, what="the racer to exit")
        assert racer.popen.returncode == 0  # nothing to race: the shard is nobody's
        run.reap_exited(time.monotonic())
        assert run.running == {} and 0 in run.pending
        assert store.get_shard(job_id, 0).state is ShardState.PENDING
    finally:
        if racer.popen.poll() is None:
            racer.popen.kill()
            racer.popen.wait()
        shutil.rmtree(run.messages_dir, ignore_errors=True)


def test_a_run_built_and_never_run_leaves_no_folder_and_a_run_removes_its_own(
    store: ManifestStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers' termination messages' folder is made at the first launch: a run driven step by
    step (as above) or failing before its loop left an empty ``adb-tries-*`` folder in ``TMPDIR``."""
    job_id = planned(store, tmp_path)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    LocalRun(store, job_id, RunOptions(workers=1), ManualClock(TAIL))
    assert list(scratch.iterdir()) == []
    run = LocalRun(
        store, job_id, RunOptions(workers=1, worker_env={"ADB_ECHO_DELAY_S": "0"}), ManualClock(TAIL)
    )
    run.work_until_done(None)
    assert run.launches >= 1 and all(s.state is ShardState.SUCCEEDED for s in store.list_shards(job_id))
    assert list(scratch.iterdir()) == []  # made by the launches, removed when the run ended
