"""Two ``deadline-batch run`` processes of one tenant share its GPU quota from start to finish.

Two jobs of tenant ``ads`` run at once, each in its own process with its own workers, under a
quota of one Spot and one on-demand GPU. Every launch reserves its GPU (docs/tenants.md, "Quotas
and budgets"), gives it back when its worker ends and takes it again for the next shard: at no
moment do the two jobs' attempts hold more than one GPU of a kind, both complete, and nothing is
left reserved. (The race at the very moment of a launch, before a claim shows, is pinned
deterministically by tests/integration/test_quota_reservations.py.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from airflow_deadline_batch.core.job_view import pool_named
from airflow_deadline_batch.core.pools import PoolSpec
from airflow_deadline_batch.store import ManifestStore, TenantQuotaRow
from tests.e2e.conftest import cli_argv, cli_env, finish_runs
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import assert_outcomes_match, read_manifest, read_outcomes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
TENANT = "ads"


def _peak(intervals: list[tuple[float, float]]) -> int:
    events = sorted(
        [(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1])
    )
    level = peak = 0
    for _, step in events:  # an end before a start at the same instant
        level += step
        peak = max(peak, level)
    return peak


def test_two_runs_of_one_tenant_never_hold_more_than_its_quota(store_url: str, tmp_path: Path) -> None:
    store = ManifestStore.open(store_url)
    store.set_quota(TenantQuotaRow(tenant=TENANT, spot_gpus=1, on_demand_gpus=1))
    inputs, procs = {}, {}
    for key in ("first", "second"):
        inputs[key] = mixed_input(24, seed=len(procs) + 3)
        args = [
            "run", str(inputs[key].write(tmp_path / f"{key}.jsonl")), "--deadline", "+1h", "--engine", "echo",
            "--workers", "1", "--store", store_url, "--output", str(tmp_path / "out"), "--tenant", TENANT,
            "--idempotency-key", key, "--microbatch-size", "4", "--max-invalid-fraction", "0.5", "--json",
        ]  # fmt: skip
        procs[key] = subprocess.Popen(
            cli_argv(*args),
            cwd=tmp_path,
            env=cli_env({"ADB_ECHO_DELAY_S": "0.05"}),
            stdout=subprocess.PIPE,
            stderr=(tmp_path / f"{key}.err").open("wb"),
            text=True,
        )
    summaries = finish_runs(procs, tmp_path, timeout_s=200)
    try:
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for key, summary in summaries.items():
            assert summary["state"] == "completed", (key, summary)
            assert_outcomes_match(read_outcomes(read_manifest(summary["manifest"])), inputs[key])
            job_id = summary["job_id"]
            pools = [PoolSpec.from_dict(p) for p in store.get_job(job_id).config["pools"]]
            for attempt in store.list_attempts(job_id):
                pool = pool_named(attempt.pool, pools)
                assert pool is not None and attempt.ended_at is not None
                span = (attempt.started_at.timestamp(), attempt.ended_at.timestamp())
                by_kind.setdefault(pool.kind.value, []).append(span)
        assert by_kind
        assert {kind: _peak(spans) for kind, spans in by_kind.items()} == {kind: 1 for kind in by_kind}
        assert store.tenant_gpus_in_use(TENANT) == {}  # every reservation came back
    finally:
        store.close()
