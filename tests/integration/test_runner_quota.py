"""The local runner keeps a running job within its tenant's GPU quota (real worker processes)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from airflow_deadline_batch.core.job_view import pool_named
from airflow_deadline_batch.core.pools import PoolSpec, default_local_pools
from airflow_deadline_batch.local.runner import RunOptions, run_job
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import AttemptRow, ManifestStore, TenantQuotaRow
from tests.helpers.inputs import mixed_input

pytestmark = pytest.mark.integration


def _max_overlap(attempts: list[AttemptRow]) -> int:
    events = []
    for a in attempts:
        assert a.ended_at is not None
        events += [(a.started_at, 1), (a.ended_at, -1)]
    level = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at one instant
        level += step
        peak = max(peak, level)
    return peak


def test_a_running_job_stays_within_its_tenant_gpu_quota(tmp_path: Path) -> None:
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    path = mixed_input(120, seed=9).write(tmp_path / "input.jsonl")
    request = PlanRequest(
        input_uri=str(path),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=4,
        microbatch_size=10,
        max_invalid_fraction=0.5,
        tenant="ads",
        idempotency_key="quota-run",
    )
    plan = plan_job(store, request)  # admitted without a quota: 4 workers
    assert plan.shards >= 4
    store.set_quota(TenantQuotaRow(tenant="ads", spot_gpus=1, on_demand_gpus=1))
    summary = run_job(store, request, RunOptions(workers=4, worker_env={"ADB_ECHO_DELAY_S": "0.01"}))
    assert summary.state == "completed"
    pools = [PoolSpec.from_dict(p) for p in store.get_job(plan.job_id).config["pools"]]
    attempts = store.list_attempts(plan.job_id)
    by_kind: dict[str, list[AttemptRow]] = {}
    for attempt in attempts:
        pool = pool_named(attempt.pool, pools)
        assert pool is not None
        by_kind.setdefault(pool.kind.value, []).append(attempt)
    assert by_kind
    for kind, tries in by_kind.items():
        assert _max_overlap(tries) <= 1, kind
    store.close()
