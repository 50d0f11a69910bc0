"""``cut_contiguous`` (NumPy, per chunk) cuts exactly as the sequential loop it replaced.

The loop is kept here as the reference: a running sum in item order, each item in the bucket of
its work's midpoint, a new range where the bucket changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.packing import _merge_small, cut_contiguous, cut_contiguous_chunks


def reference_cut(
    work_seconds: Sequence[float], *, target_seconds: float, max_shards: int = 1024, min_records: int = 1
) -> list[tuple[int, int]]:
    """The loop of ``core.packing.cut_contiguous`` before it was vectorised (commit 9735022)."""
    n = len(work_seconds)
    if n == 0:
        return []
    total = math.fsum(work_seconds)
    if total <= 0.0:
        weights: Sequence[float] = [1.0] * n
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


def _chunked(work: list[float], sizes: list[int]) -> list[np.ndarray]:
    chunks, start = [], 0
    for size in sizes:
        chunks.append(np.array(work[start : start + size], dtype=np.float64))
        start += size
    chunks.append(np.array(work[start:], dtype=np.float64))
    return chunks


_work = st.one_of(
    st.floats(min_value=0, max_value=1e4, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 0.1, 0.5, 1.0, 3.0, 1e12]),
)


@settings(max_examples=600, deadline=None)
@given(
    work=st.lists(_work, max_size=300),
    target=st.one_of(st.floats(min_value=1e-3, max_value=1e5), st.sampled_from([0.1, 0.5, 1.0, 3.0])),
    max_shards=st.integers(1, 60),
    min_records=st.integers(1, 5),
    sizes=st.lists(st.integers(0, 40), max_size=8),
)
def test_cut_equals_the_sequential_loop(
    work: list[float], target: float, max_shards: int, min_records: int, sizes: list[int]
) -> None:
    expected = reference_cut(work, target_seconds=target, max_shards=max_shards, min_records=min_records)
    kwargs = {"target_seconds": target, "max_shards": max_shards, "min_records": min_records}
    assert cut_contiguous(work, **kwargs) == expected  # type: ignore[arg-type]
    chunks = _chunked(work, sizes)
    assert cut_contiguous_chunks(lambda: iter(chunks), **kwargs) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(3))
def test_cut_equals_the_loop_on_a_hundred_thousand_items(seed: int) -> None:
    """Long runs, where the running sum's rounding matters, near and far from the shard limit."""
    rng = np.random.default_rng(seed)
    work = (rng.exponential(1.0, 100_000) * rng.choice([1e-3, 1.0, 1e3])).tolist()
    chunks = _chunked(work, [65_536])
    for target, max_shards in ((500.0, 1024), (7.0, 100_000), (1e9, 3), (sum(work) / 64, 64)):
        expected = reference_cut(work, target_seconds=target, max_shards=max_shards)
        got = cut_contiguous_chunks(lambda: iter(chunks), target_seconds=target, max_shards=max_shards)
        assert got == expected


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf])
def test_cut_refuses_nan_negative_and_infinite_work_in_any_chunk(bad: float) -> None:
    chunks = [np.array([1.0, 2.0]), np.array([3.0, bad, 1.0])]
    with pytest.raises(ValueError, match="estimates must be finite and >= 0"):
        cut_contiguous_chunks(lambda: iter(chunks), target_seconds=1)
