"""The batches routes on a real files store (local files and the S3 API via moto).

``GET /batches`` pages come from the index of pointers, newest first, and read only the sidecars
they return; a real job (echo workers) that runs past its deadline reads ``expired``.

Sidecars are written by ``openai_batches.record_batch`` (what ``POST /batches`` writes before it
triggers the run); the routes run in a FastAPI app with Airflow's login answered by a fixed user,
Airflow's metadata database is a migrated SQLite file (no DAG runs: a batch without a job reads
``validating``), and the manifest store is a migrated SQLite file.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from airflow_deadline_batch.api import openai_batches
from airflow_deadline_batch.storage import open_storage
from airflow_deadline_batch.storage.base import ObjectStorage
from tests.helpers.openai_routes import StorageWrapper, batches_client
from tests.helpers.outcomes import read_manifest

BASE = 1_790_000_000  # created_at of the oldest batch (2026)
LIST_KEYS = {"object", "data", "first_id", "last_id", "has_more"}


class CountingStorage(StorageWrapper):
    """The real storage, counting the objects read (``get_bytes``, ``open_read``, ``read_range``),
    the prefixes listed and the keys the listings yielded."""

    def __init__(self, inner: ObjectStorage) -> None:
        super().__init__(inner)
        self.reads: list[str] = []
        self.listed: list[str] = []
        self.keys_listed = 0

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        self.listed.append(prefix)
        for key in self.inner.list_keys(prefix):
            self.keys_listed += 1
            yield key

    def get_bytes(self, key: str) -> bytes:
        self.reads.append(key)
        return self.inner.get_bytes(key)

    def open_read(self, key: str) -> Any:
        self.reads.append(key)
        return self.inner.open_read(key)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        self.reads.append(key)
        return self.inner.read_range(key, start, end)


@pytest.fixture(params=["local", "s3"])
def files(request: pytest.FixtureRequest, tmp_path: Path) -> CountingStorage:
    if request.param == "local":
        return CountingStorage(open_storage(str(tmp_path / "files")))
    bucket = request.getfixturevalue("s3_bucket")
    return CountingStorage(open_storage(f"s3://{bucket}/front-door"))


@pytest.fixture()
def client(
    files: CountingStorage, airflow_db: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    with batches_client(files, tmp_path, monkeypatch, role="viewer") as test_client:
        yield test_client


def sidecar(i: int, dag_id: str = "example_deadline_batch_local") -> dict[str, Any]:
    batch_id = f"batch_{i:04d}"
    return {
        "id": batch_id,
        "dag_id": dag_id,
        "run_id": batch_id,
        "plan_task_id": "plan",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-input",
        "completion_window": "24h",
        "metadata": {},
        "created_at": BASE + i,
        "expires_at": BASE + i + 86400,
        "conf": {},
    }


def create(files: CountingStorage, *numbers: int, dag_id: str = "example_deadline_batch_local") -> None:
    for i in numbers:
        openai_batches.record_batch(files.inner, sidecar(i, dag_id))


def ids(page: dict[str, Any]) -> list[str]:
    return [batch["id"] for batch in page["data"]]


def get_page(client: TestClient, **params: Any) -> dict[str, Any]:
    response = client.get("/openai/v1/batches", params=params)
    assert response.status_code == 200, response.text
    page = response.json()
    assert set(page) == LIST_KEYS and page["object"] == "list"
    assert page["first_id"] == (page["data"][0]["id"] if page["data"] else None)
    assert page["last_id"] == (page["data"][-1]["id"] if page["data"] else None)
    return page


def test_pages_newest_first_with_limit_after_and_has_more(client: TestClient, files: CountingStorage) -> None:
    create(files, 3, 0, 6, 1, 5, 2, 4)  # written out of order: the index sorts them

    first = get_page(client, limit=3)
    assert ids(first) == ["batch_0006", "batch_0005", "batch_0004"]
    assert first["has_more"] is True
    assert {b["object"] for b in first["data"]} == {"batch"}
    assert {b["status"] for b in first["data"]} == {"validating"}  # no run, no job yet
    assert first["data"][0]["created_at"] == BASE + 6

    second = get_page(client, limit=3, after=first["last_id"])
    assert ids(second) == ["batch_0003", "batch_0002", "batch_0001"]
    assert second["has_more"] is True
    last = get_page(client, limit=3, after=second["last_id"])
    assert ids(last) == ["batch_0000"]
    assert last["has_more"] is False

    assert ids(get_page(client)) == [f"batch_{i:04d}" for i in range(6, -1, -1)]  # default limit 20
    assert get_page(client, after="batch_9999")["data"] == []  # not a batch: nothing after it


def test_only_batches_of_readable_dags_are_listed(client: TestClient, files: CountingStorage) -> None:
    create(files, 0, 2, 4)
    create(files, 1, 3, 5, dag_id="secret_dag")  # alice may not read this DAG's runs

    page = get_page(client, limit=2)
    assert ids(page) == ["batch_0004", "batch_0002"]
    assert page["has_more"] is True
    rest = get_page(client, limit=2, after="batch_0002")
    assert ids(rest) == ["batch_0000"]
    assert rest["has_more"] is False


def test_sidecars_without_pointers_are_listed_then_indexed_once(
    client: TestClient, files: CountingStorage
) -> None:
    create(files, 0, 2, 4)
    # written before the index existed (record_batch writes the pointer first)
    for i in (1, 3, 5):
        openai_batches._write_json(files.inner, f"batches/batch_{i:04d}.json", sidecar(i))

    page = get_page(client, limit=4)
    assert ids(page) == ["batch_0005", "batch_0004", "batch_0003", "batch_0002"]
    assert page["has_more"] is True
    pointers = list(files.inner.list_keys(openai_batches.INDEX))
    assert pointers == sorted(openai_batches.index_key(f"batch_{i:04d}", BASE + i) for i in range(6))
    assert all(files.inner.get_bytes(key) == b"" for key in pointers)

    files.reads.clear()
    again = get_page(client, limit=4, after="batch_0002")
    assert ids(again) == ["batch_0001", "batch_0000"]
    # repaired once: now only the page's sidecars are read
    assert sorted(files.reads) == ["batches/batch_0000.json", "batches/batch_0001.json"]


def test_a_page_of_20_out_of_500_reads_only_its_sidecars(client: TestClient, files: CountingStorage) -> None:
    create(files, *range(500))

    files.reads.clear()
    page = get_page(client)
    assert ids(page) == [f"batch_{i:04d}" for i in range(499, 479, -1)]
    assert page["has_more"] is True
    # the 20 shown and the one that says has_more (before the index: all 500)
    assert len(files.reads) <= 25, files.reads
    assert set(files.reads) == {f"batches/batch_{i:04d}.json" for i in range(499, 478, -1)}

    files.reads.clear()
    files.listed.clear()
    files.keys_listed = 0
    middle = get_page(client, after="batch_0250", limit=5)
    assert ids(middle) == [f"batch_{i:04d}" for i in range(249, 244, -1)]
    assert len(files.reads) == 6
    # the first listing of a files store looked for sidecars without pointers (and marked it done);
    # later ones list the index alone, only as far as their page and the one key after it
    assert files.listed == [openai_batches.INDEX] and files.keys_listed == 250 + 6
    assert files.inner.exists(openai_batches.INDEXED)
    files.listed.clear()
    files.keys_listed = 0
    get_page(client)
    assert files.listed == [openai_batches.INDEX] and files.keys_listed == 21


def test_a_pointer_whose_sidecar_never_came_is_skipped(client: TestClient, files: CountingStorage) -> None:
    create(files, 0, 2)
    files.inner.put_bytes(openai_batches.index_key("batch_0001", BASE + 1), b"")  # its process died
    page = get_page(client)
    assert ids(page) == ["batch_0002", "batch_0000"] and page["has_more"] is False


@pytest.mark.parametrize("files", ["local"], indirect=True)
def test_a_job_past_its_deadline_reads_expired_with_its_counts_and_error_file(
    client: TestClient, files: CountingStorage, tmp_path: Path
) -> None:
    from airflow_deadline_batch.core.pools import default_local_pools
    from airflow_deadline_batch.local.runner import RunOptions, run_job
    from airflow_deadline_batch.service.planning import PlanRequest
    from airflow_deadline_batch.store import ManifestStore

    batch = sidecar(0)
    openai_batches.record_batch(files.inner, batch)
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo-v1", "messages": [{"role": "user", "content": f"say {i}"}]},
        }
        for i in range(16)
    ]
    files.inner.put_bytes("files/file-input/content", b"".join(orjson.dumps(line) + b"\n" for line in lines))
    # 16 records at 0.5 s each on one worker cannot finish in 4 s: the rest expires at the deadline
    request = PlanRequest(
        input_uri=files.inner.uri("files/file-input/content"),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=4),
        output_uri=files.inner.uri(f"runs/{batch['id']}/output"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=1,
        microbatch_size=2,
        idempotency_key=f"{batch['dag_id']}/{batch['run_id']}/{batch['plan_task_id']}",
        allow_infeasible=True,
    )
    options = RunOptions(
        workers=1, worker_env={"ADB_ECHO_DELAY_S": "0.5"}, worker_log=str(tmp_path / "w.log")
    )
    store = ManifestStore.open(os.environ["ADB_STORE_URL"])
    try:
        summary = run_job(store, request, options)
    finally:
        store.close()
    assert summary.state == "partial", summary
    outcomes = read_manifest(summary.manifest)["outcomes"]
    assert outcomes.get("expired", 0) > 0, outcomes

    got = client.get(f"/openai/v1/batches/{batch['id']}").json()
    assert got["status"] == "expired", got
    assert got["job_id"] == summary.job_id
    succeeded = outcomes.get("succeeded", 0)
    assert got["request_counts"] == {"total": 16, "completed": succeeded, "failed": 16 - succeeded}
    assert got["expired_at"] is not None and got["expired_at"] == got["completed_at"]
    assert got["failed_at"] is None and got["errors"] is None
    assert ids(get_page(client)) == [batch["id"]]
    assert get_page(client)["data"][0]["status"] == "expired"

    assert got["error_file_id"] == f"file-{batch['id'].removeprefix('batch_')}-errors"
    errors = client.get(f"/openai/v1/files/{got['error_file_id']}/content")
    assert errors.status_code == 200, errors.text
    expired = [orjson.loads(line) for line in errors.content.splitlines()]
    assert len(expired) == 16 - succeeded
    assert {line["error"]["code"] for line in expired} == {"batch_expired"}
    assert {line["response"] for line in expired} == {None}
    assert {line["custom_id"] for line in expired} <= {f"r{i}" for i in range(16)}
    if succeeded:
        assert got["output_file_id"] is not None
        output = client.get(f"/openai/v1/files/{got['output_file_id']}/content")
        assert len(output.content.splitlines()) == succeeded
