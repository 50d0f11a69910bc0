"""The local launcher run inside a pod: its workers are local processes, named ``host:pid``.

A shard pod's worker names its attempts after the pod (``ADB_POD_NAME``, set by the pod operator
from the downward API); a launcher that itself runs in such a pod (``deadline-batch run`` as a pod,
an Airflow worker on Kubernetes) must not pass that name on, or it could no longer find its dead
workers' attempts and their leases would lapse instead of being ended at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.core.worker_command import POD_NAME_ENV
from airflow_deadline_batch.local.launcher import fence_dead_worker
from airflow_deadline_batch.store import ManifestStore
from tests.integration.test_crash_not_preemption import kill_paused_worker, two_jobs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_launcher_in_a_pod_still_ends_its_killed_workers_attempt(
    store: ManifestStore, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(POD_NAME_ENV, "deadline-batch-run-7f3k2")  # the launcher's own pod
    job_id, _ = two_jobs(store, tmp_path)
    proc = kill_paused_worker(store_url, job_id, tmp_path / "paused")

    (attempt,) = store.list_attempts(job_id)
    assert attempt.worker.endswith(f":{proc.pid}") and not attempt.worker.startswith("deadline-batch-run-")
    assert fence_dead_worker(store, proc, signalled=True)  # found and ended now, not at the lease's end
    (attempt,) = store.list_attempts(job_id)
    assert (attempt.outcome, attempt.failure_class) == (AttemptOutcome.ABANDONED, "preempted")
    assert store.get_shard(job_id, 0).lease_attempt_id is None
