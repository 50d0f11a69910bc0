"""Re-reading a planned shard's byte range exactly as the planner read it.

The worker (to generate) and the finalizer (to give unfinished records their terminal outcome)
both need the shard's records; both must parse with the limits the planner used and must refuse
an input that changed since planning.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Protocol

from airflow_deadline_batch.core.records import (
    LineError,
    Record,
    ValidationLimits,
    iter_raw_lines,
    parse_line,
)
from airflow_deadline_batch.exceptions import InputError


class ShardRange(Protocol):
    """What parsing needs of a planned shard (the store's ``ShardRow`` has it)."""

    @property
    def shard_id(self) -> str: ...
    @property
    def byte_start(self) -> int: ...
    @property
    def first_line(self) -> int: ...
    @property
    def records(self) -> int: ...
    @property
    def excluded_lines(self) -> Sequence[int]: ...


def limits_from_config(config: Mapping[str, Any]) -> ValidationLimits:
    """The validation limits the planner recorded in the job's configuration."""
    defaults = ValidationLimits()
    return ValidationLimits(
        max_line_bytes=int(config.get("max_line_bytes") or defaults.max_line_bytes),
        max_prompt_chars=int(config.get("max_prompt_chars") or defaults.max_prompt_chars),
        max_tokens_limit=int(config.get("max_tokens_limit") or defaults.max_tokens_limit),
    )


def parse_shard(data: bytes, shard: ShardRange, limits: ValidationLimits) -> list[Record]:
    """Records of a shard's byte range in line order; a line the planner accepted must still parse."""
    records = list(iter_shard(io.BytesIO(data), shard, limits))
    if len(records) != shard.records:
        raise InputError(
            f"shard {shard.shard_id} has {len(records)} records, the plan says {shard.records}; "
            "the input changed after planning: re-plan the job"
        )
    return records


def iter_shard(stream: BinaryIO, shard: ShardRange, limits: ValidationLimits) -> Iterator[Record]:
    """The records of ``stream`` (the shard's byte range) in line order, one at a time.

    A line the planner accepted must still parse (else :class:`InputError`); the caller checks
    the count against ``shard.records`` once the stream is exhausted.
    """
    excluded = set(shard.excluded_lines)
    for raw in iter_raw_lines(
        stream,
        start_line=shard.first_line,
        start_offset=shard.byte_start,
        max_line_bytes=limits.max_line_bytes,
    ):
        if raw.line in excluded:
            continue
        outcome = parse_line(raw, limits)
        if outcome is None:
            continue
        if isinstance(outcome, LineError):  # never echo the line: it is user data
            raise InputError(
                f"line {outcome.line} of shard {shard.shard_id} no longer parses "
                f"({outcome.code.value}); the input changed after planning: re-plan the job",
                line=outcome.line,
            )
        yield outcome
