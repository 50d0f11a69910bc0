"""Turn URIs (a local path, ``file://`` or ``s3://``) into storages and keys."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Any

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.storage.base import ObjectStorage, validate_key
from airflow_deadline_batch.storage.local import LocalStorage

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_storage(base_uri: str, **s3_options: Any) -> ObjectStorage:
    """A storage rooted at ``base_uri``: a local path, ``file:///path`` or ``s3://bucket/prefix``.

    ``s3_options`` (``client``, ``page_size``) go to :class:`S3Storage` and are ignored for local
    storage, so callers can pass them whatever URI the user chose.
    """
    scheme, rest = _split_scheme(base_uri)
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        return _s3_storage(bucket, prefix, base_uri, **s3_options)
    return LocalStorage(_local_path(scheme, rest, base_uri))


def open_uri(uri: str, **s3_options: Any) -> tuple[ObjectStorage, str]:
    """Split the URI of one object into a storage rooted at its parent and the object's key."""
    scheme, rest = _split_scheme(uri)
    if rest.endswith("/"):
        raise ConfigurationError(f"{uri} names a folder, not an object; give the URI of a file", uri=uri)
    if scheme == "s3":
        bucket, _, path = rest.partition("/")
        if not path:
            raise ConfigurationError(f"{uri} names a bucket, not an object; use s3://BUCKET/KEY", uri=uri)
        validate_key(path, base_uri=f"s3://{bucket}")
        parent, _, name = path.rpartition("/")
        return _s3_storage(bucket, parent, uri, **s3_options), name
    local = _local_path(scheme, rest, uri)
    validate_key(local.name, base_uri=str(local.parent))
    return LocalStorage(local.parent), local.name


def join_uri(base: str, *parts: str) -> str:
    """``base`` and ``parts`` joined by single slashes: ``join_uri("s3://b/out/", "j-1", "m.json")``."""
    match = _SCHEME.match(base)
    head = match.group(0) if match else ""
    path = base[len(head) :]
    # Keep a root ("/" or "file:///") while dropping other trailing slashes.
    joined = path.rstrip("/") or ("/" if path.startswith("/") else "")
    for part in parts:
        part = part.strip("/")
        if part:
            joined = f"{joined.rstrip('/')}/{part}" if joined else part
    return head + joined


def _split_scheme(uri: str) -> tuple[str, str]:
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigurationError("empty storage URI: give a local path, file:///path or s3://bucket/prefix")
    match = _SCHEME.match(uri)
    if match is None:
        return "", uri
    scheme = match.group(1).lower()
    if scheme not in ("s3", "file"):
        raise ConfigurationError(
            f"unsupported storage URI {uri}: use a local path, file:///path or s3://bucket/prefix", uri=uri
        )
    return scheme, uri[match.end() :]


def _local_path(scheme: str, rest: str, uri: str) -> Path:
    if "\x00" in uri:
        raise ConfigurationError(f"invalid path {uri!r}: remove the NUL character", uri=uri)
    if scheme == "":
        return Path(rest).expanduser().absolute()
    host, _, path = rest.partition("/")
    if host not in ("", "localhost"):
        raise ConfigurationError(
            f"file URI {uri} names host {host!r}; use file:///absolute/path for this machine", uri=uri
        )
    return Path("/" + urllib.parse.unquote(path))


def _s3_storage(bucket: str, prefix: str, uri: str, **s3_options: Any) -> ObjectStorage:
    if not bucket:
        raise ConfigurationError(f"S3 URI {uri} has no bucket; use s3://BUCKET/PREFIX", uri=uri)
    from airflow_deadline_batch.storage.s3 import S3Storage  # boto3 only when S3 is used

    return S3Storage(bucket, prefix, **s3_options)
