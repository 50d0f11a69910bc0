"""The local runner on a managed pool: a shard waiting for a Spot slot escalates when slack falls."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.local.runner import LocalRun, RunOptions
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_shard_waiting_on_a_full_spot_pool_moves_to_on_demand_when_its_slack_runs_out(
    tmp_path: Path,
) -> None:
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    store.set_capacity("local-spot", 1)
    now = dt.datetime.now(dt.timezone.utc)
    request = PlanRequest(
        input_uri=str(mixed_input(24, seed=1).write(tmp_path / "in.jsonl")),
        deadline=now + dt.timedelta(hours=2),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=1,
        microbatch_size=4,
        max_invalid_fraction=0.5,
    )
    job_id = plan_job(store, request).job_id
    # another tenant's run holds the one Spot slot
    blocker = store.request_dispatch(
        "j-other", 0, tenant="search", pool="local-spot", latest_start=0.0, ttl_s=3600
    )
    assert blocker is not None and blocker.granted

    clock = ManualClock(now)
    run = LocalRun(store, job_id, RunOptions(workers=1, worker_env={"ADB_ECHO_DELAY_S": "0.001"}), clock)
    with open(tmp_path / "workers.log", "ab") as log:
        run.launch_ready(time.monotonic(), log)
    assert run.waiting == {0: "local-spot"} and not run.running  # placed on Spot: it waits for the slot
    waiting = [r for r in store.dispatch_requests("local-spot") if r.job_id == job_id]
    assert len(waiting) == 1 and not waiting[0].granted

    clock.set(store.get_job(job_id).deadline - dt.timedelta(seconds=1))  # no slack left: on-demand
    run.work_until_done(None)

    assert {s.state for s in store.list_shards(job_id)} == {ShardState.SUCCEEDED}
    assert {a.pool for a in store.list_attempts(job_id)} == {"local-on-demand"}
    assert [r.job_id for r in store.dispatch_requests()] == ["j-other"]  # its Spot request was withdrawn
    assert store.dispatch_grants(job_id=job_id) == []
    store.close()
