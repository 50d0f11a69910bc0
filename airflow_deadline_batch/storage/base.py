"""The object-storage contract, key validation and checksum helpers shared by every backend."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from airflow_deadline_batch.exceptions import ChecksumMismatch, ConfigurationError

#: read size for streaming checksums and copies: large enough to amortise syscalls and HTTP chunks
CHUNK_SIZE = 1 << 20


@runtime_checkable
class ObjectStorage(Protocol):
    """Objects under one base URI, addressed by relative POSIX keys such as ``attempts/a-1/x.jsonl``.

    Writes are all-or-nothing: a reader sees either no object or the whole object, never a prefix.
    """

    @property
    def base_uri(self) -> str:
        """The URI every key is relative to."""
        ...

    def uri(self, key: str) -> str:
        """The full URI of ``key`` (what manifests record and :func:`open_uri` reads back)."""
        ...

    def put_bytes(self, key: str, data: bytes) -> str:
        """Write ``data`` atomically, replacing any existing object; return its URI."""
        ...

    def create_bytes(self, key: str, data: bytes) -> str:
        """Write ``data`` only if ``key`` does not exist; raise ``ObjectExists`` otherwise."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """The whole object; ``ObjectNotFound`` if missing."""
        ...

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, clipped at the end of the object like a slice."""
        ...

    def open_read(self, key: str) -> BinaryIO:
        """A buffered binary stream over the object, for inputs too large to hold in memory."""
        ...

    def size(self, key: str) -> int:
        """The object's length in bytes; ``ObjectNotFound`` if missing."""
        ...

    def version(self, key: str) -> tuple[object, ...]:
        """What changes when the object is rewritten (equal before and after: the same bytes,
        as far as the storage can tell); ``ObjectNotFound`` if missing."""
        ...

    def exists(self, key: str) -> bool:
        """Whether the object exists."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; a missing object is not an error."""
        ...

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        """Keys that start with ``prefix``, in lexicographic order."""
        ...


def put_file(storage: ObjectStorage, key: str, source: Path | str) -> str:
    """Write the file ``source`` to ``key`` atomically; return its URI.

    Backends with a ``put_file`` (local files, S3) copy or upload it in bounded chunks; any other
    :class:`ObjectStorage` gets its bytes through ``put_bytes``.
    """
    put = getattr(storage, "put_file", None)
    if put is not None:
        return str(put(key, source))
    with Path(source).open("rb") as stream:
        return put_stream(storage, key, stream)


def put_stream(storage: ObjectStorage, key: str, stream: BinaryIO) -> str:
    """Write what is left in ``stream`` to ``key`` atomically; return its URI.

    Backends with a ``put_stream`` (local files, S3) copy or upload it in bounded chunks; any other
    :class:`ObjectStorage` gets its bytes through ``put_bytes``.
    """
    put = getattr(storage, "put_stream", None)
    if put is not None:
        return str(put(key, stream))
    return storage.put_bytes(key, stream.read())


def read_versioned(storage: ObjectStorage, key: str) -> tuple[bytes, str]:
    """The object's bytes and a version token for :func:`put_if_version`; ``ObjectNotFound`` if missing.

    The token names the bytes read (local files: their SHA-256; S3: the ETag of the response that
    carried them), so it cannot be a newer version's.
    """
    data, version = _conditional(storage, "get_versioned")(key)
    return bytes(data), str(version)


def put_if_version(storage: ObjectStorage, key: str, data: bytes, version: str | None) -> str:
    """Write ``data`` to ``key`` only if the object is still the one :func:`read_versioned` read as
    ``version`` (``None``: only if there is none); return its URI, else raise ``ObjectChanged``.

    A compare-and-swap between writers that all use it: of several read-modify-writes of one
    object, one lands and the others fail, to read again and retry. A plain ``put_bytes`` is not
    fenced out by it.
    """
    return str(_conditional(storage, "put_bytes_if")(key, data, version))


def _conditional(storage: ObjectStorage, method: str) -> Any:
    found = getattr(storage, method, None)
    if found is None:
        raise ConfigurationError(
            f"{storage!r} has no conditional writes ({method}): use local files or S3 for this store"
        )
    return found


def validate_key(key: str, *, base_uri: str = "") -> str:
    """Return ``key`` if it is a clean relative POSIX path, else raise ``ConfigurationError``.

    Rejected: empty keys, absolute keys, empty segments (``a//b``, a trailing ``/``), ``.`` and
    ``..`` segments, and NUL characters. Clean keys mean the same object on every backend.
    """
    where = f" under {base_uri}" if base_uri else ""
    if not isinstance(key, str) or not key:
        raise ConfigurationError(f"invalid object key {key!r}{where}: use a non-empty relative path", key=key)
    if "\x00" in key:
        raise ConfigurationError(f"invalid object key {key!r}{where}: remove the NUL character", key=key)
    if key.startswith("/"):
        raise ConfigurationError(
            f"invalid object key {key!r}{where}: use a path relative to the base, without a leading '/'",
            key=key,
        )
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise ConfigurationError(
                f"invalid object key {key!r}{where}: remove empty, '.' and '..' path segments", key=key
            )
    return key


def validate_prefix(prefix: str, *, base_uri: str = "") -> str:
    """Return a listing prefix: ``""``, a clean key, or a clean key followed by one ``/``."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix, base_uri=base_uri)
    return prefix


def validate_range(start: int, end: int, *, uri: str) -> None:
    """Reject byte ranges that are not ``0 <= start <= end``."""
    if not (isinstance(start, int) and isinstance(end, int)) or start < 0 or end < start:
        raise ConfigurationError(
            f"invalid byte range [{start}, {end}) for {uri}: need integers with 0 <= start <= end",
            uri=uri,
        )


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_of_stream(stream: BinaryIO, *, chunk_size: int = CHUNK_SIZE) -> str:
    """Lowercase hex SHA-256 of everything left in ``stream``, read in bounded chunks."""
    digest = hashlib.sha256()
    while chunk := stream.read(chunk_size):
        digest.update(chunk)
    return digest.hexdigest()


def check_sha256(data: bytes, expected: str, *, uri: str) -> None:
    """Raise ``ChecksumMismatch`` unless ``data`` hashes to ``expected`` (hex, any case)."""
    actual = sha256_hex(data)
    if actual != expected.lower():
        raise ChecksumMismatch(
            f"SHA-256 of {uri} is {actual}, expected {expected}: the object changed after it was recorded;"
            " rerun the affected shard or restore the object",
            uri=uri,
            expected=expected,
            actual=actual,
        )
