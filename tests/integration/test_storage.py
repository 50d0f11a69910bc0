"""Behaviour every ObjectStorage backend shares, run against a local folder and moto's S3 server."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from airflow_deadline_batch.exceptions import ConfigurationError, ObjectExists, ObjectNotFound
from airflow_deadline_batch.storage import (
    ObjectStorage,
    open_storage,
    open_uri,
    sha256_hex,
    sha256_of_stream,
)

BACKENDS = ["local", pytest.param("s3", marks=pytest.mark.integration)]


@pytest.fixture(params=BACKENDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStorage:
    """A fresh, empty storage of each backend."""
    if request.param == "local":
        return open_storage(str(tmp_path / "base"))
    base_uri = request.getfixturevalue("s3_base_uri")
    return open_storage(base_uri)


@pytest.fixture(scope="module")
def big_lines() -> bytes:
    """About 3 MB of numbered JSON lines with varied lengths."""
    return b"".join(b'{"id": "r%d", "prompt": "%s"}\n' % (i, b"x" * (i % 97)) for i in range(40_000))


def test_put_get_round_trip(storage: ObjectStorage) -> None:
    data = bytes(range(256)) * 10
    uri = storage.put_bytes("a/b/c.bin", data)
    assert uri == storage.uri("a/b/c.bin")
    assert uri.endswith("/a/b/c.bin")
    assert storage.get_bytes("a/b/c.bin") == data
    assert storage.size("a/b/c.bin") == len(data)
    assert storage.exists("a/b/c.bin")


def test_put_replaces_existing_object(storage: ObjectStorage) -> None:
    storage.put_bytes("k", b"first version, longer")
    storage.put_bytes("k", b"second")
    assert storage.get_bytes("k") == b"second"


def test_empty_object(storage: ObjectStorage) -> None:
    storage.put_bytes("empty", b"")
    assert storage.get_bytes("empty") == b""
    assert storage.size("empty") == 0
    assert storage.read_range("empty", 0, 0) == b""
    assert storage.read_range("empty", 0, 10) == b""


def test_uri_reopens_the_same_object(storage: ObjectStorage) -> None:
    uri = storage.put_bytes("dir/in.jsonl", b"line\n")
    parent, key = open_uri(uri)
    assert key == "in.jsonl"
    assert parent.get_bytes(key) == b"line\n"


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, 4, b"0123"),
        (3, 7, b"3456"),
        (6, 10, b"6789"),  # ends exactly at EOF
        (8, 50, b"89"),  # runs past EOF: clipped like a slice
        (5, 5, b""),  # empty range
        (10, 10, b""),  # empty range at EOF
        (12, 20, b""),  # starts past EOF
    ],
)
def test_read_range_is_half_open(storage: ObjectStorage, start: int, end: int, expected: bytes) -> None:
    storage.put_bytes("digits", b"0123456789")
    assert storage.read_range("digits", start, end) == expected


@pytest.mark.parametrize(("start", "end"), [(-1, 3), (5, 4)])
def test_read_range_rejects_inverted_or_negative_ranges(storage: ObjectStorage, start: int, end: int) -> None:
    storage.put_bytes("digits", b"0123456789")
    with pytest.raises(ConfigurationError, match="byte range"):
        storage.read_range("digits", start, end)


def test_open_read_iterates_lines_of_a_multi_megabyte_object(
    storage: ObjectStorage, big_lines: bytes
) -> None:
    storage.put_bytes("big.jsonl", big_lines)
    with storage.open_read("big.jsonl") as stream:
        first = stream.readline()
        assert first == b'{"id": "r0", "prompt": ""}\n'
        count = 1 + sum(1 for _ in stream)
    assert count == 40_000
    with storage.open_read("big.jsonl") as stream:
        assert sha256_of_stream(stream) == sha256_hex(big_lines)
    with storage.open_read("big.jsonl") as stream:
        assert stream.read(7) == big_lines[:7]
        assert stream.read() == big_lines[7:]


def test_open_read_seek_then_read(storage: ObjectStorage, big_lines: bytes) -> None:
    storage.put_bytes("big.jsonl", big_lines)
    offset = 2_000_003
    with storage.open_read("big.jsonl") as stream:
        stream.seek(offset)
        assert stream.read(100) == big_lines[offset : offset + 100]
        assert stream.tell() == offset + 100


def test_create_bytes_refuses_to_overwrite(storage: ObjectStorage) -> None:
    uri = storage.create_bytes("manifest.json", b'{"winner": 1}')
    assert uri == storage.uri("manifest.json")
    with pytest.raises(ObjectExists, match="manifest.json"):
        storage.create_bytes("manifest.json", b'{"winner": 2}')
    assert storage.get_bytes("manifest.json") == b'{"winner": 1}'


def test_create_bytes_after_put_also_refuses(storage: ObjectStorage) -> None:
    storage.put_bytes("k", b"put")
    with pytest.raises(ObjectExists):
        storage.create_bytes("k", b"create")
    assert storage.get_bytes("k") == b"put"


def test_racing_creators_have_exactly_one_winner(storage: ObjectStorage) -> None:
    contenders = 8
    barrier = threading.Barrier(contenders)
    winners: list[int] = []
    losers: list[int] = []
    lock = threading.Lock()

    def publish(index: int) -> None:
        payload = b"publisher %d " % index * 1000
        barrier.wait(timeout=10)
        try:
            storage.create_bytes("race/manifest.json", payload)
        except ObjectExists:
            with lock:
                losers.append(index)
        else:
            with lock:
                winners.append(index)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(winners) == 1, (winners, losers)
    assert len(losers) == contenders - 1
    assert storage.get_bytes("race/manifest.json") == b"publisher %d " % winners[0] * 1000


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/", "../up", "a/../b", "./a", "a/.", "nul\x00byte"])
def test_invalid_keys_are_rejected_naming_the_key(storage: ObjectStorage, key: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid object key") as info:
        storage.put_bytes(key, b"x")
    assert repr(key) in str(info.value)
    with pytest.raises(ConfigurationError):
        storage.get_bytes(key)


def test_list_keys_in_order_and_by_prefix(storage: ObjectStorage) -> None:
    keys = ["b.txt", "a/2.jsonl", "a/10.jsonl", "a/1.jsonl", "ab/x", "c/d/e"]
    for key in keys:
        storage.put_bytes(key, b"x")
    assert list(storage.list_keys()) == sorted(keys)
    assert list(storage.list_keys("a/")) == ["a/1.jsonl", "a/10.jsonl", "a/2.jsonl"]
    assert list(storage.list_keys("a")) == ["a/1.jsonl", "a/10.jsonl", "a/2.jsonl", "ab/x"]
    assert list(storage.list_keys("c/d/")) == ["c/d/e"]
    assert list(storage.list_keys("missing/")) == []


def test_list_keys_ignores_objects_outside_the_base(storage: ObjectStorage) -> None:
    storage.put_bytes("inside", b"x")
    sibling = open_storage(storage.base_uri + "-sibling")
    sibling.put_bytes("outside", b"y")
    assert list(storage.list_keys()) == ["inside"]


def test_delete_is_idempotent(storage: ObjectStorage) -> None:
    storage.put_bytes("gone", b"x")
    storage.delete("gone")
    assert not storage.exists("gone")
    storage.delete("gone")
    storage.delete("never/existed")


def test_missing_objects_raise_not_found_naming_the_uri(storage: ObjectStorage) -> None:
    uri = storage.uri("nope.jsonl")
    for read in (
        lambda: storage.get_bytes("nope.jsonl"),
        lambda: storage.read_range("nope.jsonl", 0, 10),
        lambda: storage.read_range("nope.jsonl", 0, 0),
        lambda: storage.size("nope.jsonl"),
        lambda: storage.open_read("nope.jsonl"),
    ):
        with pytest.raises(ObjectNotFound) as info:
            read()
        assert uri in str(info.value)
    assert not storage.exists("nope.jsonl")


def test_a_folder_is_not_an_object(storage: ObjectStorage) -> None:
    storage.put_bytes("dir/file", b"x")
    assert not storage.exists("dir")
    with pytest.raises(ObjectNotFound):
        storage.get_bytes("dir")


def test_sha256_helpers_agree() -> None:
    data = b"hello\n" * 300_000
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert sha256_of_stream(io.BytesIO(data), chunk_size=4096) == sha256_hex(data)
    assert sha256_of_stream(io.BytesIO(b"")) == sha256_hex(b"")


def test_keys_with_unicode_and_spaces(storage: ObjectStorage) -> None:
    key = "résumé dir/naïve file.jsonl"
    storage.put_bytes(key, b"ok")
    assert storage.get_bytes(key) == b"ok"
    assert list(storage.list_keys()) == [key]
