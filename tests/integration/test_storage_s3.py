"""S3-specific behaviour against moto's server: pagination, client settings, errors, broken streams."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from botocore.config import Config

from airflow_deadline_batch.exceptions import ConfigurationError, ObjectExists, StorageError
from airflow_deadline_batch.storage import open_storage, open_uri, put_file, put_stream
from airflow_deadline_batch.storage.s3 import S3Storage, make_client
from tests.fixtures.s3 import CuttingProxy, free_port

pytestmark = pytest.mark.integration


def client_for(endpoint_url: str, **config: Any) -> Any:
    """A client like the package's own, pointed at ``endpoint_url``, with overridable settings."""
    settings: dict[str, Any] = {
        "connect_timeout": 5,
        "read_timeout": 10,
        "retries": {"max_attempts": 3, "mode": "standard"},
    }
    settings.update(config)
    return boto3.client("s3", endpoint_url=endpoint_url, config=Config(**settings))


def count_calls(client: Any, operation: str) -> list[str]:
    """Record each ``operation`` request the client sends (botocore's own event hooks)."""
    calls: list[str] = []
    client.meta.events.register(f"before-call.s3.{operation}", lambda **_: calls.append(operation))
    return calls


def test_client_has_explicit_timeouts_and_bounded_retries(s3_endpoint: str) -> None:
    config = make_client().meta.config
    assert (config.connect_timeout, config.read_timeout) == (5, 60)
    assert config.retries == {"mode": "standard", "total_max_attempts": 6}  # 5 retries


def test_client_honours_aws_endpoint_url(s3_endpoint: str) -> None:
    assert make_client().meta.endpoint_url == s3_endpoint


def test_list_keys_follows_pagination(s3_bucket: str, s3_endpoint: str) -> None:
    client = client_for(s3_endpoint)
    storage = S3Storage(s3_bucket, "base", client=client, page_size=7)
    keys = sorted(f"part-{i:03d}" for i in range(30))
    for key in keys:
        storage.put_bytes(key, b"x")
    client.put_object(Bucket=s3_bucket, Key="base-sibling/other", Body=b"y")
    calls = count_calls(client, "ListObjectsV2")
    assert list(storage.list_keys()) == keys
    assert len(calls) == 5  # ceil(30 / 7): every page was fetched, none twice
    assert list(storage.list_keys("part-02")) == [f"part-02{i}" for i in range(10)]


def test_injected_client_is_used(s3_bucket: str, s3_endpoint: str) -> None:
    client = client_for(s3_endpoint)
    calls = count_calls(client, "PutObject")
    storage = open_storage(f"s3://{s3_bucket}/x", client=client)
    storage.put_bytes("k", b"v")
    assert calls == ["PutObject"]


def test_uris_round_trip(s3_bucket: str, s3_endpoint: str) -> None:
    storage = open_storage(f"s3://{s3_bucket}/out/")
    assert storage.base_uri == f"s3://{s3_bucket}/out"
    assert storage.uri("j-1/manifest.json") == f"s3://{s3_bucket}/out/j-1/manifest.json"
    root = open_storage(f"s3://{s3_bucket}")
    assert root.uri("k") == f"s3://{s3_bucket}/k"
    root.put_bytes("in/data.jsonl", b"{}\n")
    parent, key = open_uri(f"s3://{s3_bucket}/in/data.jsonl")
    assert (parent.base_uri, key) == (f"s3://{s3_bucket}/in", "data.jsonl")
    assert parent.get_bytes(key) == b"{}\n"


@pytest.mark.parametrize("uri", ["s3://", "s3:///key", "s3://bucket", "s3://bucket/", "s3://bucket/dir/"])
def test_open_uri_needs_an_object_key(uri: str, s3_endpoint: str) -> None:
    with pytest.raises(ConfigurationError, match="s3://"):
        open_uri(uri)


def test_missing_bucket_names_the_bucket_and_the_fix(s3_endpoint: str) -> None:
    storage = open_storage("s3://no-such-bucket-anywhere/p")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-anywhere' does not exist.*create it"):
        storage.put_bytes("k", b"v")


def test_unreachable_endpoint_is_a_storage_error_naming_the_fix() -> None:
    client = client_for(f"http://127.0.0.1:{free_port()}", retries={"max_attempts": 1, "mode": "standard"})
    storage = S3Storage("bucket", client=client)
    with pytest.raises(StorageError, match="cannot read s3://bucket/k: .*check the network"):
        storage.get_bytes("k")


def test_open_read_resumes_after_the_connection_drops(s3_bucket: str, s3_endpoint: str) -> None:
    data = b"".join(b"line %07d\n" % i for i in range(200_000))  # 2.6 MB
    open_storage(f"s3://{s3_bucket}").put_bytes("big.jsonl", data)
    # The first connection carries the GET; cut it after ~300 kB of the body.
    with CuttingProxy(s3_endpoint, {0: 300_000}) as proxy:
        storage = S3Storage(s3_bucket, client=client_for(proxy.endpoint_url))
        with storage.open_read("big.jsonl") as stream:
            lines = stream.readlines()
        assert proxy.connections >= 2
    assert b"".join(lines) == data
    assert len(lines) == 200_000


def test_open_read_refuses_to_splice_a_replaced_object(s3_bucket: str, s3_endpoint: str) -> None:
    storage = open_storage(f"s3://{s3_bucket}")
    size = 4 << 20  # larger than the reader's buffer, so a seek past it reaches S3
    storage.put_bytes("k", b"a" * size)
    with storage.open_read("k") as stream:
        assert stream.read(10) == b"a" * 10
        storage.put_bytes("k", b"b" * size)
        stream.seek(size - 100)  # the next read reopens the object with If-Match
        with pytest.raises(StorageError, match="replaced while it was being read"):
            stream.read(10)


def test_create_whose_response_was_lost_still_succeeds(s3_bucket: str, s3_endpoint: str) -> None:
    # The server stores the first PUT but its answer never arrives; botocore retries, S3 answers 412
    # for our own object, and create_bytes recognises its own bytes.
    with CuttingProxy(s3_endpoint, {0: 0}) as proxy:
        storage = S3Storage(s3_bucket, client=client_for(proxy.endpoint_url))
        uri = storage.create_bytes("manifest.json", b"mine")
        assert proxy.connections >= 2
    assert uri == f"s3://{s3_bucket}/manifest.json"
    direct = S3Storage(s3_bucket)
    assert direct.get_bytes("manifest.json") == b"mine"
    with pytest.raises(ObjectExists):
        direct.create_bytes("manifest.json", b"theirs")


@pytest.mark.parametrize(
    ("bucket", "page_size"), [("", 1000), ("a/b", 1000), ("bucket", 0), ("bucket", 1001)]
)
def test_constructor_validates(bucket: str, page_size: int, s3_endpoint: str) -> None:
    with pytest.raises(ConfigurationError):
        S3Storage(bucket, page_size=page_size)


def test_use_client_routes_every_client_the_package_makes_and_restores_on_exit(s3_endpoint: str) -> None:
    from airflow_deadline_batch.storage.s3 import use_client

    outer, inner = object(), object()
    with use_client(outer):
        assert make_client() is outer
        with use_client(inner):
            assert make_client() is inner
        assert make_client() is outer
    assert make_client() not in (outer, inner)
    assert make_client().meta.endpoint_url == s3_endpoint


def test_put_file_and_put_stream_use_the_managed_upload(
    s3_bucket: str, s3_endpoint: str, tmp_path: Any
) -> None:
    client = client_for(s3_endpoint)
    parts = count_calls(client, "UploadPart")
    storage = open_storage(f"s3://{s3_bucket}/up", client=client)
    source = tmp_path / "big.bin"
    data = bytes(range(256)) * (40 * 4096 + 3)  # about 10 MiB: above the multipart threshold
    source.write_bytes(data)
    assert put_file(storage, "big.bin", source) == f"s3://{s3_bucket}/up/big.bin"
    assert storage.get_bytes("big.bin") == data
    assert len(parts) > 1  # uploaded in parts, never one request of the whole file
    with source.open("rb") as stream:
        stream.seek(7)
        put_stream(storage, "rest.bin", stream)
    assert storage.get_bytes("rest.bin") == data[7:]
