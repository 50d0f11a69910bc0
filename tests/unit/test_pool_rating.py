"""``service.planning.rate_pool``: a pool's declared rates moved to what earlier jobs measured."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.calibration import prior_tokens_per_s
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.service.planning import MIN_RATE_BUSY_S, MIN_RATE_COMMITS, rate_pool
from airflow_deadline_batch.store.throughput import MeasuredRate, model_key

POOL = PoolSpec(name="a100", kind=PoolKind.SPOT, prefill_tokens_per_s=20_000.0, decode_tokens_per_s=1_500.0)


def measured(commits: int, busy_s: float, prompt: int = 8_000, completion: int = 2_000) -> MeasuredRate:
    return MeasuredRate(
        pool=POOL.name,
        commits=commits,
        jobs=1,
        prompt_tokens=prompt,
        completion_tokens=completion,
        busy_s=busy_s,
    )


def test_nothing_measured_keeps_the_declared_pool() -> None:
    spec, rating = rate_pool(POOL, None, "vllm:llama")
    assert spec is POOL and rating.source == "declared" and rating.factor == 1.0
    assert rating.measured_tokens_per_s is None and rating.commits == 0


def test_enough_evidence_replaces_the_declared_rate_at_the_measured_mix_of_tokens() -> None:
    history = measured(MIN_RATE_COMMITS, busy_s=10.0)  # 10,000 tokens in 10 s, 20 % completion
    spec, rating = rate_pool(POOL, history, "vllm:llama")
    # compared with the declared rates blended at the same 20 % completion share (harmonic)
    declared = prior_tokens_per_s(POOL, 0.2)
    assert rating.declared_tokens_per_s == pytest.approx(1 / (0.8 / 20_000 + 0.2 / 1_500))
    assert rating.source == "measured" and rating.tokens_per_s == pytest.approx(1_000.0)
    # both rates scale by the same factor, so the pool's rate at that mix is the measured one
    assert prior_tokens_per_s(spec, 0.2) == pytest.approx(1_000.0)
    assert spec.prefill_tokens_per_s / spec.decode_tokens_per_s == pytest.approx(20_000 / 1_500)
    assert rating.factor == pytest.approx(1_000.0 / declared)
    assert (spec.name, spec.kind, spec.price_per_gpu_hour) == (POOL.name, POOL.kind, POOL.price_per_gpu_hour)


@pytest.mark.parametrize(
    ("commits", "busy_s", "weight"),
    [(1, 1.0, 1 / MIN_RATE_COMMITS), (1, MIN_RATE_BUSY_S / 2, 0.5), (MIN_RATE_COMMITS * 3, 1.0, 1.0)],
)
def test_the_measured_rate_weighs_by_commits_or_busy_seconds(
    commits: int, busy_s: float, weight: float
) -> None:
    _, rating = rate_pool(POOL, measured(commits, busy_s), "echo")
    assert rating.weight == pytest.approx(weight)
    expected = 1 / ((1 - weight) / rating.declared_tokens_per_s + weight / (10_000 / busy_s))
    assert rating.tokens_per_s == pytest.approx(expected)


def test_model_keys() -> None:
    assert model_key("echo", None) == "echo" and model_key("vllm", "llama-3-8b") == "vllm:llama-3-8b"
