"""Read many objects by URI in order, those on S3 several at a time, with one S3 client.

Verification, finalization and export each read every outcome object a job committed: thousands
of 1-2 MB objects at ten million records. On S3 each read is a round trip, so :func:`read_ahead`
fetches and hashes up to :data:`READ_AHEAD` of them in a pool of threads (reading and hashing
release the GIL) while the caller checks them in order; local files are read one by one (threads
only add GIL hand-offs to reads the page cache serves: slower on two cores).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, Protocol, TypeVar

from airflow_deadline_batch.exceptions import StorageError
from airflow_deadline_batch.storage.base import CHUNK_SIZE, ObjectStorage, sha256_hex
from airflow_deadline_batch.storage.uri import open_uri

__all__ = ["READ_AHEAD", "WHOLE_OBJECT_RECORDS", "Fetched", "ObjectReader", "read_ahead", "stream_lines"]

#: objects on S3 read ahead of the caller by a pool of threads: at most this many in memory at once
READ_AHEAD = 8
#: an object of more records than this (the validation object, a finalizer's object for an
#: unfinished shard) is left for the caller to stream in chunks; a microbatch is read whole
WHOLE_OBJECT_RECORDS = 20_000


class ListedObject(Protocol):
    """What :func:`read_ahead` needs of an object: where it is and how many records it holds."""

    @property
    def uri(self) -> str: ...

    @property
    def records(self) -> int: ...


_Obj = TypeVar("_Obj", bound=ListedObject)


class ObjectReader:
    """Opens objects by URI with at most one S3 client (building one costs 0.1-0.3 s, and a pass
    reads every committed object). Safe to share between threads (boto3 clients are)."""

    def __init__(self) -> None:
        self._client: Any = None
        self._lock = threading.Lock()

    def storage(self, uri: str) -> tuple[ObjectStorage, str]:
        """The storage holding ``uri`` and its key there."""
        if not uri.startswith("s3://"):
            return open_uri(uri)
        with self._lock:
            if self._client is None:
                from airflow_deadline_batch.storage.s3 import make_client

                self._client = make_client()
        return open_uri(uri, client=self._client)

    def get_bytes(self, uri: str) -> bytes:
        storage, key = self.storage(uri)
        return bytes(storage.get_bytes(key))

    def open_read(self, uri: str) -> BinaryIO:
        storage, key = self.storage(uri)
        return storage.open_read(key)


@dataclass(frozen=True)
class Fetched:
    """An object read ahead: its bytes and their SHA-256, or why it could not be read; or neither,
    when it is too large to hold and the caller streams it (:meth:`ObjectReader.open_read`)."""

    data: bytes | None = None
    sha256: str | None = None
    error: StorageError | None = None


def _fetch(obj: ListedObject, reader: ObjectReader, whole_records: int) -> Fetched:
    if obj.records > whole_records:
        return Fetched()
    try:
        data = reader.get_bytes(obj.uri)
    except StorageError as exc:
        return Fetched(error=exc)
    return Fetched(data, sha256_hex(data))


def read_ahead(
    objects: Iterable[_Obj],
    reader: ObjectReader,
    *,
    threads: int | None = None,
    whole_records: int | None = None,
) -> Iterator[tuple[_Obj, Fetched]]:
    """``(object, fetched)`` in the order of ``objects``: from the first object on S3 on, up to
    ``threads`` (:data:`READ_AHEAD`) read in parallel; local files one by one, when reached.

    Objects of more than ``whole_records`` (:data:`WHOLE_OBJECT_RECORDS`) records are not read.
    """
    threads = READ_AHEAD if threads is None else threads
    whole = WHOLE_OBJECT_RECORDS if whole_records is None else whole_records
    rest = iter(objects)
    for obj in rest:
        if obj.uri.startswith("s3://"):
            yield from _read_in_parallel(itertools.chain([obj], rest), reader, threads, whole)
            return
        yield obj, _fetch(obj, reader, whole)


def _read_in_parallel(
    objects: Iterator[_Obj], reader: ObjectReader, threads: int, whole: int
) -> Iterator[tuple[_Obj, Fetched]]:
    pending: deque[tuple[_Obj, Future[Fetched]]] = deque()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="adb-read-ahead") as pool:
        try:
            for obj in objects:
                pending.append((obj, pool.submit(_fetch, obj, reader, whole)))
                if len(pending) >= threads:
                    head, future = pending.popleft()
                    yield head, future.result()
            while pending:
                head, future = pending.popleft()
                yield head, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def stream_lines(stream: IO[bytes], digest: Any) -> Iterator[bytes]:
    """The lines of ``stream`` (without their newline), read in chunks, every byte fed to ``digest``."""
    rest = b""
    while chunk := stream.read(CHUNK_SIZE):
        digest.update(chunk)
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest
