"""Batch sidecars under concurrent writers, on local files and the S3 API via moto (docs/openai.md).

Every change to ``batches/<id>.json`` (the cancel request, the export record, the job found for a
failed run) is a compare-and-swap (``openai_batches.update_sidecar``): here real processes change
one sidecar at once, and a cancel whose write is held at the storage until an export has been
recorded meanwhile must not erase that record (a plain read-modify-write did: the batch was
exported again). The routes run in a FastAPI app with Airflow's login answered by a fixed user;
the manifest store and Airflow's metadata database are migrated SQLite files.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient

from airflow_deadline_batch.api import openai_batches
from airflow_deadline_batch.exceptions import ObjectChanged
from airflow_deadline_batch.storage import open_storage
from airflow_deadline_batch.storage.base import ObjectStorage, put_if_version, read_versioned
from tests.helpers.openai_routes import StorageWrapper, batches_client

REPO = Path(__file__).resolve().parents[2]


class HeldCancelStorage(StorageWrapper):
    """The real storage, except that the first write of a sidecar carrying a cancel request waits
    (``arrived`` set) until ``release`` is set: the cancel has read the sidecar, and the test
    decides what happens before its write lands."""

    def __init__(self, inner: ObjectStorage) -> None:
        super().__init__(inner)
        self.arrived = threading.Event()
        self.release = threading.Event()

    def _hold(self, key: str, data: bytes) -> None:
        if key.startswith("batches/") and b"cancel_requested_at" in data and not self.arrived.is_set():
            self.arrived.set()
            assert self.release.wait(timeout=120), "the test never released the held cancel"

    def put_bytes(self, key: str, data: bytes) -> str:
        self._hold(key, data)
        return self.inner.put_bytes(key, data)

    def put_bytes_if(self, key: str, data: bytes, version: str | None) -> str:
        self._hold(key, data)
        return str(self.inner.put_bytes_if(key, data, version))  # type: ignore[attr-defined]


@pytest.fixture(params=["local", "s3"])
def files_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "files")
    return f"s3://{request.getfixturevalue('s3_bucket')}/front-door"


@pytest.fixture()
def files(files_uri: str) -> HeldCancelStorage:
    return HeldCancelStorage(open_storage(files_uri))


@pytest.fixture()
def client(
    files: HeldCancelStorage, airflow_db: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    with batches_client(files, tmp_path, monkeypatch, role="admin") as test_client:
        yield test_client


def new_batch(storage: ObjectStorage, lines: int) -> dict[str, Any]:
    """A batch as ``POST /batches`` records it, with its input file (no DAG run: ``validating``)."""
    batch_id = f"batch_{os.urandom(8).hex()}"
    now = int(dt.datetime.now(dt.timezone.utc).timestamp())
    batch = {
        "id": batch_id,
        "dag_id": "example_deadline_batch_local",
        "run_id": batch_id,
        "plan_task_id": "plan",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-input",
        "completion_window": "24h",
        "metadata": {},
        "created_at": now,
        "expires_at": now + 86400,
        "conf": {},
    }
    openai_batches.record_batch(storage, batch)
    records = (
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": f"say {i}"}]},
        }
        for i in range(lines)
    )
    storage.put_bytes("files/file-input/content", b"".join(orjson.dumps(r) + b"\n" for r in records))
    return batch


def run_to_publication(storage: ObjectStorage, batch: dict[str, Any], tmp_path: Path) -> str:
    """Plan and run the batch's job as its DAG would (the local runner, echo workers); its id."""
    from airflow_deadline_batch.core.pools import default_local_pools
    from airflow_deadline_batch.local.runner import RunOptions, run_job
    from airflow_deadline_batch.service.planning import PlanRequest
    from airflow_deadline_batch.store import ManifestStore

    request = PlanRequest(
        input_uri=storage.uri("files/file-input/content"),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=storage.uri(f"runs/{batch['id']}/output"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=1,
        idempotency_key=f"{batch['dag_id']}/{batch['run_id']}/{batch['plan_task_id']}",
    )
    store = ManifestStore.open(os.environ["ADB_STORE_URL"])
    try:
        summary = run_job(store, request, RunOptions(workers=1, worker_log=str(tmp_path / "w.log")))
    finally:
        store.close()
    assert summary.state == "completed", summary
    return str(summary.job_id)


def test_a_cancel_held_while_the_batch_is_exported_keeps_the_export_record(
    client: TestClient, files: HeldCancelStorage, tmp_path: Path
) -> None:
    batch = new_batch(files.inner, 3)
    answers: list[Any] = []
    # the cancel sees no job yet (validating), reads the sidecar, and is held before its write
    canceller = threading.Thread(
        target=lambda: answers.append(client.post(f"/openai/v1/batches/{batch['id']}/cancel")), daemon=True
    )
    canceller.start()
    assert files.arrived.wait(timeout=60), "the cancel never reached its sidecar write"
    try:
        # meanwhile the job runs and is published, and another request exports it
        job_id = run_to_publication(files.inner, batch, tmp_path)
        read = client.get(f"/openai/v1/batches/{batch['id']}").json()
        assert (read["status"], read["job_id"]) == ("completed", job_id), read
        export_manifest = f"runs/{batch['id']}/export/export.json"
        exported_version = files.inner.version(export_manifest)
    finally:
        files.release.set()
    canceller.join(timeout=120)
    assert not canceller.is_alive() and len(answers) == 1
    answer = answers[0]
    assert answer.status_code == 200, answer.text
    # the export record was never erased, so the batch was not exported a second time (before: the
    # cancel's write of the sidecar it had read dropped the record, and its own read exported again)
    assert files.inner.version(export_manifest) == exported_version
    sidecar = orjson.loads(files.inner.get_bytes(f"batches/{batch['id']}.json"))
    assert sidecar["exported"]["at"] == read["completed_at"]
    assert sidecar["exported"]["outcomes"]["succeeded"] == 3
    # the cancel lost to the publication: the batch keeps its outcome, nothing cancelled
    assert "cancel_requested_at" not in sidecar
    assert (answer.json()["status"], answer.json()["cancelling_at"]) == ("completed", None), answer.json()
    assert client.get(f"/openai/v1/batches/{batch['id']}").json()["output_file_id"] == read["output_file_id"]


UPDATER = textwrap.dedent(
    """
    import os, sys, time
    from airflow_deadline_batch.api.openai_batches import update_sidecar
    from airflow_deadline_batch.storage import open_storage

    name, count, go, *targets = sys.argv[1:]
    sidecars = [(open_storage(uri), batch_id) for uri, batch_id in zip(targets[::2], targets[1::2])]
    deadline = time.monotonic() + 120
    while not os.path.exists(go):  # every process starts changing the sidecars at once
        assert time.monotonic() < deadline, "never told to go"
        time.sleep(0.01)
    for i in range(int(count)):
        mark = f"{name}-{i}"
        for storage, batch_id in sidecars:
            update_sidecar(storage, batch_id, lambda now: {**now, "marks": [*now.get("marks", []), mark]})
    """
)


def test_concurrent_processes_changing_one_sidecar_lose_no_change(s3_bucket: str, tmp_path: Path) -> None:
    # one sidecar on local files and one on S3, each changed by every process in turn (one
    # process per writer, not per storage: each start imports Airflow)
    stores = [open_storage(str(tmp_path / "files")), open_storage(f"s3://{s3_bucket}/front-door")]
    batches = [new_batch(storage, 0) for storage in stores]
    targets = [
        arg for storage, batch in zip(stores, batches, strict=True) for arg in (storage.base_uri, batch["id"])
    ]
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    names, count = ["p0", "p1", "p2"], 6
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", UPDATER, name, str(count), str(go), *targets],
            env=env,
            stderr=subprocess.PIPE,
        )
        for name in names
    ]
    go.touch()
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()[-2000:]
    for storage, batch in zip(stores, batches, strict=True):
        sidecar = orjson.loads(storage.get_bytes(f"batches/{batch['id']}.json"))
        # each process's changes in its order, none dropped by another's write
        assert sorted(sidecar["marks"]) == sorted(f"{name}-{i}" for name in names for i in range(count))
        for name in names:
            mine = [mark for mark in sidecar["marks"] if mark.startswith(f"{name}-")]
            assert mine == [f"{name}-{i}" for i in range(count)], storage
        assert sidecar["id"] == batch["id"]  # the rest of the sidecar kept


def test_a_conditional_write_loses_to_a_write_since_its_read(files_uri: str) -> None:
    storage = open_storage(files_uri)
    put_if_version(storage, "batches/x.json", b"one", None)
    with pytest.raises(ObjectChanged, match="x.json"):
        put_if_version(storage, "batches/x.json", b"again", None)  # only if there is none
    data, version = read_versioned(storage, "batches/x.json")
    assert data == b"one"
    put_if_version(storage, "batches/x.json", b"two", version)
    with pytest.raises(ObjectChanged, match="x.json"):
        put_if_version(storage, "batches/x.json", b"stale", version)
    assert storage.get_bytes("batches/x.json") == b"two"
    storage.delete("batches/x.json")
    with pytest.raises(ObjectChanged, match="x.json"):
        put_if_version(storage, "batches/x.json", b"resurrected", version)
    assert not storage.exists("batches/x.json")
    assert list(storage.list_keys("batches/")) == []  # no lock or staging file left to be listed


def test_a_sidecar_change_gives_up_after_bounded_tries_with_a_clear_error(files_uri: str) -> None:
    from fastapi import HTTPException

    storage = open_storage(files_uri)
    batch = new_batch(storage, 0)
    key = f"batches/{batch['id']}.json"
    tries = 0

    def change_raced_every_time(now: dict[str, Any]) -> dict[str, Any]:
        nonlocal tries
        tries += 1
        storage.put_bytes(key, orjson.dumps({**now, "other": tries}))  # another writer, every time
        return {**now, "mine": True}

    with pytest.raises(HTTPException) as gave_up:
        openai_batches.update_sidecar(storage, batch["id"], change_raced_every_time)
    assert gave_up.value.status_code == 503
    assert f"{openai_batches.SIDECAR_TRIES} times in a row" in str(gave_up.value.detail)
    assert "retry the request" in str(gave_up.value.detail)
    assert tries == openai_batches.SIDECAR_TRIES
    assert "mine" not in orjson.loads(storage.get_bytes(key))
    assert openai_batches.update_sidecar(storage, "batch_gone", lambda now: {**now, "x": 1}) is None


def test_a_cancel_held_while_its_batch_is_forgotten_does_not_bring_it_back(
    client: TestClient, files: HeldCancelStorage
) -> None:
    batch = new_batch(files.inner, 1)
    answers: list[Any] = []
    canceller = threading.Thread(
        target=lambda: answers.append(client.post(f"/openai/v1/batches/{batch['id']}/cancel")), daemon=True
    )
    canceller.start()
    assert files.arrived.wait(timeout=60), "the cancel never reached its sidecar write"
    # meanwhile POST /batches saw its trigger fail and removes the batch
    openai_batches.forget_batch(files.inner, batch)
    files.release.set()
    canceller.join(timeout=120)
    assert not canceller.is_alive() and len(answers) == 1
    # before: the cancel wrote the sidecar it had read back, a batch without a run, for ever validating
    assert not files.inner.exists(f"batches/{batch['id']}.json")
    assert answers[0].status_code == 404, answers[0].text
    assert answers[0].json()["error"]["message"] == f"no such batch: {batch['id']}"
    assert client.get(f"/openai/v1/batches/{batch['id']}").status_code == 404
