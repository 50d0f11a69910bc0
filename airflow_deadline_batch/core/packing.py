"""Shard sizing and cutting (docs/design.md §5).

A shard is a contiguous run of records whose expected duration is near Young's optimum
``sqrt(2 · C · M)`` (checkpoint cost ``C``, mean time between interruptions ``M``), so that a
preemption redoes little work while commits stay cheap, and never longer than the recovery
reserve, so that one lost shard cannot by itself miss the deadline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["cut_contiguous", "microbatch_count", "microbatch_order", "target_shard_seconds"]


def target_shard_seconds(
    *, checkpoint_cost_s: float, mtbi_s: float, recovery_reserve_s: float, min_s: float = 30.0
) -> float:
    """Expected duration a shard should have: ``sqrt(2·C·M)``, capped by the reserve, at least ``min_s``.

    ``mtbi_s = inf`` (no preemptions expected) gives the cap.
    """
    if checkpoint_cost_s < 0 or mtbi_s <= 0 or recovery_reserve_s <= 0 or min_s <= 0:
        raise ValueError(
            "target_shard_seconds needs checkpoint_cost_s >= 0 and mtbi_s, recovery_reserve_s, min_s > 0"
        )
    young = math.sqrt(2.0 * checkpoint_cost_s * mtbi_s) if math.isfinite(mtbi_s) else math.inf
    return max(min_s, min(young, recovery_reserve_s))


def cut_contiguous(
    work_seconds: Sequence[float], *, target_seconds: float, max_shards: int = 1024, min_records: int = 1
) -> list[tuple[int, int]]:
    """Cut items into contiguous half-open ranges whose work is near ``target_seconds``.

    The ranges cover every index once, in order, none is empty, and there are at most
    ``max_shards`` of them (the target grows when the total needs it). Each item goes to the
    shard its work's midpoint falls in, so a shard's work is within one item of the target and
    no item is ever split. Ranges with fewer than ``min_records`` items are merged into their
    neighbour. O(n).
    """
    if target_seconds <= 0 or not math.isfinite(target_seconds):
        raise ValueError(f"target_seconds must be a finite number > 0, got {target_seconds}")
    if max_shards < 1 or min_records < 1:
        raise ValueError("max_shards and min_records must be >= 1")
    n = len(work_seconds)
    if n == 0:
        return []
    lowest = min(work_seconds)
    if lowest < 0 or math.isnan(lowest):
        raise ValueError(f"work_seconds has a negative or NaN value ({lowest}); estimates must be >= 0")
    total = math.fsum(work_seconds)
    if total <= 0.0:
        weights: Sequence[float] = [1.0] * n  # no work estimate: cut by record count
        total = float(n)
    else:
        weights = work_seconds
    target = max(target_seconds, total / max_shards)
    last_bucket = max_shards - 1
    bounds: list[tuple[int, int]] = []
    start = 0
    current = 0
    acc = 0.0
    for i, w in enumerate(weights):
        bucket = int((acc + 0.5 * w) / target)
        if bucket > last_bucket:
            bucket = last_bucket
        if bucket != current and i > start:
            bounds.append((start, i))
            start = i
        current = bucket
        acc += w
    bounds.append((start, n))
    if min_records > 1 and len(bounds) > 1:
        bounds = _merge_small(bounds, min_records)
    return bounds


def _merge_small(bounds: list[tuple[int, int]], min_records: int) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in bounds:
        if merged and merged[-1][1] - merged[-1][0] < min_records:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    if len(merged) > 1 and merged[-1][1] - merged[-1][0] < min_records:
        tail = merged.pop()
        merged[-1] = (merged[-1][0], tail[1])
    return merged


def microbatch_order(lengths: Sequence[int]) -> list[int]:
    """Positions sorted by length, ties by position: the length-aware order inside a shard."""
    return sorted(range(len(lengths)), key=lengths.__getitem__)


def microbatch_count(n_records: int, size: int) -> int:
    """Number of microbatches of ``size`` records (the last one may be short)."""
    if size < 1:
        raise ValueError(f"microbatch size must be >= 1, got {size}")
    if n_records < 0:
        raise ValueError(f"n_records must be >= 0, got {n_records}")
    return -(-n_records // size)
