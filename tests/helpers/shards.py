"""Shard plans for store tests that need a job of a given shape, not a planned input."""

from __future__ import annotations

from airflow_deadline_batch.store import NewShard


def uniform_shards(count: int, *, microbatches: int, est_work_s: float, lines: int = 10) -> list[NewShard]:
    """``count`` shards of ``lines`` valid records each (10 bytes a line, one after the other), each
    of ``microbatches`` microbatches and ``est_work_s`` of estimated work."""
    return [
        NewShard(
            shard_index=i,
            byte_start=i * lines * 10,
            byte_end=(i + 1) * lines * 10,
            first_line=i * lines + 1,
            line_count=lines,
            records=lines,
            num_microbatches=microbatches,
            input_sha256="0" * 64,
            est_work_s=est_work_s,
        )
        for i in range(count)
    ]
