"""Object storage on S3 (or any S3 API): conditional creates with ``If-None-Match: *``.

This is the only module that imports boto3, so the core and a worker on local storage run without it.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import boto3
import boto3.exceptions
import botocore.exceptions
import urllib3.exceptions
from botocore.config import Config
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from airflow_deadline_batch.exceptions import (
    ConfigurationError,
    ObjectChanged,
    ObjectExists,
    ObjectNotFound,
    StorageError,
)
from airflow_deadline_batch.storage.base import (
    CHUNK_SIZE,
    validate_key,
    validate_prefix,
    validate_range,
)

#: S3's largest page of a listing
MAX_PAGE_SIZE = 1000
#: how often a streaming read resumes (with a ranged GET) after the connection drops mid-object
STREAM_RESUMES = 3

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_DENIED_CODES = frozenset(
    {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
)
# Errors of a response body that broke off mid-stream; the object itself is fine, so resume.
_STREAM_ERRORS = (
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    urllib3.exceptions.HTTPError,
    ConnectionError,
)


def client_config() -> Config:
    """The botocore settings every client this package creates uses.

    Explicit timeouts: a connect that never completes fails in 5 s instead of botocore's 60 s, and a
    read on a half-open socket (peer gone without a FIN, common behind NAT and load balancers) ends
    after 60 s instead of stalling a worker while its lease runs out. "standard" retries back off with
    jitter on throttling, 5xx and connection errors, at most 5 retries (6 attempts in all).
    """
    return Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 5, "mode": "standard"})


#: the client every ``make_client()`` returns while :func:`use_client` routes them (see there)
_routed_client: Any | None = None
_routing_lock = threading.RLock()


@contextlib.contextmanager
def use_client(client: Any) -> Iterator[Any]:
    """Within the block, every S3 client this package makes is ``client`` (an Airflow connection's).

    Code that opens storage by URI (the planner, the finalizer) never sees credentials: the
    Airflow glue routes it to the client its connection built, and nothing is written to
    ``os.environ``. Process-wide on purpose, not a context variable: the planner reads ranges from
    a thread pool, whose threads would not inherit one. Airflow runs one task per process; a nested
    block restores what it found.
    """
    global _routed_client
    with _routing_lock:
        saved, _routed_client = _routed_client, client
    try:
        yield client
    finally:
        with _routing_lock:
            _routed_client = saved


def make_client() -> Any:
    """The routed client (:func:`use_client`), else a boto3 S3 client from the environment's
    credentials (boto3 itself honours AWS_ENDPOINT_URL)."""
    if _routed_client is not None:
        return _routed_client
    try:
        return boto3.session.Session().client("s3", config=client_config())
    except botocore.exceptions.BotoCoreError as exc:
        raise StorageError(
            f"cannot create an S3 client: {exc}; check AWS_DEFAULT_REGION, AWS_ENDPOINT_URL and credentials"
        ) from exc


class S3Storage:
    """Objects under ``s3://bucket/prefix``; a key ``a/b.jsonl`` is the object ``prefix/a/b.jsonl``.

    ``client`` lets the Airflow glue pass the one its connection built (``S3Hook.get_conn()``);
    without it, a client is made from the environment. ``page_size`` bounds each listing request.
    """

    def __init__(
        self, bucket: str, prefix: str = "", *, client: Any | None = None, page_size: int = 1000
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigurationError(
                f"invalid S3 bucket name {bucket!r}: use s3://BUCKET/PREFIX", bucket=bucket
            )
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ConfigurationError(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {page_size}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix, base_uri=f"s3://{bucket}")
        self.bucket = bucket
        self.prefix = prefix
        self.page_size = page_size
        self._client = client if client is not None else make_client()

    def __repr__(self) -> str:
        return f"S3Storage({self.base_uri!r})"

    @property
    def base_uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._object_key(key)}"

    def put_bytes(self, key: str, data: bytes) -> str:
        object_key = self._object_key(key)
        uri = self.uri(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=object_key, Body=data)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, "write", uri, self.bucket) from exc
        return uri

    def put_file(self, key: str, source: str | os.PathLike[str]) -> str:
        """Upload the file ``source`` to ``key`` (as :meth:`put_stream`: multipart in 8 MiB parts for
        a large file, so memory stays bounded); the object appears whole or not at all."""
        with open(source, "rb") as stream:
            return self.put_stream(key, stream)

    def put_stream(self, key: str, stream: BinaryIO) -> str:
        """Upload what is left in ``stream`` to ``key`` (boto3's managed transfer, as ``put_file``)."""
        object_key = self._object_key(key)
        uri = self.uri(key)
        try:
            self._client.upload_fileobj(stream, self.bucket, object_key)
        except boto3.exceptions.S3UploadFailedError as exc:
            raise StorageError(
                f"cannot upload {uri}: {exc}; check the bucket and credentials", uri=uri
            ) from exc
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, "write", uri, self.bucket) from exc
        return uri

    def create_bytes(self, key: str, data: bytes) -> str:
        object_key = self._object_key(key)
        uri = self.uri(key)
        try:
            # S3 answers 409 ConditionalRequestConflict while another conditional write to the same
            # key is in flight; that write may still fail, so retry (bounded, jittered) to learn who won.
            for attempt in Retrying(
                retry=retry_if_exception(_is_conditional_conflict),
                stop=stop_after_attempt(5),
                wait=wait_random_exponential(multiplier=0.05, max=2),
                reraise=True,
            ):
                with attempt:
                    self._client.put_object(Bucket=self.bucket, Key=object_key, Body=data, IfNoneMatch="*")
        except botocore.exceptions.ClientError as exc:
            if not _is_precondition_failed(exc):
                raise _translate(exc, "create", uri, self.bucket) from exc
            # botocore retries a put whose response was lost; if that first try landed, the 412 is our
            # own object. Identical bytes mean this call created it.
            if _retry_attempts(exc) > 0 and self._same_bytes(key, data):
                return uri
            raise ObjectExists(
                f"{uri} already exists; conditional create refused to overwrite it (another writer won)",
                uri=uri,
            ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise _translate(exc, "create", uri, self.bucket) from exc
        return uri

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and the ETag that came with them, the version :meth:`put_bytes_if` compares."""
        uri = self.uri(key)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._object_key(key))
            with response["Body"] as body:
                return bytes(body.read()), str(response["ETag"])
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, "read", uri, self.bucket) from exc

    def put_bytes_if(self, key: str, data: bytes, version: str | None) -> str:
        """Replace the object with ``data`` only if its ETag is still ``version`` (``If-Match``;
        ``None``: only if there is none, ``If-None-Match: *``), else raise ``ObjectChanged``.

        S3 checks the condition and writes in one step. A 409 (another conditional write to the key
        in flight) and a 404 (the object was deleted) are conflicts too. An S3 API that ignores
        ``If-Match`` gives no protection: check yours supports conditional writes.
        """
        if version is None:
            try:
                return self.create_bytes(key, data)
            except ObjectExists as exc:
                raise ObjectChanged(str(exc), uri=self.uri(key)) from exc
        uri = self.uri(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._object_key(key), Body=data, IfMatch=version)
        except botocore.exceptions.ClientError as exc:
            lost = _is_precondition_failed(exc) or _is_conditional_conflict(exc)
            if not lost and _error_code(exc) not in _NOT_FOUND_CODES:
                raise _translate(exc, "write", uri, self.bucket) from exc
            # botocore retries a put whose response was lost; if that first try landed, the 412 is
            # our own write
            if _is_precondition_failed(exc) and _retry_attempts(exc) > 0 and self._same_bytes(key, data):
                return uri
            raise ObjectChanged(
                f"{uri} changed since it was read (no longer ETag {version}); read it again and retry"
                " the change",
                uri=uri,
            ) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise _translate(exc, "write", uri, self.bucket) from exc
        return uri

    def get_bytes(self, key: str) -> bytes:
        uri = self.uri(key)
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._object_key(key))
            with response["Body"] as body:
                return bytes(body.read())
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, "read", uri, self.bucket) from exc

    def read_range(self, key: str, start: int, end: int) -> bytes:
        uri = self.uri(key)
        validate_range(start, end, uri=uri)
        if start == end:
            self.size(key)  # same ObjectNotFound as a non-empty range
            return b""
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=self._object_key(key), Range=f"bytes={start}-{end - 1}"
            )
            with response["Body"] as body:
                return bytes(body.read())
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) == "InvalidRange":  # start at or past the end: an empty slice
                return b""
            raise _translate(exc, "read", uri, self.bucket) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise _translate(exc, "read", uri, self.bucket) from exc

    def open_read(self, key: str) -> BinaryIO:
        raw = _S3RawReader(self._client, self.bucket, self._object_key(key), self.uri(key))
        return io.BufferedReader(raw, buffer_size=CHUNK_SIZE)

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def version(self, key: str) -> tuple[object, ...]:
        """Size, ETag and version ID (on a versioned bucket): an object replaced by one of the same
        size with other bytes has another ETag."""
        head = self._head(key)
        return (int(head["ContentLength"]), head.get("ETag"), head.get("VersionId"))

    def _head(self, key: str) -> dict[str, Any]:
        uri = self.uri(key)
        try:
            return dict(self._client.head_object(Bucket=self.bucket, Key=self._object_key(key)))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, "stat", uri, self.bucket) from exc

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        uri = self.uri(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._object_key(key))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            if isinstance(exc, botocore.exceptions.ClientError) and _error_code(exc) in _NOT_FOUND_CODES:
                return
            raise _translate(exc, "delete", uri, self.bucket) from exc

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix, base_uri=self.base_uri)
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=base + prefix, PaginationConfig={"PageSize": self.page_size}
        )
        try:
            for page in pages:
                for entry in page.get("Contents", ()):
                    yield entry["Key"][len(base) :]
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise _translate(exc, "list", self.base_uri + "/" + prefix, self.bucket) from exc

    def _object_key(self, key: str) -> str:
        validate_key(key, base_uri=self.base_uri)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _same_bytes(self, key: str, data: bytes) -> bool:
        try:
            return self.get_bytes(key) == data
        except StorageError:
            return False


class _S3RawReader(io.RawIOBase):
    """A seekable raw stream over one object that resumes with a ranged GET if the body breaks off.

    Resumed reads carry ``If-Match`` with the first response's ETag, so an object replaced mid-read
    fails loudly instead of splicing two versions.
    """

    def __init__(self, client: Any, bucket: str, key: str, uri: str) -> None:
        super().__init__()
        self._client = client
        self._bucket = bucket
        self._key = key
        self._uri = uri
        self._pos = 0
        self._body: Any = None
        self._etag: str | None = None
        self._size: int | None = None
        self._open_body()  # fail now, not on first read, when the object is missing

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            target = offset
        elif whence == io.SEEK_CUR:
            target = self._pos + offset
        elif whence == io.SEEK_END:
            target = self._object_size() + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if target < 0:
            raise ValueError(f"negative seek position {target}")
        if target != self._pos:
            self._close_body()
            self._pos = target
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if len(view) == 0:
            return 0
        for resume in range(STREAM_RESUMES + 1):
            try:
                if self._body is None:
                    if self._size is not None and self._pos >= self._size:
                        return 0
                    self._open_body()
                chunk = self._body.read(len(view))
                break
            except _STREAM_ERRORS as exc:
                self._close_body()
                if resume == STREAM_RESUMES:
                    raise StorageError(
                        f"reading {self._uri} broke off at byte {self._pos} {STREAM_RESUMES + 1} times:"
                        f" {exc}; check the network and retry",
                        uri=self._uri,
                    ) from exc
        n = len(chunk)
        view[:n] = chunk
        self._pos += n
        return n

    def close(self) -> None:
        self._close_body()
        super().close()

    def _object_size(self) -> int:
        if self._size is None:
            self._open_body()
        assert self._size is not None
        return self._size

    def _open_body(self) -> None:
        arguments: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
        if self._pos > 0:
            arguments["Range"] = f"bytes={self._pos}-"
        if self._etag is not None:
            arguments["IfMatch"] = self._etag
        try:
            response = self._client.get_object(**arguments)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc) == "InvalidRange":  # positioned at or past the end
                self._body = io.BytesIO(b"")
                return
            if _is_precondition_failed(exc):
                raise StorageError(
                    f"{self._uri} was replaced while it was being read; rerun with the new object",
                    uri=self._uri,
                ) from exc
            raise _translate(exc, "read", self._uri, self._bucket) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise _translate(exc, "read", self._uri, self._bucket) from exc
        self._body = response["Body"]
        self._etag = self._etag or response.get("ETag")
        if self._size is None:
            content_range = response.get("ContentRange")  # "bytes 10-99/100"
            if content_range and "/" in content_range:
                self._size = int(content_range.rsplit("/", 1)[1])
            else:
                self._size = int(response["ContentLength"]) + self._pos

    def _close_body(self) -> None:
        if self._body is not None:
            # Closing a broken connection must not mask the error that broke it.
            with contextlib.suppress(Exception):
                self._body.close()
            self._body = None


def _error_code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _retry_attempts(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0))


def _is_precondition_failed(exc: BaseException) -> bool:
    return isinstance(exc, botocore.exceptions.ClientError) and (
        _error_code(exc) == "PreconditionFailed" or _status(exc) == 412
    )


def _is_conditional_conflict(exc: BaseException) -> bool:
    return isinstance(exc, botocore.exceptions.ClientError) and (
        _error_code(exc) == "ConditionalRequestConflict" or _status(exc) == 409
    )


def _translate(exc: Exception, action: str, uri: str, bucket: str) -> StorageError:
    """A one-line ``StorageError`` (or ``ObjectNotFound``) naming the URI and the likely fix."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code = _error_code(exc)
        if code in _NOT_FOUND_CODES:
            return ObjectNotFound(f"{uri} does not exist; check the URI", uri=uri)
        if code == "NoSuchBucket":
            return StorageError(
                f"bucket {bucket!r} does not exist ({uri}); create it or fix the URI", uri=uri
            )
        if code in _DENIED_CODES:
            return StorageError(
                f"access to {uri} denied ({code}); check the AWS credentials or the connection's permissions",
                uri=uri,
            )
        message = exc.response.get("Error", {}).get("Message", "")
        return StorageError(
            f"S3 {action} of {uri} failed: {code} {message}; retry or check the bucket", uri=uri
        )
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return StorageError(
            f"no AWS credentials to {action} {uri}; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or use an"
            " Airflow AWS connection",
            uri=uri,
        )
    return StorageError(
        f"cannot {action} {uri}: {exc}; check the network, AWS_ENDPOINT_URL and AWS_DEFAULT_REGION", uri=uri
    )
