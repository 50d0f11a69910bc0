"""Calibration: rates learned from committed microbatches, and Spot availability."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.calibration import (
    AvailabilityEstimate,
    Calibration,
    RateSample,
    calibrate,
    completion_share,
    prior_tokens_per_s,
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
    with pytest.raises(KeyError, match="known"):
        cal.estimate("nope")


def test_calibrate_compares_the_measured_rate_with_the_nominal_one_for_the_same_token_mix() -> None:
    samples = [RateSample("spot", 10, 4000, 1000, 10.0)] * 40  # 500 tokens/s, 20 % completion
    assert completion_share(samples) == pytest.approx(0.2)
    cal = calibrate([SPOT], samples)
    est = cal.estimate("spot")
    assert est.prior_tokens_per_s == pytest.approx(prior_tokens_per_s(SPOT, 0.2))
    assert est.measured and est.samples == 40 and est.busy_s == pytest.approx(400)
    assert est.slowdown == pytest.approx(prior_tokens_per_s(SPOT, 0.2) / 500, rel=0.05)
    untouched = calibrate([SPOT], []).estimate("spot")
    assert not untouched.measured and untouched.slowdown == 1.0


def test_availability_and_spell_length() -> None:
    def availability(history: list[int], workers: int, prior: float = 0.5) -> float:
        est = AvailabilityEstimate(prior=prior)
        for cap in history:
            est = est.observe(cap, workers, 300 / 3600)
        return est.value

    assert availability([], 1, prior=0.4) == pytest.approx(0.4)
    assert availability([1] * 500, 1) > 0.9
    assert availability([1, 0] * 500, 2) < 0.3
    est = AvailabilityEstimate(prior_run_hours=1.0)
    for cap in [1, 1, 0] * 50:
        est = est.observe(cap, 1, 0.1)
    # Gamma-Poisson: the 1 h prior (worth 1 h of Spot) fades behind 50 spells of 0.2 h
    assert est.run_hours == pytest.approx(0.2, rel=0.1)
    assert est.spell_end_rate == pytest.approx((1.0 + est.spell_ends) / (1.0 + est.spot_hours))


def test_spell_rate_posterior_starts_at_the_prior_and_learns_the_pool() -> None:
    prior = AvailabilityEstimate(prior_run_hours=2.0, run_prior_hours=4.0)
    assert prior.run_hours == pytest.approx(2.0)
    # 6 h of Spot in 12 spells of 0.5 h, no forgetting: (4/2 + 12) / (4 + 6) = 1.4 per hour
    est = AvailabilityEstimate(prior_run_hours=2.0, run_prior_hours=4.0, half_life_hours=1e9)
    for _ in range(12):
        est = est.observe(1, 1, 0.5).observe(0, 1, 0.25)
    assert est.spell_end_rate == pytest.approx(1.4)
    assert est.run_hours == pytest.approx(1 / 1.4)
    with pytest.raises(ValueError):
        AvailabilityEstimate(run_prior_hours=0.0)
