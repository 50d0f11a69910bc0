"""An input rewritten while it is being planned is refused, not planned from two different files."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

import airflow_deadline_batch.service.planning as planning
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.exceptions import InputError
from airflow_deadline_batch.store import ManifestStore

SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"


def _request(input_uri: str, tmp_path: Path) -> planning.PlanRequest:
    """A plan of ``input_uri`` due in an hour, on the echo engine's local pools."""
    return planning.PlanRequest(
        input_uri=input_uri,
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
    )


def test_a_same_length_rewrite_between_the_planning_passes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "input.jsonl"
    path.write_bytes(SAMPLE.read_bytes())
    validate = planning.analyze_input

    def validate_then_rewrite(*args: Any, **kwargs: Any) -> Any:
        analysis = validate(*args, **kwargs)
        # same length, different bytes: turns a valid ID into a duplicate after validation
        path.write_bytes(path.read_bytes().replace(b"review-0003", b"review-0004", 1))
        return analysis

    monkeypatch.setattr(planning, "analyze_input", validate_then_rewrite)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    with pytest.raises(InputError, match="changed while it was being planned"):
        planning.plan_job(store, _request(str(path), tmp_path))
    assert store.list_jobs() == []
    store.close()


def test_an_s3_input_replaced_by_one_of_the_same_size_between_the_passes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_client: Any, s3_bucket: str
) -> None:
    """The check read only an S3 object's size, so a replacement of the same length between the
    validating pass and the range hashes planned a job whose shard hashes were of bytes never
    validated; the object's ETag now joins it (``S3Storage.version``)."""
    key = "batches/input.jsonl"
    data = SAMPLE.read_bytes()
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=data)
    validate = planning.analyze_input

    def validate_then_replace(*args: Any, **kwargs: Any) -> Any:
        analysis = validate(*args, **kwargs)
        replaced = data.replace(b"review-0003", b"review-0004", 1)  # same length: a new duplicate
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=replaced)
        return analysis

    monkeypatch.setattr(planning, "analyze_input", validate_then_replace)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    with pytest.raises(InputError, match="changed while it was being planned"):
        planning.plan_job(store, _request(f"s3://{s3_bucket}/{key}", tmp_path))
    assert store.list_jobs() == []
    store.close()
