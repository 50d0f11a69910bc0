"""Shard sizing and cutting."""

from __future__ import annotations

import math
import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.packing import (
    cut_contiguous,
    microbatch_count,
    microbatch_order,
    target_shard_seconds,
)


def test_target_is_youngs_optimum_within_bounds() -> None:
    young = target_shard_seconds(checkpoint_cost_s=8, mtbi_s=3600, recovery_reserve_s=10_000)
    assert young == pytest.approx(240)  # sqrt(2 * 8 * 3600)
    assert target_shard_seconds(checkpoint_cost_s=8, mtbi_s=3600, recovery_reserve_s=100) == 100
    assert target_shard_seconds(checkpoint_cost_s=0.01, mtbi_s=3600, recovery_reserve_s=100) == 30
    assert target_shard_seconds(checkpoint_cost_s=8, mtbi_s=math.inf, recovery_reserve_s=900) == 900
    with pytest.raises(ValueError):
        target_shard_seconds(checkpoint_cost_s=8, mtbi_s=0, recovery_reserve_s=900)


def check_tiling(bounds: list[tuple[int, int]], n: int) -> None:
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, end), (start, _) in zip(bounds, bounds[1:], strict=False):
        assert end == start
    assert all(e > s for s, e in bounds)


def test_cut_near_target() -> None:
    bounds = cut_contiguous([1.0] * 100, target_seconds=10)
    assert bounds == [(i, i + 10) for i in range(0, 100, 10)]


def test_cut_grows_target_to_respect_max_shards() -> None:
    bounds = cut_contiguous([1.0] * 1000, target_seconds=1, max_shards=7)
    check_tiling(bounds, 1000)
    assert len(bounds) == 7


def test_cut_never_splits_a_heavy_item_and_handles_zero_work() -> None:
    bounds = cut_contiguous([1, 1, 50, 1, 1], target_seconds=3)
    check_tiling(bounds, 5)
    assert bounds == [(0, 2), (2, 3), (3, 5)]
    by_count = cut_contiguous([0.0] * 10, target_seconds=1, max_shards=5)
    assert by_count == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert cut_contiguous([], target_seconds=1) == []


def test_cut_min_records_merges_small_ranges() -> None:
    bounds = cut_contiguous([100, 1, 1, 1, 100, 1], target_seconds=10, min_records=2)
    check_tiling(bounds, 6)
    assert all(e - s >= 2 for s, e in bounds)


def test_cut_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        cut_contiguous([1.0], target_seconds=0)
    with pytest.raises(ValueError):
        cut_contiguous([1.0], target_seconds=1, max_shards=0)
    with pytest.raises(ValueError, match="negative"):
        cut_contiguous([1.0, -1.0], target_seconds=1)


def test_cut_a_million_items() -> None:
    rng = random.Random(3)
    work = array("d", (rng.expovariate(1.0) for _ in range(1_000_000)))
    bounds = cut_contiguous(work, target_seconds=500, max_shards=1024)
    check_tiling(bounds, len(work))
    assert len(bounds) <= 1024
    target = math.fsum(work) / 1024  # the requested 500 s would need too many shards
    heaviest = max(work)
    sums = [math.fsum(work[s:e]) for s, e in bounds]
    assert all(abs(x - target) <= 2 * heaviest for x in sums)


@settings(max_examples=200, deadline=None)
@given(
    work=st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), max_size=200),
    target=st.floats(min_value=0.01, max_value=1e5),
    max_shards=st.integers(1, 50),
    min_records=st.integers(1, 5),
)
def test_cut_covers_every_index_once(
    work: list[float], target: float, max_shards: int, min_records: int
) -> None:
    bounds = cut_contiguous(work, target_seconds=target, max_shards=max_shards, min_records=min_records)
    if not work:
        assert bounds == []
        return
    check_tiling(bounds, len(work))
    assert len(bounds) <= max_shards
    covered = [i for s, e in bounds for i in range(s, e)]
    assert covered == list(range(len(work)))
    if len(bounds) > 1:
        assert all(e - s >= min_records for s, e in bounds)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=100))
def test_microbatch_order_is_a_length_sorted_permutation(lengths: list[int]) -> None:
    order = microbatch_order(lengths)
    assert sorted(order) == list(range(len(lengths)))
    keys = [(lengths[i], i) for i in order]
    assert keys == sorted(keys)


def test_microbatch_count() -> None:
    assert microbatch_count(0, 16) == 0
    assert microbatch_count(16, 16) == 1
    assert microbatch_count(17, 16) == 2
    with pytest.raises(ValueError):
        microbatch_count(5, 0)
