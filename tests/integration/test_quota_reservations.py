"""A tenant's GPU quota holds under concurrent launches: launch reservations (docs/tenants.md).

Runners checking the quota at the same moment, two runs of one job, a worker between its start
and its claim, and a runner SIGKILLed after it reserved: on SQLite and on PostgreSQL, with real
threads, real worker processes and a real SIGKILL.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.clock import SystemClock
from airflow_deadline_batch.core.pools import PoolKind, default_local_pools
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.local.runner import LocalRun, RunOptions, _stop_all
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import JobRow, ManifestStore, NewJob, NewShard, TenantQuotaRow, tenancy
from airflow_deadline_batch.store.schema import db_epoch
from tests.helpers.inputs import mixed_input
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
TENANT = "ads"
POOLS = [{"name": "spot", "kind": "spot"}, {"name": "on-demand", "kind": "on_demand"}]
REPO = Path(__file__).resolve().parents[2]


def _job(store: ManifestStore, shards: int = 2) -> JobRow:
    job, _ = store.create_job(
        NewJob(
            deadline=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc),
            input_uri="file:///in.jsonl",
            input_sha256="e" * 64,
            input_lines=shards,
            input_total_lines=shards,
            output_uri="file:///out",
            config={"max_attempts": 3, "pools": POOLS},
            tenant=TENANT,
        ),
        [
            NewShard(
                shard_index=i,
                byte_start=i,
                byte_end=i + 1,
                first_line=i + 1,
                line_count=1,
                records=1,
                num_microbatches=1,
                input_sha256="0" * 64,
            )
            for i in range(shards)
        ],
    )
    return job


def _reserve(store: ManifestStore, job: JobRow, index: int, runner: str, ttl_s: float = 30.0) -> str | None:
    return store.reserve_launch(
        job.job_id, index, tenant=TENANT, kind=PoolKind.SPOT, pool="spot", runner=runner, ttl_s=ttl_s
    )


# -- the store: one serialized check-and-reserve -----------------------------------------------------


def test_runners_racing_for_the_last_gpu_get_it_once(store: ManifestStore, store_url: str) -> None:
    """Eight runners (threads, each with its own store connections) reserve at once: one wins."""
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=2))
    job = _job(store, shards=9)
    store.claim_shard(job.job_id, 0, ttl_s=30, worker="running", pool="spot")  # one GPU is held
    runners = [ManifestStore.open(store_url, migrate=False) for _ in range(8)]
    barrier = threading.Barrier(len(runners))
    won: list[str] = []

    def launch(i: int) -> None:
        barrier.wait(timeout=30)
        if _reserve(runners[i], job, i + 1, runner=f"run-{i}") is not None:
            won.append(f"run-{i}")

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(len(runners))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    finally:
        for runner in runners:
            runner.close()
    assert len(won) == 1, won
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 2}


def test_a_worker_counts_once_as_reservation_then_as_lease(store: ManifestStore) -> None:
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=2))
    job = _job(store)
    first = _reserve(store, job, 0, runner="run-a")
    assert first is not None
    store.launch_started(first, "host:101")
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 1}
    store.claim_shard(job.job_id, 0, ttl_s=30, worker="host:101", pool="spot")
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 1}  # the lease, not the lease and the reservation
    # a worker of the same shard that another worker holds (its claim will be refused) still counts
    other = _reserve(store, job, 0, runner="run-b")
    assert other is not None
    store.launch_started(other, "host:202")
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 2}
    assert _reserve(store, job, 1, runner="run-b") is None
    store.release_launches("run-b", other)  # its worker exited
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 1}
    assert _reserve(store, job, 1, runner="run-b") is not None
    store.release_launches("run-b")  # the run ends: all of its reservations go back
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 1}


def test_two_runs_of_one_job_share_the_quota(store: ManifestStore) -> None:
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=1))
    job = _job(store)
    assert _reserve(store, job, 0, runner="run-a") is not None
    assert _reserve(store, job, 1, runner="run-b") is None
    assert _reserve(store, job, 1, runner="run-a") is None


def test_a_reservation_not_renewed_expires_and_renewal_keeps_it(store: ManifestStore) -> None:
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=1))
    job = _job(store)
    assert _reserve(store, job, 0, runner="kept", ttl_s=0.5) is not None
    started = store.db_time()
    store.renew_launches("kept", 30.0)
    wait_for(lambda: store.db_time() > started + 1.0, timeout_s=10, what="the DB clock to pass the TTL")
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 1}
    store.release_launches("kept")
    assert _reserve(store, job, 0, runner="dead", ttl_s=0.5) is not None
    expires = store.db_time() + 0.5
    assert _reserve(store, job, 1, runner="next") is None
    wait_for(lambda: store.db_time() > expires, timeout_s=10, what="the reservation to expire")
    assert store.tenant_gpus_in_use(TENANT) == {}
    assert _reserve(store, job, 1, runner="next") is not None


def test_a_reservation_retried_after_an_unacknowledged_commit_counts_once(store: ManifestStore) -> None:
    """The store retries a transaction whose commit it did not see: the same reservation again."""
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=1))
    job = _job(store)

    def reserve(conn: Connection) -> bool:
        now = float(conn.execute(sa.select(db_epoch())).scalar_one())
        return tenancy.reserve_launch(
            conn,
            reservation_id="r-retried",
            tenant=TENANT,
            kind="spot",
            job_id=job.job_id,
            shard_index=0,
            pool="spot",
            runner="run",
            now=now,
            ttl_s=30.0,
        )

    assert store._tx(reserve)  # test-only: one transaction of the store's, as its retry runs it
    assert store._tx(reserve)
    assert store.tenant_gpus_in_use(TENANT) == {"spot": 1}


@pytest.mark.parametrize("ttl_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_reservation_ttl_that_is_no_duration_gets_a_one_line_error_and_writes_nothing(
    store: ManifestStore, ttl_s: float
) -> None:
    job = _job(store)
    with pytest.raises(ValueError, match="ttl_s must be a finite number > 0") as info:
        _reserve(store, job, 0, runner="run", ttl_s=ttl_s)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="ttl_s must be a finite number > 0"):
        store.renew_launches("run", ttl_s)
    assert store.tenant_gpus_in_use(TENANT) == {}


# -- the local runner: real worker processes -------------------------------------------------------


def _plan(store: ManifestStore, tmp_path: Path, name: str) -> str:
    request = PlanRequest(
        input_uri=str(mixed_input(8, seed=1).write(tmp_path / f"{name}.jsonl")),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
        output_uri=str(tmp_path / f"out-{name}"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=2,
        microbatch_size=2,
        max_invalid_fraction=0.5,
        tenant=TENANT,
        idempotency_key=f"quota-{name}",
    )
    return plan_job(store, request).job_id


#: workers stay busy (a second per record) while the test looks at them
BUSY = RunOptions(workers=2, lease_ttl_s=30.0, worker_env={"ADB_ECHO_DELAY_S": "1"})


@pytest.fixture
def worker_log(tmp_path: Path) -> Iterator[IO[bytes]]:
    with open(tmp_path / "workers.log", "ab") as log:
        yield log


def _kinds(*runs: LocalRun) -> Counter[str]:
    return Counter(item.pool.value for run in runs for item in [*run.running.values(), *run.racing.values()])


@pytest.mark.parametrize("same_job", [False, True], ids=["two-jobs", "one-job-twice"])
def test_two_runners_checking_at_once_never_exceed_the_tenants_quota(
    store: ManifestStore, tmp_path: Path, worker_log: IO[bytes], same_job: bool
) -> None:
    """Two runs (of two jobs of one tenant, or two runs of one job) launch at the same moment,
    before either worker has claimed: one GPU of each kind is all the tenant gets; each worker
    counts once, by its reservation and then by its lease, and the second run stays held back."""
    first_job = _plan(store, tmp_path, "first")
    second_job = first_job if same_job else _plan(store, tmp_path, "second")
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=1, on_demand_gpus=1))
    first = LocalRun(store, first_job, BUSY, SystemClock())
    second = LocalRun(store, second_job, BUSY, SystemClock())
    try:
        first.launch_ready(time.monotonic(), worker_log)
        second.launch_ready(time.monotonic(), worker_log)
        launched = _kinds(first, second)
        assert launched and max(launched.values()) == 1, launched
        wait_for(
            lambda: all(
                store.get_shard(w.proc.job_id, w.proc.shard_index).state is ShardState.LEASED
                for run in (first, second)
                for w in run.running.values()
            ),
            timeout_s=30,
            what="the workers' claims",
        )
        assert store.tenant_gpus_in_use(TENANT) == dict(launched)  # counted once, by the lease
        second.launch_ready(time.monotonic(), worker_log)
        first.launch_ready(time.monotonic(), worker_log)
        assert _kinds(first, second) == launched
    finally:
        for run in (first, second):
            _stop_all(store, run.running, 1.0)
            run.withdraw_launches()
    assert store.tenant_gpus_in_use(TENANT) == {}


#: a runner in its own process: reserves and starts one worker, says so, then waits to be killed
RUNNER = """
import sys, time
from airflow_deadline_batch.core.clock import SystemClock
from airflow_deadline_batch.local.runner import LocalRun, RunOptions
from airflow_deadline_batch.store import ManifestStore
store = ManifestStore.open(sys.argv[1], migrate=False)
options = RunOptions(workers=1, lease_ttl_s=float(sys.argv[3]), worker_env={"ADB_ECHO_DELAY_S": "5"})
run = LocalRun(store, sys.argv[2], options, SystemClock())
run.launch_ready(time.monotonic(), open(sys.argv[4], "ab"))
print(",".join(item.pool.value for item in run.running.values()), flush=True)
sys.stdin.read()
"""


def test_a_runner_killed_after_reserving_gives_the_gpu_back_after_the_ttl(
    store: ManifestStore, store_url: str, tmp_path: Path
) -> None:
    ttl_s = 5.0
    job_id = _plan(store, tmp_path, "killed")
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=1, on_demand_gpus=1))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", RUNNER, store_url, job_id, str(ttl_s), str(tmp_path / "workers.log")]
    runner = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None
        kinds = runner.stdout.readline().strip().split(",")
        assert len(kinds) == 1 and kinds[0] in {k.value for k in PoolKind}, kinds
        kind = kinds[0]
        runner.send_signal(signal.SIGKILL)  # its worker dies with it (PR_SET_PDEATHSIG)
        runner.wait(timeout=30)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()

    def reserve() -> str | None:
        return store.reserve_launch(job_id, 1, tenant=TENANT, kind=kind, pool="p", runner="next", ttl_s=30)

    assert reserve() is None  # the dead runner's reservation (or its dead worker's lease) still counts
    # nothing renews it: it comes back by expiry, a TTL after the kill (and the polls)
    wait_for(reserve, timeout_s=ttl_s + 20, what="the dead runner's GPU to come back")
