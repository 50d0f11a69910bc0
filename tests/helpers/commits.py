"""Committing microbatches in store tests: placeholder results unless a test reads a value.

A test that depends on what a commit records (a rate measured from ``elapsed_s`` and the tokens,
progress counted from ``records`` and ``counts``, a golden output's ``uri`` and ``sha256``) passes
that value; every other field keeps the placeholder here, so no test restates the whole call.
"""

from __future__ import annotations

from typing import TypedDict, Unpack

from airflow_deadline_batch.store import Lease, ManifestStore


class Microbatch(TypedDict, total=False):
    """Values for :func:`commit`'s fields, for a test that commits several microbatches alike."""

    uri: str | None
    sha256: str
    records: int
    counts: dict[str, int] | None
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    model_digest: str | None
    pool: str | None


def commit(
    store: ManifestStore,
    lease: Lease,
    seq: int,
    *,
    uri: str | None = None,
    sha256: str = "a" * 64,
    records: int = 1,
    counts: dict[str, int] | None = None,
    prompt_tokens: int = 1,
    completion_tokens: int = 1,
    elapsed_s: float = 0.1,
    model_digest: str | None = None,
    pool: str | None = None,
) -> Lease:
    """Commit microbatch ``seq`` under ``lease``; return the extended lease (cursor ``seq + 1``).

    Placeholders: the worker's object key for the microbatch under ``file:///out`` (nothing is
    written there), a dummy sha256, one record, every record succeeded (``counts`` defaults to
    ``{"succeeded": records}``), one prompt and one completion token, 0.1 s, no model digest, no pool.
    """
    return store.commit_microbatch(
        lease,
        seq=seq,
        uri=uri
        if uri is not None
        else f"file:///out/attempts/{lease.attempt_id}/shard-{lease.shard_index:05d}-mb-{seq:06d}.jsonl",
        sha256=sha256,
        records=records,
        counts=counts if counts is not None else {"succeeded": records},
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        elapsed_s=elapsed_s,
        model_digest=model_digest,
        pool=pool,
    )


def commit_rest(store: ManifestStore, lease: Lease, **fields: Unpack[Microbatch]) -> Lease:
    """Commit every microbatch of the shard from ``lease.cursor`` on, each with the ``fields`` of
    :func:`commit`; return the lease after the last (the shard is not completed)."""
    for seq in range(lease.cursor, lease.num_microbatches):
        lease = commit(store, lease, seq, **fields)
    return lease
