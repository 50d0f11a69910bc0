"""Usage settlement on SQLite and PostgreSQL: every attempt once, superseded output included.

Shards run to success through the local runner (real worker processes), then one output object
an attempt wrote but never committed is planted (what a fenced attempt leaves behind), and four
finalizers race: the ledger holds one row per attempt, the superseded tokens are counted, the
manifest's usage equals the ledger's sums, and settling again changes nothing.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
from pathlib import Path

import pytest

import airflow_deadline_batch.local.runner as runner
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.results import ResultRecord, Usage, encode_results
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.service.planning import PlanRequest
from airflow_deadline_batch.service.settlement import settle_job
from airflow_deadline_batch.storage import open_storage
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.outcomes import read_manifest

pytestmark = pytest.mark.integration
SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"


def _superseded_object(attempt_id: str) -> bytes:
    return encode_results(
        ResultRecord(
            line=n,
            id=f"late-{n}",
            status="succeeded",
            output="x",
            usage=Usage(prompt_tokens=100, completion_tokens=7),
            shard_id="00000",
            attempt_id=attempt_id,
        )
        for n in (1, 2)
    )


def test_usage_is_settled_once_with_superseded_output(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ManifestStore.open(store_url)
    monkeypatch.setattr(runner, "_finalize", lambda store, job_id, clock, passed: None)
    request = PlanRequest(
        input_uri=str(SAMPLE),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=2,
        tenant="team-a",
    )
    with pytest.raises(AttributeError):  # the summary reads the (skipped) finalize result
        runner.run_job(store, request, runner.RunOptions(workers=2))
    [job] = store.list_jobs(1)
    attempts = store.list_attempts(job.job_id)
    commits = [c for c in store.list_commits(job.job_id) if c.shard_index >= 0]
    late = attempts[0].attempt_id
    output = open_storage(job.output_uri)
    output.put_bytes(f"attempts/{late}/shard-00000-mb-000999.jsonl", _superseded_object(late))

    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def finalize() -> None:
        own = ManifestStore(store_url)
        barrier.wait()
        try:
            finalize_job(own, job.job_id)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            own.close()

    threads = [threading.Thread(target=finalize) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    final = store.get_job(job.job_id)
    assert final.state is JobState.COMPLETED

    ledger = store.job_usage(job.job_id)
    assert sorted(r.attempt_id for r in ledger) == sorted(a.attempt_id for a in attempts)
    assert {r.tenant for r in ledger} == {"team-a"}
    assert sum(r.prompt_tokens for r in ledger) == sum(c.prompt_tokens for c in commits) + 200
    assert sum(r.completion_tokens for r in ledger) == sum(c.completion_tokens for c in commits) + 14
    assert sum(r.superseded_records for r in ledger) == 2
    assert sum(r.committed_records for r in ledger) == sum(c.records for c in commits)
    for row in ledger:
        assert row.gpu_seconds >= 0 and row.price_per_gpu_hour > 0
        assert row.cost == pytest.approx(row.gpu_seconds * row.price_per_gpu_hour / 3600)

    usage = read_manifest(str(final.manifest_uri))["usage"]
    assert usage["tenant"] == "team-a"
    assert usage["attempts"] == len(attempts)
    assert usage["prompt_tokens"] == sum(r.prompt_tokens for r in ledger)
    assert usage["cost"] == math.fsum(r.cost for r in ledger)
    assert usage["gpu_seconds"] == math.fsum(r.gpu_seconds for r in ledger)

    # a late finalizer (or a sensor retry) settles nothing twice: the object is collected by now,
    # and the ledger rows are kept as first written
    again = settle_job(store, final, output)
    assert store.job_usage(job.job_id) == ledger
    assert again.prompt_tokens == usage["prompt_tokens"] and again.cost == usage["cost"]
    assert finalize_job(store, job.job_id).manifest_uri == final.manifest_uri
    assert store.job_usage(job.job_id) == ledger
    store.close()
