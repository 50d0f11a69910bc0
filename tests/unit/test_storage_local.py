"""Local object storage: atomic writes, race-safe creates, URI parsing; no network, no boto3."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from airflow_deadline_batch.exceptions import ChecksumMismatch, ConfigurationError, ObjectExists, StorageError
from airflow_deadline_batch.storage import (
    LocalStorage,
    check_sha256,
    join_uri,
    open_storage,
    open_uri,
    put_file,
    put_stream,
    sha256_hex,
)
from airflow_deadline_batch.storage.local import TEMP_SUFFIX, is_temp_name


def all_files(root: Path) -> list[str]:
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())


def test_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.put_bytes("a/x", b"1")
    storage.put_bytes("a/x", b"2")
    storage.create_bytes("a/y", b"3")
    with pytest.raises(ObjectExists):
        storage.create_bytes("a/y", b"4")
    assert all_files(tmp_path) == ["a/x", "a/y"]


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with pytest.raises(TypeError):
        storage.put_bytes("a/x", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        storage.create_bytes("a/y", "not bytes")  # type: ignore[arg-type]
    assert all_files(tmp_path) == []


def test_file_and_folder_clash_is_a_storage_error_naming_the_path(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.put_bytes("a", b"file")
    with pytest.raises(StorageError, match=r"cannot write .*/a/b: .*choose another output location"):
        storage.put_bytes("a/b", b"x")
    assert all_files(tmp_path) == ["a"]


def test_readers_never_see_a_partial_object(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    versions = [bytes([65 + i]) * (2 << 20) for i in range(3)]  # 2 MiB each: many write() calls deep
    storage.put_bytes("k", versions[0])
    done = threading.Event()
    seen: set[bytes] = set()
    torn: list[int] = []

    def read_until_done() -> None:
        while not done.is_set():
            data = storage.get_bytes("k")
            if data not in versions:
                torn.append(len(data))
            seen.add(data[:1])

    reader = threading.Thread(target=read_until_done)
    reader.start()
    try:
        for round_ in range(30):
            storage.put_bytes("k", versions[round_ % len(versions)])
    finally:
        done.set()
        reader.join(timeout=30)
    assert torn == []
    assert seen  # the reader really ran


def test_listing_skips_in_flight_temporary_files(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.put_bytes("d/real", b"x")
    (tmp_path / "d" / f".real.{'0' * 32}{TEMP_SUFFIX}").write_bytes(b"partial")
    assert list(storage.list_keys()) == ["d/real"]
    assert is_temp_name(f".x.{'a' * 32}{TEMP_SUFFIX}")
    assert not is_temp_name(".hidden")


def _create_in_child(root: str, index: int, start: threading.Barrier, results: multiprocessing.Queue) -> None:
    storage = LocalStorage(root)
    start.wait(timeout=30)
    try:
        storage.create_bytes("manifest.json", b"process %d" % index)
    except ObjectExists:
        results.put((index, "lost"))
    else:
        results.put((index, "won"))


def test_racing_processes_have_exactly_one_winner(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    contenders = 4
    start = context.Barrier(contenders)
    results: multiprocessing.Queue = context.Queue()
    processes = [
        context.Process(target=_create_in_child, args=(str(tmp_path), i, start, results))
        for i in range(contenders)
    ]
    for process in processes:
        process.start()
    outcomes = dict(results.get(timeout=30) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    winners = [index for index, outcome in outcomes.items() if outcome == "won"]
    assert len(winners) == 1, outcomes
    assert (tmp_path / "manifest.json").read_bytes() == b"process %d" % winners[0]
    assert all_files(tmp_path) == ["manifest.json"]


@pytest.mark.parametrize(
    ("uri", "root"),
    [
        ("/data/out", "/data/out"),
        ("/data/out/", "/data/out"),
        ("file:///data/out", "/data/out"),
        ("file://localhost/data/out", "/data/out"),
        ("file:///data/with%20space", "/data/with space"),
    ],
)
def test_open_storage_local_forms(uri: str, root: str) -> None:
    storage = open_storage(uri)
    assert isinstance(storage, LocalStorage)
    assert storage.root == Path(root)
    assert storage.uri("a/b") == f"{root}/a/b"


def test_relative_paths_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    storage, key = open_uri("in/data.jsonl")
    assert storage.base_uri == str(tmp_path / "in")
    assert key == "data.jsonl"


def test_s3_options_are_ignored_for_local_storage(tmp_path: Path) -> None:
    assert isinstance(open_storage(str(tmp_path), client=object(), page_size=5), LocalStorage)


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("", "empty storage URI"),
        ("gs://bucket/x", "unsupported storage URI"),
        ("http://host/x", "unsupported storage URI"),
        ("file://otherhost/x", "names host"),
    ],
)
def test_bad_storage_uris(uri: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        open_storage(uri)


@pytest.mark.parametrize("uri", ["/data/", "/data/..", "file:///"])
def test_open_uri_needs_a_file(uri: str) -> None:
    with pytest.raises(ConfigurationError):
        open_uri(uri)


@pytest.mark.parametrize(
    ("base", "parts", "expected"),
    [
        ("s3://b/out/", ("j-1", "manifest.json"), "s3://b/out/j-1/manifest.json"),
        ("s3://b", ("x",), "s3://b/x"),
        ("/data/out", ("j-1/", "/a"), "/data/out/j-1/a"),
        ("/", ("a",), "/a"),
        ("file:///", ("a", "b"), "file:///a/b"),
        ("rel", ("x",), "rel/x"),
        ("/data/", (), "/data"),
        ("/data", ("", "/"), "/data"),
    ],
)
def test_join_uri(base: str, parts: tuple[str, ...], expected: str) -> None:
    assert join_uri(base, *parts) == expected


def test_check_sha256() -> None:
    digest = sha256_hex(b"abc")
    check_sha256(b"abc", digest.upper(), uri="/x")
    with pytest.raises(ChecksumMismatch, match="SHA-256 of /x is .* expected") as info:
        check_sha256(b"abd", digest, uri="/x")
    assert info.value.fields["expected"] == digest


def test_local_storage_does_not_import_boto3(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from airflow_deadline_batch.storage import open_storage, open_uri\n"
        f"s = open_storage({str(tmp_path)!r})\n"
        "s.put_bytes('k', b'v')\n"
        "open_uri(s.uri('k'))[0].get_bytes('k')\n"
        "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules, 'boto3 was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)


def test_a_fifo_or_device_is_refused_not_read(tmp_path: Path) -> None:
    """Reading a FIFO would block until a writer comes: it is refused at once (docs/design.md §8)."""
    fifo = tmp_path / "input.fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/null")):
        storage, key = open_uri(str(path))
        with pytest.raises(ConfigurationError, match="not a regular file"):
            storage.open_read(key)
        with pytest.raises(ConfigurationError, match="not a regular file"):
            storage.read_range(key, 0, 1)


def test_put_file_and_put_stream_copy_in_chunks_atomically(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    source = tmp_path / "big.bin"
    data = os.urandom(3 * (1 << 20) + 17)  # more than one copy chunk, not a multiple of it
    source.write_bytes(data)
    assert put_file(storage, "a/big.bin", source) == storage.uri("a/big.bin")
    assert storage.get_bytes("a/big.bin") == data
    with source.open("rb") as stream:
        stream.seek(5)
        put_stream(storage, "a/rest.bin", stream)
    assert storage.get_bytes("a/rest.bin") == data[5:]
    assert all_files(tmp_path / "root") == ["a/big.bin", "a/rest.bin"]  # no temporary file left
