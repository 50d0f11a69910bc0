"""Usage settled once under chaos: preempted workers, the runner SIGKILLed, a resumed run, more finalizers.

The real CLI runs with injected preemptions (SIGTERM, then SIGKILL after the notice); it is
SIGKILLed mid-job together with its workers, then rerun with the same idempotency key and
tenant, which resumes and publishes the job. Two more finalizations follow. The ledger holds one
row per attempt (all of them, preempted and killed ones included), its committed records equal
the commits', and the manifest's usage is the ledger's sums.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
from pathlib import Path

import pytest

from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import cli_argv, cli_env, run_cli, wait_for
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import read_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_usage_is_settled_once_across_kills_resumption_and_finalizers(tmp_path: Path) -> None:
    mixed = mixed_input(300, seed=5)
    path = mixed.write(tmp_path / "input.jsonl")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    key = "usage-chaos"
    args = [
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2", "--store", store_url,
        "--output", str(tmp_path / "out"), "--idempotency-key", key, "--lease-ttl", "5",
        "--microbatch-size", "10", "--max-invalid-fraction", "0.5", "--tenant", "ads",
        "--preempt-rate", "400", "--preempt-notice", "0.2", "--seed", "3", "--json",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cli_argv(*args),
        cwd=tmp_path,
        env=cli_env({"ADB_ECHO_DELAY_S": "0.02"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    store = ManifestStore.open(store_url, migrate=True)
    try:

        def partly_committed() -> str | None:
            job = store.get_job_by_idempotency_key(key)
            if job is None:
                return None
            committed = store.progress(job.job_id).committed_records
            return job.job_id if len(mixed.expected) // 4 <= committed < len(mixed.expected) else None

        job_id = wait_for(partly_committed, timeout_s=120, what="a quarter of the records to commit")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

        again = run_cli(*args, cwd=tmp_path, env={"ADB_ECHO_DELAY_S": "0.001"})
        assert again.code == 0, again.describe()
        assert again.json()["job_id"] == job_id
        job = store.get_job(job_id)
        assert job.tenant == "ads"
        ledger = store.job_usage(job_id)
        for _ in range(2):  # a sensor retry and an operator rerun finalize again: nothing changes
            assert finalize_job(store, job_id).manifest_uri == job.manifest_uri
            assert store.job_usage(job_id) == ledger

        attempts = store.list_attempts(job_id)
        commits = [c for c in store.list_commits(job_id) if c.shard_index >= 0]
        assert len(attempts) > len({c.shard_index for c in commits})  # retries happened
        assert sorted(r.attempt_id for r in ledger) == sorted(a.attempt_id for a in attempts)
        assert sum(r.committed_records for r in ledger) == sum(c.records for c in commits)
        assert sum(r.prompt_tokens for r in ledger) >= sum(c.prompt_tokens for c in commits)
        usage = read_manifest(str(job.manifest_uri))["usage"]
        assert usage["attempts"] == len(ledger)
        assert usage["prompt_tokens"] == sum(r.prompt_tokens for r in ledger)
        assert usage["completion_tokens"] == sum(r.completion_tokens for r in ledger)
        assert usage["cost"] == math.fsum(r.cost for r in ledger) > 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        store.close()
