"""Several finalizers at once (a sensor retry beside a CLI run, say): one publishes, all agree."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import pytest

import airflow_deadline_batch.local.runner as runner
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.service.planning import PlanRequest
from airflow_deadline_batch.store import ManifestStore

pytestmark = pytest.mark.integration
SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"


def test_concurrent_finalizers_publish_one_manifest(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ManifestStore.open(store_url)
    # run every shard to success but leave the job unfinalized
    monkeypatch.setattr(runner, "_finalize", lambda store, job_id, clock, passed: None)
    request = PlanRequest(
        input_uri=str(SAMPLE),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=2,
    )
    with pytest.raises(AttributeError):  # the summary reads the (skipped) finalize result
        runner.run_job(store, request, runner.RunOptions(workers=2))
    [job] = store.list_jobs(1)
    assert job.manifest_uri is None
    barrier = threading.Barrier(4)
    results: list[object] = []

    def finalize() -> None:
        own = ManifestStore(store_url)
        barrier.wait()
        try:
            results.append(finalize_job(own, job.job_id).manifest_uri)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            results.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=finalize) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = store.get_job(job.job_id)
    assert final.state is JobState.COMPLETED
    assert results == [final.manifest_uri] * 4
    store.close()
