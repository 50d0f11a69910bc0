"""An object store outage while finalizing does not fail a job whose outputs are intact.

docs/design.md §10: storage that cannot serve a committed object (an outage, lost credentials)
leaves the job ``finalizing``; finalizing again once storage is back publishes it. An object that
is gone for good still fails the job.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

import airflow_deadline_batch.local.runner as runner
import airflow_deadline_batch.service.finalize as finalize
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.exceptions import StorageError, VerificationError
from airflow_deadline_batch.service.planning import PlanRequest
from airflow_deadline_batch.storage import open_uri
from airflow_deadline_batch.storage.read_ahead import ObjectReader
from airflow_deadline_batch.store import JobRow, ManifestStore

pytestmark = pytest.mark.integration
SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"


@pytest.fixture
def unfinalized_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ManifestStore, JobRow]]:
    """A job whose every shard succeeded, left unfinalized (SQLite store, local output)."""
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    with monkeypatch.context() as patch:
        patch.setattr(runner, "_finalize", lambda store, job_id, clock, passed: None)
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
    yield store, job
    store.close()


def test_an_outage_leaves_the_job_finalizing_and_a_retry_publishes(
    unfinalized_job: tuple[ManifestStore, JobRow], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, job = unfinalized_job

    def outage(self: object, uri: str) -> bytes:
        raise StorageError(f"cannot read {uri}: connection reset; check the network", uri=uri)

    with monkeypatch.context() as patch:
        patch.setattr(ObjectReader, "get_bytes", outage)
        with pytest.raises(VerificationError, match="could not serve"):
            finalize.finalize_job(store, job.job_id)
    assert store.get_job(job.job_id).state is JobState.FINALIZING

    result = finalize.finalize_job(store, job.job_id)
    assert result.state is JobState.COMPLETED and result.manifest_uri
    assert result.report.complete and result.report.unreadable == 0


def test_a_missing_object_still_fails_the_job(unfinalized_job: tuple[ManifestStore, JobRow]) -> None:
    store, job = unfinalized_job
    commit = next(c for c in store.list_commits(job.job_id) if c.shard_index >= 0)
    storage, key = open_uri(commit.uri)
    storage.delete(key)
    with pytest.raises(VerificationError, match="unreadable"):
        finalize.finalize_job(store, job.job_id)
    assert store.get_job(job.job_id).state is JobState.FAILED
