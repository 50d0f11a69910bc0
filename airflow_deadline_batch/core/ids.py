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
