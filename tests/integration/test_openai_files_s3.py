"""The OpenAI front door's files store on S3 (moto's server over HTTP): uploads stream in, bytes round-trip.

The end-to-end front-door test runs the files store on local files; this one runs the same routes
(`/files` upload, metadata, content) against the S3 API, with Airflow's login dependency answered
by a fixed user, so the multipart upload path and the streamed download are exercised for real.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi import FastAPI
from fastapi.testclient import TestClient

from airflow_deadline_batch.api import openai_batches


@pytest.fixture()
def client(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("ADB_FILES_URI", f"s3://{s3_bucket}/front-door")
    openai_batches._open_files.cache_clear()
    app = FastAPI()
    app.include_router(openai_batches.create_router(), prefix="/openai/v1")
    app.dependency_overrides[get_user] = lambda: SimpleAuthManagerUser(username="alice", role="user")
    with TestClient(app) as test_client:
        yield test_client
    openai_batches._open_files.cache_clear()


def test_upload_streams_to_s3_and_reads_back_byte_for_byte(
    client: TestClient, s3_bucket: str, s3_client: Any
) -> None:
    # 12 MiB: above boto3's 8 MiB multipart threshold, so the upload goes up in parts
    body = b"".join(
        b'{"custom_id": "r%07d", "method": "POST", "url": "/v1/chat/completions", "body": {"x": "%s"}}\n'
        % (i, os.urandom(24).hex().encode())
        for i in range(12 * 1024 * 1024 // 140)
    )
    created = client.post(
        "/openai/v1/files", files={"file": ("../../etc/nightly.jsonl", body)}, data={"purpose": "batch"}
    )
    assert created.status_code == 200, created.text
    meta = created.json()
    assert meta["bytes"] == len(body)
    assert meta["filename"] == "nightly.jsonl"  # the caller's path never reaches a key
    file_id = meta["id"]

    listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=f"front-door/files/{file_id}/")
    keys = {item["Key"]: item for item in listed.get("Contents", [])}
    content_key = f"front-door/files/{file_id}/content"
    assert set(keys) == {content_key, f"front-door/files/{file_id}/meta.json"}
    assert keys[content_key]["Size"] == len(body)
    assert "-" in keys[content_key]["ETag"]  # a multipart object's ETag: "<md5>-<parts>"

    assert client.get(f"/openai/v1/files/{file_id}").json() == meta
    downloaded = client.get(f"/openai/v1/files/{file_id}/content")
    assert downloaded.status_code == 200
    assert hashlib.sha256(downloaded.content).hexdigest() == hashlib.sha256(body).hexdigest()


def test_unknown_and_malformed_file_ids_are_404_on_s3(client: TestClient) -> None:
    assert client.get("/openai/v1/files/file-0123456789abcdef").status_code == 404
    assert client.get("/openai/v1/files/..%2Fmeta").status_code == 404
    refused = client.post(
        "/openai/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "fine-tune"}
    )
    assert refused.status_code == 400
    assert "purpose must be 'batch'" in refused.json()["error"]["message"]
