"""Object storage: a local directory or S3, with atomic puts, conditional creates and checksums.

``S3Storage`` is imported lazily (it needs boto3); everything else here is standard library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.storage.base import (
    ObjectStorage,
    check_sha256,
    put_file,
    put_stream,
    sha256_hex,
    sha256_of_stream,
    validate_key,
)
from airflow_deadline_batch.storage.local import LocalStorage
from airflow_deadline_batch.storage.uri import join_uri, open_storage, open_uri

if TYPE_CHECKING:
    from airflow_deadline_batch.storage.s3 import S3Storage as S3Storage

__all__ = [
    "LocalStorage",
    "ObjectStorage",
    "check_sha256",
    "join_uri",
    "open_storage",
    "open_uri",
    "put_file",
    "put_stream",
    "sha256_hex",
    "sha256_of_stream",
    "validate_key",
]


def __getattr__(name: str) -> Any:
    if name == "S3Storage":
        from airflow_deadline_batch.storage.s3 import S3Storage

        return S3Storage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
