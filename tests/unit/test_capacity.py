"""Capacity math: the GPUs a window needs agree with admission on the same pools and policy."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from airflow_deadline_batch.core.capacity import capacity, gpus_needed
from airflow_deadline_batch.core.estimate import WorkSummary
from airflow_deadline_batch.core.feasibility import AdmissionPolicy, assess, work_seconds_on
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec

NOW = dt.datetime(2026, 11, 30, 20, 0, tzinfo=dt.timezone.utc)
WORK = WorkSummary(
    records=10_000_000,
    invalid=0,
    lines=10_000_000,
    prompt_tokens=8_000_000_000,
    output_tokens=1_000_000_000,
    gpu_seconds=0.0,
)
SPOT = PoolSpec(
    name="spot",
    kind=PoolKind.SPOT,
    gpus=8,
    prefill_tokens_per_s=20_000.0,
    decode_tokens_per_s=1_500.0,
    startup_seconds=120.0,
    queue_wait_seconds=60.0,
    preemptions_per_hour=0.5,
)
ON_DEMAND = PoolSpec(name="od", kind=PoolKind.ON_DEMAND, gpus=8, price_per_gpu_hour=3.0)


def test_gpu_hours_and_tokens_per_pool() -> None:
    room = capacity(WORK, (SPOT, ON_DEMAND), now=NOW, deadline=NOW + dt.timedelta(hours=8))
    assert (room.prompt_tokens, room.output_tokens, room.window_s) == (8_000_000_000, 1_000_000_000, 28_800.0)
    hours = 8e9 / 20_000 / 3600 + 1e9 / 1_500 / 3600
    assert [p.gpu_hours for p in room.pools] == [pytest.approx(hours), pytest.approx(hours)]
    spot = room.pools[0]
    assert spot.gpus_for_half_window is not None and spot.gpus_for_window is not None
    assert spot.gpus_for_half_window >= 2 * spot.gpus_for_window - 1
    payload = room.to_dict()
    assert payload["pools"][0]["pool"] == "spot" and payload["window_s"] == 28_800.0
    assert any("half of it (4h00m)" in line for line in room.lines())


@pytest.mark.parametrize("hours", [1, 4, 8, 24])
@pytest.mark.parametrize("pool", [SPOT, ON_DEMAND], ids=["spot", "on_demand"])
def test_the_gpus_needed_are_feasible_at_admission(pool: PoolSpec, hours: int) -> None:
    policy = AdmissionPolicy()
    window = hours * 3600.0
    n = gpus_needed(work_seconds_on(WORK, pool), pool, window, policy)
    assert n is not None
    deadline = NOW + dt.timedelta(seconds=window)
    with_n = assess(WORK, (dataclasses.replace(pool, gpus=n),), deadline=deadline, now=NOW, policy=policy)
    assert with_n.options[0].feasible, with_n.summary()
    if n > 1:
        fewer = dataclasses.replace(pool, gpus=n - 1)
        assert not assess(WORK, (fewer,), deadline=deadline, now=NOW, policy=policy).options[0].feasible


def test_a_window_shorter_than_the_startup_needs_more_than_any_gpus() -> None:
    assert gpus_needed(1000.0, SPOT, 100.0, AdmissionPolicy()) is None
    room = capacity(WORK, (SPOT,), now=NOW, deadline=NOW + dt.timedelta(seconds=100))
    assert room.pools[0].gpus_for_window is None
    assert "more than any number of GPUs" in room.lines()[1]
