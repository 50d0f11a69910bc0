"""Calibration: learned rates, startup, preemption rate, availability and remaining work."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.calibration import (
    AvailabilityEstimate,
    Calibration,
    RateSample,
    observed_availability,
    preemption_rate,
    prior_tokens_per_s,
    re_estimate_remaining,
)
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec

SPOT = PoolSpec(
    name="spot",
    kind=PoolKind.SPOT,
    prefill_tokens_per_s=1000,
    decode_tokens_per_s=100,
    startup_seconds=100,
    preemptions_per_hour=1.0,
)


def test_prior_is_harmonic_blend_of_prefill_and_decode() -> None:
    assert prior_tokens_per_s(SPOT, 0.5) == pytest.approx(1 / (0.5 / 1000 + 0.5 / 100))


def test_rate_converges_to_measurements_and_resists_one_outlier() -> None:
    cal = Calibration.from_specs([SPOT])
    for _ in range(40):
        cal = cal.observe_rate(RateSample("spot", 10, 4000, 1000, 10.0))  # 500 tokens/s
    assert cal.estimate("spot").tokens_per_s == pytest.approx(500, rel=0.05)
    after = cal.observe_rate(RateSample("spot", 10, 4000, 1000, 10_000.0))  # 0.5 tokens/s outlier
    assert after.estimate("spot").tokens_per_s > 300
    assert cal.observe_rate(RateSample("spot", 0, 0, 0, 0.0)) is cal


def test_remaining_work_follows_the_learned_rate() -> None:
    cal = Calibration.from_specs([SPOT])
    before = re_estimate_remaining(1_000_000, cal, "spot")
    for _ in range(40):
        cal = cal.observe_rate(RateSample("spot", 10, 4000, 1000, 10.0))
    assert re_estimate_remaining(1_000_000, cal, "spot") == pytest.approx(2000, rel=0.05)
    assert before != pytest.approx(2000, rel=0.05)


def test_startup_and_preemption_rate() -> None:
    cal = Calibration.from_specs([SPOT]).observe_startup("spot", 200)
    assert cal.estimate("spot").startup_s == pytest.approx(130)
    assert preemption_rate(0, 10.0, 1.0) == pytest.approx(2 / 12)
    assert cal.observe_preemption("spot").estimate("spot").preemptions == 1
    with pytest.raises(KeyError, match="known"):
        cal.estimate("nope")


def test_availability_and_spell_length() -> None:
    assert observed_availability([], 1, 300, prior=0.4) == pytest.approx(0.4)
    assert observed_availability([1] * 500, 1, 300) > 0.9
    assert observed_availability([1, 0] * 500, 2, 300) < 0.3
    est = AvailabilityEstimate(prior_run_hours=1.0)
    for cap in [1, 1, 0] * 50:
        est = est.observe(cap, 1, 0.1)
    assert est.run_hours == pytest.approx(0.2, rel=0.05)
