"""The manifest and the finalizer's outcome objects of a messy job are byte-identical to before.

The manifest format is a public contract (docs/design.md §4.3). The job (tests/helpers/messy_job.py)
is built through the store's worker calls (claim, commit, complete or fail; no engine): the
planner's validation object (bad and blank lines), a shard that succeeded over two microbatches
after a preempted attempt whose object never committed, a shard that failed for good after one
commit, a shard with one commit left running and a shard with none (expired). ``finalize_job`` with
``expire_unfinished`` publishes it ``partial``. Everything it wrote (manifest, finalizer objects,
validation object) must equal, byte for byte once the random IDs, the temporary path, the
creation time and the measured GPU time are replaced by placeholders, what the finalizer at
``934ffde`` (before streaming) wrote (``data/finalize_manifest_golden.json``;
``ADB_REGEN_GOLDEN=1`` rewrites it).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.service.finalize import finalize_job, verify_job
from airflow_deadline_batch.storage import open_storage, read_ahead
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.messy_job import build_messy_job, normalized_outputs

pytestmark = pytest.mark.integration
GOLDEN = Path(__file__).parent / "data" / "finalize_manifest_golden.json"


@pytest.mark.parametrize("whole_records", [20_000, 0], ids=["read-whole", "streamed"])
def test_manifest_of_a_messy_job_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_records: int
) -> None:
    # 0: every object is streamed in chunks rather than read whole (the path of large objects)
    monkeypatch.setattr(read_ahead, "WHOLE_OBJECT_RECORDS", whole_records)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        job_id = build_messy_job(store, tmp_path)
        clock = ManualClock(dt.datetime(2029, 12, 31, 23, 0, tzinfo=dt.timezone.utc))
        result = finalize_job(store, job_id, clock=clock, expire_unfinished=True)
        assert result.state is JobState.PARTIAL
        assert verify_job(store, job_id).complete
        got = normalized_outputs(store, job_id, tmp_path)
        codes = {
            (o["status"], o["error"]["code"])
            for key, text in got.items()
            if key != "manifest.json"
            for o in map(json.loads, text.splitlines())
        }
        assert {("errored", "shard_failed"), ("expired", "expired"), ("errored", "invalid_json")} <= codes
        if os.environ.get("ADB_REGEN_GOLDEN"):
            GOLDEN.parent.mkdir(exist_ok=True)
            GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        expected = json.loads(GOLDEN.read_text())
        assert sorted(got) == sorted(expected)
        for key in expected:
            assert got[key] == expected[key], f"{key} differs from the golden copy"
    finally:
        store.close()


@pytest.mark.parametrize("whole_records", [20_000, 0], ids=["read-whole", "streamed"])
def test_an_object_failing_its_checksum_counts_none_of_its_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_records: int
) -> None:
    monkeypatch.setattr(read_ahead, "WHOLE_OBJECT_RECORDS", whole_records)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        job_id = build_messy_job(store, tmp_path)
        job = store.get_job(job_id)
        [validation] = [c for c in store.list_commits(job_id) if c.shard_index == -1]
        clean = verify_job(store, job_id)
        assert clean.checksum_failures == 0 and clean.seen >= validation.records
        # same lines, one byte changed inside an error message: every line still parses
        output = open_storage(job.output_uri)
        data = output.get_bytes("validation/errors.jsonl")
        output.put_bytes("validation/errors.jsonl", data.replace(b"line", b"LINE", 1))
        report = verify_job(store, job_id)
        assert report.checksum_failures == 1
        assert report.seen == clean.seen - validation.records
        assert report.outcomes["errored"] == clean.outcomes["errored"] - validation.records
        assert any("fails its SHA-256" in p for p in report.problems)
    finally:
        store.close()


@pytest.mark.parametrize("whole_records", [20_000, 0], ids=["read-whole", "streamed"])
def test_on_s3_objects_read_in_parallel_give_the_same_report_and_manifest_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_records: int, s3_base_uri: str
) -> None:
    """The same messy job with its outputs on S3 (moto's server): read ahead by 3 threads."""
    monkeypatch.setattr(read_ahead, "WHOLE_OBJECT_RECORDS", whole_records)
    monkeypatch.setattr(read_ahead, "READ_AHEAD", 3)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        job_id = build_messy_job(store, tmp_path, s3_base_uri)
        clock = ManualClock(dt.datetime(2029, 12, 31, 23, 0, tzinfo=dt.timezone.utc))
        result = finalize_job(store, job_id, clock=clock, expire_unfinished=True)
        assert result.state is JobState.PARTIAL and result.manifest_uri is not None
        assert result.manifest_uri.startswith("s3://")
        text = json.loads(GOLDEN.read_text())["manifest.json"]
        golden = orjson.loads(text.replace('"gpu_seconds": GPU', '"gpu_seconds": 0'))
        assert result.manifest is not None
        assert result.manifest["outcomes"] == golden["outcomes"]
        assert [(s["shard_id"], s["seq"], s["records"]) for s in result.manifest["shards"]] == [
            (s["shard_id"], s["seq"], s["records"]) for s in golden["shards"]
        ]
        report = verify_job(store, job_id)
        assert report.complete and report.seen == golden["input"]["records"]
        # a corrupted object on S3 is caught whichever way it is read
        output = open_storage(store.get_job(job_id).output_uri)
        data = output.get_bytes("validation/errors.jsonl")
        output.put_bytes("validation/errors.jsonl", data.replace(b"line", b"LINE", 1))
        broken = verify_job(store, job_id)
        assert broken.checksum_failures == 1 and not broken.complete
    finally:
        store.close()
