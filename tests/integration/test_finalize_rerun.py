"""A finalizer that fails part-way leaves no orphan objects once it is run again.

The failure is real: the key of the third object the finalizer writes is a directory, so the
local storage's atomic rename fails (``StorageError``) after two ``finalize/`` objects are written,
as a full disk or a lost mount would. A re-run rewrites the objects it still needs in place
(their keys are the shard and status, their bytes follow from the input and the commits), so the
job's outputs and manifest are byte for byte those of an uninterrupted finalizer (the golden copy
of test_finalize_manifest_golden.py); when the job is cancelled in between, the re-run's
``cancelled`` objects replace the first try's, which are deleted once the manifest is published.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.exceptions import StorageError
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.storage import open_storage
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.messy_job import build_messy_job, normalized_outputs

pytestmark = pytest.mark.integration
GOLDEN = Path(__file__).parent / "data" / "finalize_manifest_golden.json"
CLOCK = ManualClock(dt.datetime(2029, 12, 31, 23, 0, tzinfo=dt.timezone.utc))
CLASH = "finalize/shard-00003-expired.jsonl"


def _fail_part_way(store: ManifestStore, job_id: str) -> Path:
    """Run a finalizer that fails on its third object; return the directory in that object's way."""
    output = open_storage(store.get_job(job_id).output_uri)
    blocker = Path(output.uri(CLASH))
    blocker.mkdir(parents=True)
    with pytest.raises(StorageError, match="clash"):
        finalize_job(store, job_id, clock=CLOCK, expire_unfinished=True)
    assert store.get_job(job_id).state is JobState.FINALIZING
    assert list(output.list_keys("finalize/")) == [
        "finalize/shard-00001-errored.jsonl",
        "finalize/shard-00002-expired.jsonl",
    ]
    return blocker


def _listed_finalize_objects(store: ManifestStore, job_id: str, manifest: dict) -> tuple[list, list]:
    output = open_storage(store.get_job(job_id).output_uri)
    stored = sorted(output.uri(k) for k in output.list_keys("finalize/"))
    listed = sorted(s["uri"] for s in manifest["shards"] if s["attempt_id"] == "finalize")
    return stored, listed


def test_a_rerun_after_a_failure_part_way_writes_the_same_objects_and_manifest(tmp_path: Path) -> None:
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        job_id = build_messy_job(store, tmp_path)
        shutil.rmtree(_fail_part_way(store, job_id))  # storage is back
        result = finalize_job(store, job_id, clock=CLOCK, expire_unfinished=True)
        assert result.state is JobState.PARTIAL and result.manifest is not None
        stored, listed = _listed_finalize_objects(store, job_id, result.manifest)
        assert stored == listed and len(listed) == 3
        expected = json.loads(GOLDEN.read_text())
        got = normalized_outputs(store, job_id, tmp_path)
        assert sorted(got) == sorted(expected)
        for key in expected:
            assert got[key] == expected[key], f"{key} differs from an uninterrupted finalizer's"
    finally:
        store.close()


def test_a_rerun_after_a_cancel_deletes_the_first_tries_objects(tmp_path: Path) -> None:
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    twin_store = ManifestStore.open(f"sqlite:///{tmp_path / 'twin.db'}")
    try:
        job_id = build_messy_job(store, tmp_path)
        shutil.rmtree(_fail_part_way(store, job_id))
        store.cancel_job(job_id)
        result = finalize_job(store, job_id, clock=CLOCK)
        assert result.state is JobState.CANCELLED and result.manifest is not None
        stored, listed = _listed_finalize_objects(store, job_id, result.manifest)
        assert stored == listed
        assert [Path(uri).name for uri in stored] == [f"shard-0000{i}-cancelled.jsonl" for i in (1, 2, 3)]
        # the same job cancelled before its first finalizer, which then runs through
        twin_dir = tmp_path / "twin"
        twin_dir.mkdir()
        twin_id = build_messy_job(twin_store, twin_dir)
        twin_store.cancel_job(twin_id)
        assert finalize_job(twin_store, twin_id, clock=CLOCK).state is JobState.CANCELLED
        assert normalized_outputs(store, job_id, tmp_path) == normalized_outputs(
            twin_store, twin_id, twin_dir
        )
    finally:
        store.close()
        twin_store.close()
