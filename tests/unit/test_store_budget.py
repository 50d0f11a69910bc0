"""``StoreBudget``: the workers' default is the store's retry policy as it was; a budget that
could never try, or never wait, is refused with one line."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.store import engine
from airflow_deadline_batch.store.engine import DEFAULT_BUDGET, StoreBudget


def test_the_default_budget_is_the_workers_retry_policy() -> None:
    assert (DEFAULT_BUDGET.connect_timeout_s, DEFAULT_BUDGET.attempts, DEFAULT_BUDGET.pool_timeout_s) == (
        engine.CONNECT_TIMEOUT_S,
        engine.RETRY_ATTEMPTS,
        30.0,
    )
    assert DEFAULT_BUDGET.statement_timeout_s is None


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"attempts": 0}, "attempts >= 1"),
        ({"connect_timeout_s": 0}, "positive timeouts"),
        ({"pool_timeout_s": 0.0}, "positive timeouts"),
        ({"statement_timeout_s": 0.0}, "statement_timeout_s must be > 0 or None"),
        ({"statement_timeout_s": float("nan")}, "statement_timeout_s must be > 0 or None"),
    ],
)
def test_a_budget_that_could_never_try_or_wait_is_refused(fields: dict[str, float], says: str) -> None:
    with pytest.raises(ValueError, match=says) as raised:
        StoreBudget(**fields)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
