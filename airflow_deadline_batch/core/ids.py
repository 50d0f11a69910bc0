"""Identifiers: random, path-safe, and free of any user data (record IDs never reach keys or SQL)."""

from __future__ import annotations

import base64
import uuid

#: the shard ID of the planner's validation object (the outcomes of invalid lines)
VALIDATION_SHARD_ID = "validation"


def new_job_id() -> str:
    """``j-`` followed by 20 lowercase base32 characters of a random UUID."""
    return "j-" + base64.b32encode(uuid.uuid4().bytes).decode("ascii").lower()[:20]


def new_attempt_id() -> str:
    """``a-`` followed by a random UUID's hex digits."""
    return "a-" + uuid.uuid4().hex


def shard_id(shard_index: int) -> str:
    """Display form of a shard index, as written in result records and the manifest."""
    return VALIDATION_SHARD_ID if shard_index < 0 else f"{shard_index:05d}"


#: what a rejected job's idempotency key becomes, so that a resubmission with the key is admitted afresh
REJECTED_KEY_MARK = "#rejected-"
#: the length of the ``jobs.idempotency_key`` column
IDEMPOTENCY_KEY_MAX = 255


def check_idempotency_key(key: str) -> None:
    """Refuse a key the store cannot keep, or one that could pass for a rejected job's (one line)."""
    if len(key) > IDEMPOTENCY_KEY_MAX:
        raise ValueError(f"idempotency key: use at most {IDEMPOTENCY_KEY_MAX} characters, got {len(key)}")
    if REJECTED_KEY_MARK in key:
        raise ValueError(f"idempotency key {key[:80]!r}: {REJECTED_KEY_MARK!r} is reserved, pick another key")


def released_key(key: str, job_id: str) -> str:
    """The key a rejected job keeps: ``<key>#rejected-<job_id>``, unique, never equal to a submitted key.

    A long key is cut so that the mark and job ID fit the column; :func:`submitted_key` undoes it.
    """
    suffix = f"{REJECTED_KEY_MARK}{job_id}"
    return key[: IDEMPOTENCY_KEY_MAX - len(suffix)] + suffix


def submitted_key(stored: str) -> str:
    """The key a job was submitted with (a rejected job's key without its ``#rejected-`` mark)."""
    head, mark, tail = stored.rpartition(REJECTED_KEY_MARK)
    return head if mark and tail.startswith("j-") else stored
