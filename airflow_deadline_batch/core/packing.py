"""Shard sizing and cutting (docs/design.md §5).

A shard is a contiguous run of records whose expected duration is near Young's optimum
``sqrt(2 · C · M)`` (checkpoint cost ``C``, mean time between interruptions ``M``), so that a
preemption redoes little work while commits stay cheap, and never longer than the recovery
reserve, so that one lost shard cannot by itself miss the deadline.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = [
    "cut_contiguous",
    "cut_contiguous_chunks",
    "microbatch_count",
    "microbatch_order",
    "target_shard_seconds",
]


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
    work_seconds: Sequence[float] | np.ndarray,
    *,
    target_seconds: float,
    max_shards: int = 1024,
    min_records: int = 1,
) -> list[tuple[int, int]]:
    """Cut items into contiguous half-open ranges whose work is near ``target_seconds``.

    The ranges cover every index once, in order, none is empty, and there are at most
    ``max_shards`` of them (the target grows when the total needs it). Each item goes to the
    shard its work's midpoint falls in, so a shard's work is within one item of the target and
    no item is ever split. Ranges with fewer than ``min_records`` items are merged into their
    neighbour. :func:`cut_contiguous_chunks` over one array.
    """
    values = np.asarray(work_seconds, dtype=np.float64)
    return cut_contiguous_chunks(
        lambda: iter((values,)), target_seconds=target_seconds, max_shards=max_shards, min_records=min_records
    )


#: a float sum of n >= 0 values is within n * 2**-53 of the exact one; this margin covers 10**9 values
_SUM_MARGIN = 1e-6


def cut_contiguous_chunks(
    chunks: Callable[[], Iterable[np.ndarray]],
    *,
    target_seconds: float,
    max_shards: int = 1024,
    min_records: int = 1,
) -> list[tuple[int, int]]:
    """:func:`cut_contiguous` of the items that ``chunks()`` yields as float64 arrays, in order.

    ``chunks`` is called for each of two passes (a spilled column is read back twice; memory is
    one chunk). The cut is that of the sequential rule: a running sum ``acc`` in item order, item
    ``i`` in bucket ``int((acc + 0.5 * w) / target)`` (at most ``max_shards - 1``), a new range
    where the bucket changes. The bucket never decreases (work is >= 0 and rounding is
    monotonic), so the rule is computed per chunk with NumPy: ``np.add.accumulate`` adds in
    order, as the loop did, and the other operations are the same IEEE ones, so the cut is the
    loop's, bit for bit (``tests/unit/test_packing.py`` holds the two equal).
    """
    if target_seconds <= 0 or not math.isfinite(target_seconds):
        raise ValueError(f"target_seconds must be a finite number > 0, got {target_seconds}")
    if max_shards < 1 or min_records < 1:
        raise ValueError("max_shards and min_records must be >= 1")
    n = 0
    highest = 0.0
    rough_total = 0.0
    for chunk in chunks():
        if len(chunk):
            n += len(chunk)
            low, high = float(chunk.min()), float(chunk.max())  # NaN if the chunk has one
            if not low >= 0 or not math.isfinite(high):
                raise ValueError(
                    f"work_seconds has a negative, NaN or infinite value ({low if not low >= 0 else high}); "
                    "estimates must be finite and >= 0"
                )
            highest = max(highest, high)
            rough_total += float(chunk.sum())
    if n == 0:
        return []
    by_count = highest <= 0.0  # no work estimate: cut by record count
    if by_count:
        target = max(target_seconds, float(n) / max_shards)
    elif rough_total * (1 + _SUM_MARGIN) / max_shards < target_seconds:
        target = target_seconds  # the exact total cannot raise the target: no need to compute it
    else:
        total = math.fsum(itertools.chain.from_iterable(chunk.tolist() for chunk in chunks()))
        target = max(target_seconds, total / max_shards)
    last_bucket = float(max_shards - 1)
    starts = [0]
    acc = 0.0
    previous = -1  # the bucket of the item before the chunk; none before the first item
    offset = 0
    for chunk in chunks():
        if not len(chunk):
            continue
        weights = np.ones(len(chunk)) if by_count else chunk
        running = np.add.accumulate(np.concatenate(([acc], weights)))  # running[k]: the sum before item k
        buckets = np.minimum((running[:-1] + 0.5 * weights) / target, last_bucket).astype(np.int64)
        before = np.concatenate(([previous if previous >= 0 else buckets[0]], buckets[:-1]))
        starts.extend((np.flatnonzero(buckets != before) + offset).tolist())
        acc = float(running[-1])
        previous = int(buckets[-1])
        offset += len(chunk)
    bounds = list(zip(starts, [*starts[1:], n], strict=True))
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
