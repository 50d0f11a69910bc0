"""The OpenAI front door against a hostile client: the official SDK over real HTTP (docs/openai.md).

The provider's routes are served by uvicorn on loopback in this process; Airflow's login is answered
by a fixed user (``alice``, who may not read ``secret_dag``), the files store is a local folder, the
manifest store and Airflow's metadata database are migrated SQLite files. Airflow's REST API,
which ``POST /batches`` calls to trigger the run, is stood in for by a route on the same server
that records what it was sent (the run itself is not started: jobs are run by the local runner).
"""

from __future__ import annotations

import datetime as dt
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import uvicorn
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai import OpenAI

from airflow_deadline_batch.api import openai_batches
from airflow_deadline_batch.plugins import progress
from tests.helpers.waiting import wait_for


@dataclass
class FrontDoor:
    url: str
    files: Path
    server: uvicorn.Server
    triggered: list[dict[str, Any]] = field(default_factory=list)
    #: the status Airflow's REST API answers a trigger with (2xx: the run is created)
    trigger_status: int = 200

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/openai/v1", api_key="token", timeout=60.0, max_retries=0)


@pytest.fixture()
def door(airflow_db: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FrontDoor]:
    from airflow.api_fastapi import app as airflow_app

    from airflow_deadline_batch.store import ManifestStore

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    ManifestStore.open(store_url, migrate=True).close()
    monkeypatch.setenv("ADB_STORE_URL", store_url)
    monkeypatch.delenv("ADB_STORE_CONN_ID", raising=False)
    progress.reset_store()
    files = tmp_path / "files"
    monkeypatch.setenv("ADB_FILES_URI", str(files))
    openai_batches._open_files.cache_clear()
    monkeypatch.setenv("AIRFLOW__CORE__AUTH_MANAGER", "tests.fixtures.ui_auth_manager.DagDenyingAuthManager")
    monkeypatch.setenv("ADB_TEST_DENIED_DAGS", "alice:secret_dag")
    monkeypatch.setattr(airflow_app._AuthManagerState, "instance", None)
    airflow_app.create_auth_manager()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("ADB_AIRFLOW_API_URL", url)
    server = uvicorn.Server(uvicorn.Config(app := FastAPI(), log_level="warning", lifespan="off"))
    front = FrontDoor(url, files, server)

    app.include_router(openai_batches.create_router(), prefix="/openai/v1")
    app.dependency_overrides[get_user] = lambda: SimpleAuthManagerUser(username="alice", role="admin")

    @app.post("/api/v2/dags/{dag_id}/dagRuns")
    async def trigger(dag_id: str, request: Request) -> JSONResponse:  # Airflow's REST API
        body = await request.json()
        if front.trigger_status >= 300:
            return JSONResponse({"detail": "Forbidden"}, status_code=front.trigger_status)
        front.triggered.append({"dag_id": dag_id, **body})
        set_run_state(dag_id, body["dag_run_id"], "queued")
        return JSONResponse({"dag_id": dag_id, "dag_run_id": body["dag_run_id"]})

    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=30, what="uvicorn to start")
    try:
        yield front
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        openai_batches._open_files.cache_clear()
        progress.reset_store()


def requests_file(count: int, prefix: str = "r") -> bytes:
    lines = [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": f"say {i}"}]},
        }
        for i in range(count)
    ]
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def set_run_state(dag_id: str, run_id: str, state: str) -> None:
    """Create the DAG run in Airflow's metadata database, or set its state."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState

    with create_session() as session:
        run = session.query(DagRun).filter_by(dag_id=dag_id, run_id=run_id).one_or_none()
        if run is None:
            session.add(DagRun(dag_id=dag_id, run_id=run_id, state=DagRunState(state), run_type="manual"))
        else:
            run.state = DagRunState(state)


def run_batch(door: FrontDoor, batch_id: str, tmp_path: Path, **plan: Any) -> Any:
    """Run the batch's job as its DAG's plan task would (the local runner, echo workers)."""
    import datetime as dt
    import os

    from airflow_deadline_batch.core.pools import default_local_pools
    from airflow_deadline_batch.local.runner import RunOptions, run_job
    from airflow_deadline_batch.service.planning import PlanRequest
    from airflow_deadline_batch.store import ManifestStore

    conf = next(t["conf"] for t in door.triggered if t["dag_run_id"] == batch_id)
    request = PlanRequest(
        input_uri=conf["input_uri"],
        deadline=dt.datetime.fromisoformat(conf["deadline"]),
        output_uri=conf["output_uri"],
        engine="echo",
        pools=default_local_pools("echo"),
        workers=1,
        idempotency_key=f"example_deadline_batch_local/{batch_id}/plan",
        **plan,
    )
    store = ManifestStore.open(os.environ["ADB_STORE_URL"])
    try:
        return run_job(store, request, RunOptions(workers=1, worker_log=str(tmp_path / "w.log")))
    finally:
        store.close()


def create_batch(client: OpenAI, data: bytes, **kwargs: Any) -> Any:
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", **kwargs
    )


def openai_error(response: Any) -> dict[str, Any]:
    """The OpenAI error body of a raw response, checked for OpenAI's shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_every_error_reaches_the_sdk_as_openais_error_with_its_message(door: FrontDoor) -> None:
    client = door.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")  # type: ignore[arg-type]
    # the SDK puts the body's message in the exception's text (before: "Error code: 400" alone)
    assert "purpose must be 'batch', got 'fine-tune'" in str(refused.value)
    assert (refused.value.type, refused.value.param) == ("invalid_request_error", "purpose")
    with pytest.raises(openai.NotFoundError, match="no such file: file-nope"):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError, match="no such batch: batch_nope"):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of") as endpoint:
        client.batches.create(input_file_id="file-x", endpoint="/v1/embeddings", completion_window="24h")
    assert endpoint.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError, match="input_file_id is required") as missing:
        client.batches.create(input_file_id="", endpoint="/v1/chat/completions", completion_window="24h")
    assert missing.value.param == "input_file_id"
    # what FastAPI validates is a 400 (OpenAI's status), not a 422 of FastAPI's shape
    with pytest.raises(openai.BadRequestError, match="limit") as limit:
        client.batches.list(limit="ten")  # type: ignore[arg-type]
    assert limit.value.param == "limit"
    no_file = httpx.post(f"{door.url}/openai/v1/files", data={"purpose": "batch"})
    assert no_file.status_code == 400 and openai_error(no_file)["param"] == "file"
    not_json = httpx.post(
        f"{door.url}/openai/v1/batches", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert not_json.status_code == 400
    assert "JSON" in openai_error(not_json)["message"]
    torn = httpx.post(
        f"{door.url}/openai/v1/files",
        content=b"--b\r\nContent-Disposition: form-data; name=purpose\r\n\r\nbatch\r\n--b--\r\n",
        headers={"content-type": "multipart/form-data"},  # no boundary
    )
    assert torn.status_code == 400, torn.text  # before: a 500 "the front door failed"
    assert openai_error(torn)["message"] == "Missing boundary in multipart."
    a_list = httpx.post(f"{door.url}/openai/v1/batches", json=["input_file_id"])
    assert a_list.status_code == 400 and "dictionary" in openai_error(a_list)["message"]


@pytest.mark.parametrize(
    ("window", "metadata", "param"),
    [
        ("99999999999h", None, "completion_window"),
        ("24h", {"deadline": "+99999999999h"}, "metadata.deadline"),
        ("24h", {"deadline": "+999999999d"}, "metadata.deadline"),
    ],
)
def test_a_deadline_past_what_a_datetime_holds_is_a_400(
    door: FrontDoor, window: str, metadata: dict[str, str] | None, param: str
) -> None:
    client = door.client()
    uploaded = client.files.create(file=("in.jsonl", requests_file(1)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="past the year 9999") as refused:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window=window,  # type: ignore[arg-type]
            metadata=metadata,
        )
    assert refused.value.param == param
    assert client.batches.list().data == [] and door.triggered == []
    # the connection is still usable: an unhandled error used to reset the SDK's kept-alive one
    assert client.files.retrieve(uploaded.id).id == uploaded.id


def test_a_deadline_that_has_passed_is_a_400(door: FrontDoor) -> None:
    client = door.client()
    uploaded = client.files.create(file=("in.jsonl", requests_file(1)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="'2000-01-01T00:00:00Z' has passed") as refused:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"deadline": "2000-01-01T00:00:00Z"},
        )
    assert refused.value.param == "metadata.deadline"
    assert door.triggered == [] and client.batches.list().data == []


@pytest.mark.parametrize(
    ("metadata", "message", "param"),
    [
        ({str(i): "v" for i in range(17)}, "17 pairs: at most 16", "metadata"),
        ({"k" * 65: "v"}, "longer than 64 characters", "metadata"),
        ({"note": "v" * 513}, "513 characters long: at most 512", "metadata.note"),
        ({"team": {"name": "ads"}}, "metadata.team must be a string, got dict", "metadata.team"),
        ({"priority": 3}, "metadata.priority must be a string, got int", "metadata.priority"),
        (["deadline", "+2h"], "metadata must be an object", "metadata"),
    ],
)
def test_metadata_is_held_to_openais_limits(door: FrontDoor, metadata: Any, message: str, param: str) -> None:
    client = door.client()
    uploaded = client.files.create(file=("in.jsonl", requests_file(1)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata=metadata,
        )
    assert refused.value.param == param
    assert door.triggered == []
    at_the_limits = {f"k{i:02d}" + "k" * 61: "v" * 512 for i in range(16)}
    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=at_the_limits,
    )
    assert client.batches.retrieve(created.id).metadata == at_the_limits


def test_a_run_airflow_refuses_leaves_no_batch(door: FrontDoor) -> None:
    client = door.client()
    uploaded = client.files.create(file=("in.jsonl", requests_file(1)), purpose="batch")
    door.trigger_status = 403  # the caller may not trigger the DAG
    with pytest.raises(
        openai.PermissionDeniedError, match="triggering example_deadline_batch_local: Forbidden"
    ):
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    # before: its sidecar stayed, listed as validating for ever
    assert client.batches.list().data == []
    assert not list((door.files / "batches").glob("*.json"))
    door.trigger_status = 200
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert [b.id for b in client.batches.list().data] == [created.id]


def test_cancel_twice_and_cancel_after_the_end_keep_the_status(door: FrontDoor, tmp_path: Path) -> None:
    client = door.client()
    # before the run starts (no job yet): cancelling, and a second cancel changes nothing
    queued = create_batch(client, requests_file(2))
    first = client.batches.cancel(queued.id)
    assert first.status == "cancelling" and first.cancelling_at is not None
    second = client.batches.cancel(queued.id)
    assert (second.status, second.cancelling_at) == ("cancelling", first.cancelling_at)
    set_run_state("example_deadline_batch_local", queued.id, "success")  # it ended without a job
    assert client.batches.retrieve(queued.id).status == "cancelled"

    # a run that failed before planning: a cancel afterwards leaves it failed (before: cancelled)
    failed = create_batch(client, requests_file(2))
    set_run_state("example_deadline_batch_local", failed.id, "failed")
    assert client.batches.retrieve(failed.id).status == "failed"
    after = client.batches.cancel(failed.id)
    assert (after.status, after.cancelling_at, after.cancelled_at) == ("failed", None, None)
    assert client.batches.retrieve(failed.id).status == "failed"

    # a completed batch stays completed, with no cancelling_at
    done = create_batch(client, requests_file(3))
    run_batch(door, done.id, tmp_path)
    completed = client.batches.cancel(done.id)
    assert (completed.status, completed.cancelling_at) == ("completed", None)
    assert completed.request_counts is not None and completed.request_counts.completed == 3
    assert completed.output_file_id is not None


def test_a_batch_rejected_at_admission_says_why(door: FrontDoor, tmp_path: Path) -> None:
    from airflow_deadline_batch.exceptions import AdmissionRejected

    client = door.client()
    batch = create_batch(client, bytes(range(256)) * 4 + b"\n" + requests_file(1))  # half the lines junk
    with pytest.raises(AdmissionRejected):
        run_batch(door, batch.id, tmp_path)  # the plan task fails, and with it the run
    set_run_state("example_deadline_batch_local", batch.id, "failed")
    got = client.batches.retrieve(batch.id)
    assert got.status == "failed" and got.job_id is not None
    assert got.errors is not None and got.errors.data
    # the admission's reason (before: "DAG run <id> ended failed")
    assert "5 of 6 lines are invalid" in (got.errors.data[0].message or ""), got.errors
    assert client.batches.list().data[0].job_id == got.job_id  # recorded: found again without a scan
    sidecar = orjson.loads((door.files / "batches" / f"{batch.id}.json").read_bytes())
    assert sidecar["job_id"] == got.job_id


def test_empty_blank_and_all_failed_inputs_complete_with_their_counts(
    door: FrontDoor, tmp_path: Path
) -> None:
    client = door.client()
    for data in (b"", b"\n\r\n  \n"):
        batch = create_batch(client, data)
        assert run_batch(door, batch.id, tmp_path).state == "completed"
        got = client.batches.retrieve(batch.id)
        assert got.status == "completed" and got.completed_at is not None
        assert got.request_counts is not None
        assert (got.request_counts.total, got.request_counts.completed, got.request_counts.failed) == (
            0,
            0,
            0,
        )
        assert (got.output_file_id, got.error_file_id) == (None, None)  # no line, no file

    # binary junk, a BOM, CRLF, a duplicate custom_id: every line fails, none is lost
    good = requests_file(1, "dup").rstrip(b"\n")
    data = (
        b"\xef\xbb\xbf"
        + bytes(range(1, 256)).replace(b"\n", b"")
        + b"\r\n[]\r\n{}\r\n"
        + good
        + b"\r\n"
        + good
    )
    batch = create_batch(client, data)
    run_batch(door, batch.id, tmp_path, max_invalid_fraction=1.0)
    got = client.batches.retrieve(batch.id)
    assert got.status == "completed"
    assert got.request_counts is not None
    assert (got.request_counts.total, got.request_counts.completed, got.request_counts.failed) == (5, 1, 4)
    assert got.output_file_id and got.error_file_id
    errors = [orjson.loads(line) for line in client.files.content(got.error_file_id).content.splitlines()]
    assert [e["response"]["body"]["error"]["code"] for e in errors] == [
        "invalid_encoding",
        "invalid_record",
        "missing_id",
        "duplicate_id",
    ]
    output = [orjson.loads(line) for line in client.files.content(got.output_file_id).content.splitlines()]
    assert [line["custom_id"] for line in output] == ["dup-0"]


@pytest.mark.parametrize(
    ("sent", "shown"),
    [
        ("../../etc/in.jsonl", "in.jsonl"),
        ("..\\..\\in.jsonl", "in.jsonl"),
        ("../", "input.jsonl"),
        ("..", "input.jsonl"),
    ],
)
def test_an_uploads_name_is_its_last_segment_or_a_default(door: FrontDoor, sent: str, shown: str) -> None:
    client = door.client()
    uploaded = client.files.create(file=(sent, b"{}\n"), purpose="batch")
    assert uploaded.filename == shown  # before: "" for "../" and ".." for ".."
    assert client.files.retrieve(uploaded.id).filename == shown
    assert sorted(p.name for p in (door.files / "files" / uploaded.id).iterdir()) == ["content", "meta.json"]


def test_an_upload_cut_off_mid_stream_leaves_nothing(door: FrontDoor) -> None:
    boundary = "hostileboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="cut.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    port = int(door.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(
            b"POST /openai/v1/files HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Type: multipart/form-data; boundary={boundary}\r\n".encode()
            + f"Content-Length: {len(head) + 4 * 1024 * 1024}\r\n\r\n".encode()
            + head
            + requests_file(2000)[: 1024 * 1024]  # a quarter of what it announced
        )
    # the server has seen the client go and finished with its request
    state = door.server.server_state
    wait_for(lambda: not state.connections and not state.tasks, timeout_s=30, what="the cut request to end")
    assert not (door.files / "files").exists() or not any((door.files / "files").iterdir())
    # the next upload is whole
    whole = door.client().files.create(file=("whole.jsonl", requests_file(3)), purpose="batch")
    assert [p.name for p in (door.files / "files").iterdir()] == [whole.id]


def test_a_50_mb_line_round_trips_byte_for_byte(door: FrontDoor) -> None:
    client = door.client()
    line = (
        b'{"custom_id": "big", "body": {"messages": [{"role": "user", "content": "'
        + b"x" * (50 << 20)
        + b'"}]}}'
    )
    uploaded = client.files.create(file=("big.jsonl", line), purpose="batch")
    assert uploaded.bytes == len(line)
    assert client.files.content(uploaded.id).content == line


def test_concurrent_creates_pagination_edges_and_files_not_yours(door: FrontDoor, tmp_path: Path) -> None:
    import concurrent.futures

    client = door.client()
    uploaded = client.files.create(file=("in.jsonl", requests_file(2)), purpose="batch")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        created = list(
            pool.map(
                lambda _: client.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                ),
                range(4),
            )
        )
    ids = {b.id for b in created}
    assert len(ids) == 4 and {t["dag_run_id"] for t in door.triggered} == ids
    assert {t["conf"]["input_uri"] for t in door.triggered} == {
        str(door.files / "files" / uploaded.id / "content")
    }
    listed = [b.id for b in client.batches.list(limit=100).data]
    assert sorted(listed) == sorted(ids)
    for limit in (0, -1):  # below 1: one batch a page
        page = client.batches.list(limit=limit)
        assert [b.id for b in page.data] == listed[:1] and page.has_more is True
    assert [b.id for b in client.batches.list(limit=1000).data] == listed  # above 100: 100
    last = client.batches.list(after=listed[-1])
    assert (last.data, last.has_more) == ([], False)
    assert [b.id for b in client.batches.list(after=listed[0], limit=2).data] == listed[1:3]
    assert [b.id for b in client.batches.list(limit=1).iter_pages().__next__().data] == listed[:1]
    assert [b.id for b in client.batches.list(limit=1)] == listed  # the SDK's auto-pagination

    # an exported file of a batch whose DAG alice may not read: 403, not its bytes
    secret = openai_batches._read_json(openai_batches._files(), f"batches/{created[0].id}.json")
    assert secret is not None
    openai_batches._write_json(
        openai_batches._files(), f"batches/{created[0].id}.json", {**secret, "dag_id": "secret_dag"}
    )
    run_batch(door, created[1].id, tmp_path)
    output_id = client.batches.retrieve(created[1].id).output_file_id
    assert output_id is not None
    meta = openai_batches._read_json(openai_batches._files(), f"files/{output_id}/meta.json")
    assert meta is not None
    openai_batches._write_json(
        openai_batches._files(), f"files/{output_id}/meta.json", {**meta, "batch_id": created[0].id}
    )
    with pytest.raises(openai.PermissionDeniedError):
        client.files.content(output_id)
    with pytest.raises(openai.PermissionDeniedError):  # nor its name and size (before: they were shown)
        client.files.retrieve(output_id)
    with pytest.raises(openai.NotFoundError, match="no such file"):
        client.files.content("file-" + "0" * 32)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.files.content("../batches")  # a path, not an ID: no route reads it


def test_what_is_not_served_is_an_openai_404(door: FrontDoor) -> None:
    client = door.client()
    with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(GET /files\): not served here"):
        client.files.list()
    uploaded = client.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(DELETE /files/file-"):
        client.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.embeddings.create(model="m", input="x")
    assert client.files.retrieve(uploaded.id).id == uploaded.id  # nothing was deleted


def end_run(dag_id: str, run_id: str, at: dt.datetime) -> None:
    """Mark the DAG run failed, ended at ``at`` (as when it is cleared and fails again)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    set_run_state(dag_id, run_id, "failed")
    with create_session() as session:
        session.query(DagRun).filter_by(dag_id=dag_id, run_id=run_id).update({"end_date": at})


def test_a_failed_run_without_a_job_is_searched_for_once_per_end_of_the_run(
    door: FrontDoor, tmp_path: Path
) -> None:
    from airflow_deadline_batch.exceptions import AdmissionRejected

    client = door.client()
    batch = create_batch(client, bytes(range(256)) * 4 + b"\n" + requests_file(1))  # half the lines junk
    ended = dt.datetime.now(dt.timezone.utc)
    end_run("example_deadline_batch_local", batch.id, ended)  # failed before its plan ran
    first = client.batches.retrieve(batch.id)
    assert (first.status, first.job_id) == ("failed", None)
    assert first.errors is not None and "ended failed" in (first.errors.data[0].message or "")

    # a rejected job that appears after the search is not looked for again: later reads of the
    # same end of the run do not scan the latest 500 jobs (before: every read did, and found it)
    with pytest.raises(AdmissionRejected):
        run_batch(door, batch.id, tmp_path)
    assert [client.batches.retrieve(batch.id).job_id for _ in range(2)] == [None, None]
    sidecar = orjson.loads((door.files / "batches" / f"{batch.id}.json").read_bytes())
    assert sidecar["rejected_job_missed"] == ended.isoformat()  # the miss, with the run's end

    # the run cleared and failed again: another end, searched again, and the rejection found
    end_run("example_deadline_batch_local", batch.id, ended + dt.timedelta(minutes=5))
    got = client.batches.retrieve(batch.id)
    assert got.status == "failed" and got.job_id is not None
    assert got.errors is not None and "5 of 6 lines are invalid" in (got.errors.data[0].message or "")
    assert orjson.loads((door.files / "batches" / f"{batch.id}.json").read_bytes())["job_id"] == got.job_id


def test_deleted_objects_are_openai_404s_naming_the_file_and_the_batch_still_reads(
    door: FrontDoor, tmp_path: Path
) -> None:
    client = door.client()
    batch = create_batch(client, requests_file(2))
    run_batch(door, batch.id, tmp_path)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    (door.files / "runs" / batch.id / "export" / "output.jsonl").unlink()
    response = httpx.get(f"{door.url}/openai/v1/files/{done.output_file_id}/content")
    assert response.status_code == 404  # before: a 500 naming ObjectNotFound
    error = openai_error(response)
    assert (error["code"], error["type"]) == ("file_not_found", "invalid_request_error")
    assert f"file {done.output_file_id} has no content any more" in error["message"]
    with pytest.raises(openai.NotFoundError, match=done.output_file_id):
        client.files.content(done.output_file_id)
    assert client.files.retrieve(done.output_file_id).bytes > 0  # its record is still there
    again = client.batches.retrieve(batch.id)
    assert (again.status, again.output_file_id) == ("completed", done.output_file_id)
    # an upload whose object went: the same
    (door.files / "files" / batch.input_file_id / "content").unlink()
    with pytest.raises(openai.NotFoundError, match=f"file {batch.input_file_id} has no content"):
        client.files.content(batch.input_file_id)

    # the job's results deleted before the batch was first read: it cannot be exported, and the
    # read says so as a failed batch naming the cause (before: a 500 on every read)
    lost = create_batch(client, requests_file(2))
    run_batch(door, lost.id, tmp_path)
    for result in (door.files / "runs" / lost.id / "output").rglob("*.jsonl"):
        result.unlink()
    got = client.batches.retrieve(lost.id)
    assert got.status == "failed" and got.errors is not None
    assert "cannot export" in (got.errors.data[0].message or ""), got.errors
    assert got.output_file_id is None
    assert client.batches.list().data[0].status == "failed"  # the listing does not 500 either


@pytest.mark.parametrize(
    ("field", "value", "status", "message"),
    [
        ("input_file_id", "x" * (5 << 20), 404, "no such file: 'xxx"),
        ("endpoint", "x" * (5 << 20), 400, "endpoint must be one of"),
        ("completion_window", "x" * (5 << 20), 400, "completion_window must look like"),
        # a number Python refuses to parse (over 4,300 digits): before, a 500 naming a ValueError
        ("completion_window", "1" + "0" * 5000 + "h", 400, "is past the year 9999"),
    ],
)
def test_a_huge_field_is_refused_without_being_sent_back_whole(
    door: FrontDoor, field: str, value: str, status: int, message: str
) -> None:
    body = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    response = httpx.post(f"{door.url}/openai/v1/batches", json={**body, field: value}, timeout=60)
    assert response.status_code == status, response.text[:300]
    error = openai_error(response)
    assert message in error["message"] and f"({len(value) + 2} characters)" in error["message"]
    assert len(response.content) < 1000  # before: the 5 MB value came back in the message
    assert door.triggered == []
