"""SIGSTOP a `deadline-batch run` that holds a managed pool's one GPU for longer than its TTL.

Its worker keeps running (and renewing its shard lease) while the runner is stopped: the slot must
stay counted, so another tenant's request is not granted the busy GPU. After SIGCONT the run
carries on and completes; the grant record never shows two slots held at once on the 1-GPU pool.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import cli_argv, cli_env, wait_for
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

POOL = "local-spot"
TTL_S = 2.0


def test_a_stopped_runner_keeps_its_busy_slot_and_the_pool_never_runs_over(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    store.set_capacity(POOL, 1)
    argv = cli_argv(
        "run", str(mixed_input(40, seed=41).write(tmp_path / "in.jsonl")), "--deadline", "+1h",
        "--tenant", "ads", "--engine", "echo", "--workers", "1", "--store", url,
        "--output", str(tmp_path / "out"), "--lease-ttl", str(TTL_S), "--microbatch-size", "4",
        "--max-invalid-fraction", "0.5",
    )  # fmt: skip
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=cli_env({"ADB_ECHO_DELAY_S": "0.15"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        held = wait_for(
            lambda: [
                r
                for r in store.dispatch_requests(POOL)
                if r.granted and store.get_shard(r.job_id, r.shard_index).state is ShardState.LEASED
            ],
            timeout_s=60,
            what="a granted shard its worker leases",
        )[0]
        os.kill(proc.pid, signal.SIGSTOP)  # the runner only: its worker keeps running
        stopped_at = store.db_time()
        wait_for(lambda: store.db_time() > stopped_at + 1.5 * TTL_S, timeout_s=30, what="the TTL to pass")
        other = store.request_dispatch("j-other", 0, tenant="search", pool=POOL, latest_start=0, ttl_s=600)
        assert other is not None
        if other.granted:  # only once the stopped run's worker is done with the GPU
            assert store.get_shard(held.job_id, held.shard_index).state is not ShardState.LEASED
        else:
            assert [r.job_id for r in store.dispatch_requests(POOL) if r.granted] == [held.job_id]
        store.release_dispatch("j-other")
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert {s.state for s in store.list_shards(held.job_id)} == {ShardState.SUCCEEDED}
    grants = sorted(store.dispatch_grants(pool=POOL), key=lambda g: g.granted_at)
    for before, after in zip(grants, grants[1:], strict=False):
        assert before.released_at is not None and after.granted_at >= before.released_at, (before, after)
    assert store.dispatch_requests() == []
    store.close()
