"""Hostile runs against the dispatcher: stalled runners, expired grants, slots under live workers."""

from __future__ import annotations

import datetime as dt
import math
import time
from pathlib import Path

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.local.runner import LocalRun, RunOptions, _stop_all
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _plan(store: ManifestStore, tmp_path: Path, *, key: str | None = None) -> str:
    request = PlanRequest(
        input_uri=str(mixed_input(8, seed=1).write(tmp_path / "in.jsonl")),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=1,
        microbatch_size=4,
        max_invalid_fraction=0.5,
        idempotency_key=key,
    )
    return plan_job(store, request).job_id


def _wait_db_past(store: ManifestStore, t: float) -> None:
    """Wait (a deadline, not a sleep) until the database clock is past ``t``."""
    wait_for(lambda: store.db_time() > t, timeout_s=10, what="the database clock to move", interval_s=0.01)


def test_a_slot_under_a_live_worker_does_not_expire_when_its_runner_stalls(
    store: ManifestStore, tmp_path: Path
) -> None:
    store.set_capacity("gpu", 1)
    job_id = _plan(store, tmp_path)
    row = store.request_dispatch(job_id, 0, tenant="ads", pool="gpu", latest_start=0.0, ttl_s=0.0)
    assert row is not None and row.granted
    store.claim_shard(job_id, 0, ttl_s=600, worker="w-1", pool="gpu")  # its worker runs and renews
    _wait_db_past(store, row.expires_at)  # the runner stalls (SIGSTOP) past its TTL

    other = store.request_dispatch("j-other", 0, tenant="search", pool="gpu", latest_start=0.0, ttl_s=60)
    assert other is not None and not other.granted  # the one GPU is still in use: no over-capacity
    assert [r.job_id for r in store.dispatch_requests("gpu") if r.granted] == [job_id]


def test_a_waiting_row_and_a_slot_without_a_live_worker_still_expire(
    store: ManifestStore, tmp_path: Path
) -> None:
    store.set_capacity("gpu", 1)
    job_id = _plan(store, tmp_path)
    row = store.request_dispatch(job_id, 0, tenant="ads", pool="gpu", latest_start=0.0, ttl_s=0.0)
    assert row is not None and row.granted  # granted, but its worker never claimed the shard
    _wait_db_past(store, row.expires_at)
    other = store.request_dispatch("j-other", 0, tenant="search", pool="gpu", latest_start=0.0, ttl_s=60)
    assert other is not None and other.granted
    assert [g.release for g in store.dispatch_grants(job_id=job_id)] == ["expired"]


def test_a_runner_resumed_after_its_grant_expired_does_not_launch_on_it(tmp_path: Path) -> None:
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    store.set_capacity("local-spot", 1)
    store.set_capacity("local-on-demand", 1)
    job_id = _plan(store, tmp_path)
    clock = ManualClock(dt.datetime.now(dt.timezone.utc))
    options = RunOptions(workers=1, lease_ttl_s=0.5, worker_env={"ADB_ECHO_DELAY_S": "0.001"})
    run = LocalRun(store, job_id, options, clock)
    run.request_slot(0, "local-spot")  # granted; the runner stalls before it launches
    assert run.granted == {0: "local-spot"} and not run.running
    row = store.dispatch_requests("local-spot")[0]
    _wait_db_past(store, row.expires_at)
    # meanwhile the dead-looking run's slot went to another tenant
    other = store.request_dispatch(
        "j-other", 0, tenant="search", pool="local-spot", latest_start=0.0, ttl_s=60
    )
    assert other is not None and other.granted

    with open(tmp_path / "workers.log", "ab") as log:
        run.launch_ready(time.monotonic(), log)  # resumed (SIGCONT)
    try:
        assert not run.running  # it must not start a worker on the slot it lost
        assert run.waiting == {0: "local-spot"}  # it asked again
        held = [r.job_id for r in store.dispatch_requests("local-spot") if r.granted]
        assert held == ["j-other"]
    finally:
        run.withdraw_dispatch()
        store.close()


def test_a_second_run_of_the_same_job_never_takes_or_gives_back_the_first_runs_slot(tmp_path: Path) -> None:
    """`deadline-batch run` twice on one job, one managed GPU: the slot stays the first run's."""
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    store.set_capacity("local-spot", 1)
    store.set_capacity("local-on-demand", 1)
    job_id = _plan(store, tmp_path)
    clock = ManualClock(dt.datetime.now(dt.timezone.utc))
    options = RunOptions(workers=1, worker_env={"ADB_ECHO_DELAY_S": "5"})  # A's worker stays busy
    first, second = LocalRun(store, job_id, options, clock), LocalRun(store, job_id, options, clock)
    log = open(tmp_path / "workers.log", "ab")  # noqa: SIM115 - closed in finally
    try:
        first.launch_ready(time.monotonic(), log)  # asks, is granted
        first.launch_ready(time.monotonic(), log)  # launches on its grant
        assert list(first.running) == [0]
        wait_for(
            lambda: store.get_shard(job_id, 0).state is ShardState.LEASED,
            timeout_s=15,
            what="the first run's worker to claim",
        )
        pool = first.granted[0]

        for _ in range(2):
            second.launch_ready(time.monotonic(), log)
        wait_for(
            lambda: all(r.proc.popen.poll() is not None for r in second.running.values()),
            timeout_s=15,
            what="refused workers",
        )
        second.reap_exited(time.monotonic())
        second.withdraw_dispatch()  # the second run gives up (Ctrl-C) and withdraws its rows

        held = [(r.job_id, r.shard_index) for r in store.dispatch_requests(pool) if r.granted]
        assert held == [(job_id, 0)]  # the first run's worker still holds the pool's one GPU
        other = store.request_dispatch("j-other", 0, tenant="search", pool=pool, latest_start=0.0, ttl_s=60)
        assert other is not None and not other.granted  # so nobody else is granted it
    finally:
        _stop_all(store, {**first.running, **{k + 1000: v for k, v in second.running.items()}}, 1.0)
        log.close()
        first.withdraw_dispatch()
        store.close()


@pytest.mark.parametrize(
    ("latest_start", "ttl_s", "message"),
    [
        (math.nan, 60.0, "latest_start"),
        (1.0, math.nan, "ttl_s"),
        (1.0, math.inf, "ttl_s"),  # rows that never expire: a dead run would hold its slots forever
        (1.0, -5.0, "ttl_s"),
    ],
)
def test_garbage_dispatch_requests_get_a_one_line_error_and_write_nothing(
    store: ManifestStore, latest_start: float, ttl_s: float, message: str
) -> None:
    store.set_capacity("gpu", 1)
    with pytest.raises(ValueError, match=message) as raised:
        store.request_dispatch("j", 0, tenant="ads", pool="gpu", latest_start=latest_start, ttl_s=ttl_s)
    assert "\n" not in str(raised.value)
    assert store.dispatch_requests() == []


def test_a_capacity_beyond_the_column_gets_a_one_line_error(store: ManifestStore) -> None:
    with pytest.raises(ValueError, match="gpus must be <= 2147483647"):
        store.set_capacity("gpu", 2**40)
    assert store.list_capacity() == []
    assert store.set_capacity("gpu", 2**31 - 1).gpus == 2**31 - 1


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("k" * 256, "at most 255"),  # PostgreSQL: 'value too long' blamed on the store URL
        ("k#rejected-j-aaaaaaaaaaaaaaaaaaaa", "#rejected-"),  # would pass for a rejected job's key
    ],
)
def test_an_idempotency_key_the_store_cannot_keep_gets_a_one_line_error(
    store: ManifestStore, tmp_path: Path, key: str, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as raised:
        _plan(store, tmp_path, key=key)
    assert "\n" not in str(raised.value)
    assert store.get_job_by_idempotency_key(key) is None
    assert _plan(store, tmp_path, key="k" * 255)  # the longest key is fine


def test_a_request_on_a_pool_no_longer_managed_is_withdrawn_not_left_to_be_granted_later(
    tmp_path: Path,
) -> None:
    """`capacity delete` while a shard waits, then `capacity set` again: no phantom grant."""
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    store.set_capacity("local-spot", 1)
    job_id = _plan(store, tmp_path)
    blocker = store.request_dispatch(
        "j-other", 0, tenant="search", pool="local-spot", latest_start=0, ttl_s=600
    )
    assert blocker is not None and blocker.granted
    clock = ManualClock(dt.datetime.now(dt.timezone.utc))
    run = LocalRun(store, job_id, RunOptions(workers=1), clock)
    try:
        with open(tmp_path / "workers.log", "ab") as log:
            run.launch_ready(time.monotonic(), log)
        assert run.waiting == {0: "local-spot"}
        assert store.delete_capacity("local-spot")
        run.managed_read_at = -math.inf  # the run reads the managed pools again at its next poll
        run.poll_dispatch(time.monotonic())
        assert not run.waiting and run.pending[0] == 0  # placed again, on an unmanaged pool
        assert [r.job_id for r in store.dispatch_requests()] == ["j-other"]  # its request withdrawn

        store.set_capacity("local-spot", 2)  # managed again: the old request must not be granted
        store.release_dispatch("j-other")
        assert [r.job_id for r in store.dispatch_requests()] == []
    finally:
        run.withdraw_dispatch()
        store.close()
