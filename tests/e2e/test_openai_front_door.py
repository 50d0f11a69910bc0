"""The official ``openai`` SDK against the front door of a real Airflow deployment (docs/openai.md).

``airflow api-server`` (with the provider's plugin), ``scheduler`` (LocalExecutor), ``triggerer``
and ``dag-processor`` run with a PostgreSQL metadata database (tests/fixtures/airflow_deployment.py)
and a PostgreSQL manifest store; the batch DAG is the local example with the echo engine, slowed
down per record (``ADB_ECHO_DELAY_S``) so a cancel lands mid-run. The SDK authenticates with an
Airflow JWT as its API key; every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types import Batch

from airflow_deadline_batch.store import ManifestStore
from tests.fixtures.airflow_deployment import (
    AirflowDeployment,
    log_in,
    login_token,
    metadata_database,
    start_deployment,
    stop_deployment,
)
from tests.fixtures.postgres import PgServer, password_store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOCAL_DAG = REPO / "dags" / "example_deadline_batch_local.py"
DAG_ID = "example_deadline_batch_local"
#: seconds per record in the echo engine: the cancel test's batch runs for minutes, the small one for seconds
ECHO_DELAY_S = 0.1
BATCH_TIMEOUT_S = 300.0
TERMINAL = ("completed", "failed", "expired", "cancelled")
#: SimpleAuthManager users: the SDK logs in as ``admin``; ``viewer`` may read runs but not trigger them
PASSWORDS = {"admin": "admin-pw", "viewer": "viewer-pw"}


@dataclass(frozen=True)
class FrontDoor:
    airflow: AirflowDeployment
    files: Path

    @property
    def url(self) -> str:
        return f"{self.airflow.base_url}/deadline-batch/openai/v1"

    def client(self, user: str = "admin") -> OpenAI:
        token = login_token(self.airflow.base_url, user, PASSWORDS[user])
        return OpenAI(base_url=self.url, api_key=token, timeout=120.0, max_retries=0)


@pytest.fixture(scope="module")
def front_door(tmp_path_factory: pytest.TempPathFactory, pg_server: PgServer) -> Iterator[FrontDoor]:
    root = tmp_path_factory.mktemp("front-door")
    dags = root / "dags"
    dags.mkdir()
    (dags / LOCAL_DAG.name).symlink_to(LOCAL_DAG)
    files = root / "files"
    passwords = root / "passwords.json"
    passwords.write_text(json.dumps(PASSWORDS))
    with metadata_database(pg_server) as db_url, password_store(pg_server) as store_url:
        ManifestStore.open(store_url).close()  # the store's schema, as a deployment creates it once
        airflow = start_deployment(
            root / "airflow",
            db_url=db_url,
            dags_folder=dags,
            extra_env={
                "ADB_ENGINE": "echo",
                "ADB_ECHO_DELAY_S": str(ECHO_DELAY_S),
                "ADB_EXAMPLE_DIR": str(root / "example"),
                "ADB_EXAMPLE_PREEMPT_TRIES": "",
                # one store for the tasks and the api-server's plugin
                "ADB_STORE_URL": store_url,
                "ADB_FILES_URI": str(files),
                # real logins: an anonymous request must not be an admin
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            },
        )
        try:
            log_in(airflow, "admin", PASSWORDS["admin"])
            airflow.wait_for_dag(DAG_ID)
            airflow.api("PATCH", f"/dags/{DAG_ID}", {"is_paused": False})
            yield FrontDoor(airflow, files)
        finally:
            stop_deployment(airflow)


def requests_file(count: int, prefix: str) -> bytes:
    lines = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "echo",
                "messages": [{"role": "user", "content": f"review {i}"}],
                "max_tokens": 8,
            },
        }
        for i in range(count)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def wait_batch(door: FrontDoor, client: OpenAI, batch_id: str, condition: Any, what: str) -> Batch:
    def check() -> Batch | None:
        batch = client.batches.retrieve(batch_id)
        return batch if condition(batch) else None

    return door.airflow.wait(
        check, timeout_s=BATCH_TIMEOUT_S, what=f"batch {batch_id}: {what}", interval_s=1.0
    )


def jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_anonymous_requests_get_401(front_door: FrontDoor) -> None:
    for path in ("/batches", "/files/file-x"):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(front_door.url + path, timeout=30)
        assert caught.value.code == 401, path
        assert json.loads(caught.value.read())["error"]["type"] == "invalid_request_error", path
    request = urllib.request.Request(
        front_door.url + "/batches",
        data=b'{"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}',
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 401


def test_triggering_needs_airflow_permission(front_door: FrontDoor) -> None:
    """The caller's token reaches Airflow's REST API: a viewer may upload, not start a run."""
    import openai

    viewer = front_door.client("viewer")
    uploaded = viewer.files.create(file=("v.jsonl", requests_file(1, "v")), purpose="batch")
    with pytest.raises(openai.PermissionDeniedError, match="triggering example_deadline_batch_local"):
        viewer.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    # Airflow made no run: no batch is left behind (it was listed as validating for ever)
    assert uploaded.id not in {b.input_file_id for b in viewer.batches.list(limit=100).data}


def test_sdk_upload_batch_poll_download(front_door: FrontDoor) -> None:
    client = front_door.client()
    data = requests_file(6, "ok")
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data)
    assert uploaded.filename == "requests.jsonl"
    assert client.files.content(uploaded.id).content == data
    # the upload is in the files store, with its sidecar
    assert (front_door.files / "files" / uploaded.id / "content").read_bytes() == data
    assert json.loads((front_door.files / "files" / uploaded.id / "meta.json").read_bytes())["bytes"] == len(
        data
    )

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"deadline": "+2h"},
    )
    assert batch.status in ("validating", "in_progress")
    assert batch.input_file_id == uploaded.id
    # the batch is a run of the configured DAG
    run = front_door.airflow.api("GET", f"/dags/{DAG_ID}/dagRuns/{batch.id}")
    assert run["conf"]["input_uri"].endswith(f"files/{uploaded.id}/content")

    done = wait_batch(
        front_door, client, batch.id, lambda b: b.status in ("completed", "failed"), "completed"
    )
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 6, 0)
    assert done.output_file_id and done.error_file_id is None
    output = jsonl(client.files.content(done.output_file_id).content)
    assert [line["custom_id"] for line in output] == [f"ok-{i}" for i in range(6)]
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in output)
    assert client.files.retrieve(done.output_file_id).filename == "output.jsonl"
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]


@pytest.mark.parametrize("data", [b"", b"\n  \r\n"], ids=["empty", "blank-lines"])
def test_sdk_batch_of_an_input_without_records_completes(front_door: FrontDoor, data: bytes) -> None:
    """The plan returns no shard, the shard task is skipped and the sensor still publishes: the
    batch completes with no request and no file (it stayed in_progress while the sensor was skipped)."""
    client = front_door.client()
    uploaded = client.files.create(file=("empty.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(front_door, client, batch.id, lambda b: b.status in TERMINAL, "a terminal status")
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (0, 0, 0)
    assert (done.output_file_id, done.error_file_id, done.errors) == (None, None, None)
    assert front_door.airflow.wait_for_run(DAG_ID, batch.id, timeout_s=BATCH_TIMEOUT_S)["state"] == "success"


def test_sdk_cancel_mid_run_ends_cancelled_with_partial_output(front_door: FrontDoor) -> None:
    client = front_door.client()
    total = 400  # ~20 s of echo per shard even on idle cores: the cancel lands mid-run
    uploaded = client.files.create(file=("big.jsonl", requests_file(total, "c")), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    running = wait_batch(
        front_door,
        client,
        batch.id,
        lambda b: b.status != "validating" and b.request_counts and b.request_counts.completed > 0,
        "some requests done",
    )
    assert running.status == "in_progress", running

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_batch(front_door, client, batch.id, lambda b: b.status == "cancelled", "cancelled")
    assert done.request_counts is not None
    assert done.request_counts.total == total
    assert 0 < done.request_counts.completed < total
    assert done.output_file_id and done.error_file_id
    output = jsonl(client.files.content(done.output_file_id).content)
    errors = jsonl(client.files.content(done.error_file_id).content)
    assert len(output) == done.request_counts.completed
    assert len(output) + len(errors) == total
    assert {line["custom_id"] for line in output + errors} == {f"c-{i}" for i in range(total)}
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    # the DAG run ends on its own (its workers are fenced); the batch stays cancelled
    front_door.airflow.wait_for_run(DAG_ID, batch.id, timeout_s=BATCH_TIMEOUT_S)
    assert client.batches.retrieve(batch.id).status == "cancelled"
