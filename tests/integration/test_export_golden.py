"""The OpenAI Batch files exported from a messy job are byte-identical to what the export wrote
at ``9735022``, before it shared the finalizer's read-ahead and the storage's ``put_file``.

The job (tests/helpers/messy_job.py, ``rich``: microbatches in length order, ``finish_reason``,
several choices, logprobs, a BOM, bad and blank lines, a shard failed for good, one expired
mid-way, shards never started) is finalized and exported; ``output.jsonl``, ``errors.jsonl``,
``retry.jsonl`` and ``export.json`` must equal ``data/export_golden.json`` once the job ID, the
temporary path and the checksums over them are replaced by placeholders
(``ADB_REGEN_GOLDEN=1`` rewrites it). The same from sorted runs spilled to disk, and with the
outputs and the export on S3 (moto over HTTP), objects read ahead in parallel; and with every
object streamed in chunks instead of read whole.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.service.export import EXPORT_MANIFEST, export_job
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.storage import open_storage, read_ahead
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.messy_job import build_messy_job

pytestmark = pytest.mark.integration
GOLDEN = Path(__file__).parent / "data" / "export_golden.json"
FILES = ("output.jsonl", "errors.jsonl", "retry.jsonl")
CLOCK = ManualClock(dt.datetime(2029, 12, 31, 23, 0, tzinfo=dt.timezone.utc))


def _exported(store: ManifestStore, tmp_path: Path, output_uri: str | None, run_bytes: int) -> dict[str, str]:
    """Build, finalize and export the messy job; its files with placeholders for what varies."""
    out = f"{output_uri}/out" if output_uri else None
    job_id = build_messy_job(store, tmp_path, out, rich=True)
    finalize_job(store, job_id, clock=CLOCK, expire_unfinished=True)
    target = f"{output_uri}/export" if output_uri else str(tmp_path / "export")
    export_job(store, job_id, target, run_bytes=run_bytes, clock=CLOCK)
    storage = open_storage(target)
    meta = orjson.loads(storage.get_bytes(EXPORT_MANIFEST))
    meta["source"]["manifest_sha256"] = "MANIFEST_SHA"
    for name in FILES:
        meta["files"][name]["sha256"] = f"SHA:{name}"  # over the job ID: compared as text below
    texts = {name: storage.get_bytes(name).decode(errors="backslashreplace") for name in FILES}
    texts[EXPORT_MANIFEST] = json.dumps(meta, indent=1, sort_keys=True)
    base = output_uri or str(tmp_path)
    return {
        name: text.replace(job_id, "JOB").replace(base, "TMP").replace(str(tmp_path), "TMP")
        for name, text in texts.items()
    }


def _check(got: dict[str, str]) -> None:
    statuses = {
        o["response"]["status_code"] if o["response"] else o["error"]["code"]
        for o in map(json.loads, got["errors.jsonl"].splitlines())
    }
    assert {400, 500, "batch_expired"} <= statuses
    bodies = [json.loads(line)["response"]["body"] for line in got["output.jsonl"].splitlines()]
    assert {b["object"] for b in bodies} == {"chat.completion", "text_completion"}
    assert any(len(b["choices"]) == 2 for b in bodies)
    if os.environ.get("ADB_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name] == expected[name], f"{name} differs from the golden copy"


@pytest.mark.parametrize("whole_records", [20_000, 0], ids=["read-whole", "streamed"])
@pytest.mark.parametrize("run_bytes", [64 << 20, 1], ids=["in-memory", "spilled"])
def test_export_of_a_messy_job_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_bytes: int, whole_records: int
) -> None:
    # 0: every object is streamed in chunks rather than read whole (the path of large objects)
    monkeypatch.setattr(read_ahead, "WHOLE_OBJECT_RECORDS", whole_records)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        _check(_exported(store, tmp_path, None, run_bytes))
    finally:
        store.close()


@pytest.mark.parametrize("whole_records", [20_000, 0], ids=["read-whole", "streamed"])
def test_export_on_s3_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_base_uri: str, whole_records: int
) -> None:
    monkeypatch.setattr(read_ahead, "READ_AHEAD", 3)
    monkeypatch.setattr(read_ahead, "WHOLE_OBJECT_RECORDS", whole_records)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        got = _exported(store, tmp_path, s3_base_uri, 64 << 20)
        assert json.loads(got[EXPORT_MANIFEST])["files"]["output.jsonl"]["uri"] == "TMP/export/output.jsonl"
        _check(got)
    finally:
        store.close()
