"""The one classification of failed tries (docs/design.md §6.6): pure, no drivers needed."""

from __future__ import annotations

import errno
import random

import pytest

from airflow_deadline_batch.core.exit_codes import EXIT_RETRYABLE, EXIT_TERMINAL
from airflow_deadline_batch.core.failures import (
    FailureClass,
    TryFailure,
    backoff_s,
    classify_exception,
    classify_exit,
    exit_code_for,
    spends_budget,
)
from airflow_deadline_batch.exceptions import (
    ChecksumMismatch,
    ConfigurationError,
    EngineError,
    LeaseLost,
    StorageError,
    StoreError,
)

C = FailureClass


class _ClientError(Exception):  # botocore's shape: a ``response`` dict
    def __init__(self, code: str) -> None:
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}}


class _PgError(Exception):
    def __init__(self, message: str, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _wrapped(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as caught:
        return caught


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (LeaseLost("fenced"), C.PREEMPTED),
        (ConfigurationError("bad option"), C.CONFIGURATION),
        (ChecksumMismatch("input changed"), C.CONFIGURATION),
        (OSError(errno.ENOSPC, "No space left on device"), C.TRANSIENT),
        (ConnectionResetError(errno.ECONNRESET, "reset"), C.TRANSIENT),
        (TimeoutError("read timed out"), C.TRANSIENT),
        (_ClientError("SlowDown"), C.TRANSIENT),
        (_ClientError("503"), C.TRANSIENT),
        (_ClientError("NoSuchBucket"), C.CONFIGURATION),
        (_ClientError("InvalidAccessKeyId"), C.CONFIGURATION),
        (_PgError("terminating connection due to administrator command", "57P01"), C.TRANSIENT),
        (_PgError("the database system is shutting down", None), C.TRANSIENT),
        (_PgError('password authentication failed for user "adb"', None), C.CONFIGURATION),
        (_PgError('database "nope" does not exist', "3D000"), C.CONFIGURATION),
        (ValueError("engine returned garbage"), C.DETERMINISTIC),
        (EngineError("CUDA error: illegal memory access"), C.DETERMINISTIC),
    ],
)
def test_classify_exception(exc: BaseException, expected: FailureClass) -> None:
    assert classify_exception(exc) is expected


def test_the_cause_chain_is_read() -> None:
    store_down = _wrapped(StoreError("sqlite:///x: commit failed"), _PgError("connection refused", "08001"))
    assert classify_exception(store_down) is C.TRANSIENT
    disk_full = _wrapped(StorageError("cannot write object"), OSError(errno.ENOSPC, "full"))
    assert classify_exception(disk_full) is C.TRANSIENT
    no_bucket = _wrapped(StorageError("cannot write object"), _ClientError("NoSuchBucket"))
    assert classify_exception(no_bucket) is C.CONFIGURATION


def test_an_error_may_carry_its_class() -> None:
    assert classify_exception(StoreError("x", failure="transient")) is C.TRANSIENT


def test_only_deterministic_failures_without_progress_spend_the_budget() -> None:
    assert spends_budget(C.DETERMINISTIC, progressed=False)
    assert not spends_budget(C.DETERMINISTIC, progressed=True)
    for other in (C.PREEMPTED, C.TRANSIENT, C.CONFIGURATION):
        assert not spends_budget(other, progressed=False)


def test_exit_codes() -> None:
    assert exit_code_for(C.CONFIGURATION) == EXIT_TERMINAL
    assert exit_code_for(C.DETERMINISTIC, shard_failed=True) == EXIT_TERMINAL
    for retryable in (C.PREEMPTED, C.TRANSIENT, C.DETERMINISTIC):
        assert exit_code_for(retryable) == EXIT_RETRYABLE
    assert classify_exit(0, signalled_by_launcher=False) is None
    assert classify_exit(-9, signalled_by_launcher=True) is C.PREEMPTED
    assert classify_exit(-9, signalled_by_launcher=False) is C.DETERMINISTIC
    assert classify_exit(137, signalled_by_launcher=True) is C.PREEMPTED
    assert classify_exit(75, signalled_by_launcher=False) is C.TRANSIENT
    assert classify_exit(1, signalled_by_launcher=False) is C.CONFIGURATION


def test_backoff_is_exponential_jittered_capped_and_bounded_by_slack() -> None:
    rng = random.Random(1)
    assert backoff_s(0) == 0.0
    for n in range(1, 12):
        bound = min(30.0, 2.0 ** (n - 1))
        draws = [backoff_s(n, rng=rng) for _ in range(200)]
        assert all(0.0 <= d <= bound for d in draws)
        assert max(draws) > 0.5 * bound  # jittered over the whole range
    assert all(backoff_s(10, slack_s=3.0, rng=rng) <= 3.0 for _ in range(100))
    assert backoff_s(10, slack_s=-5.0, rng=rng) == 0.0


def test_try_failure_round_trips() -> None:
    failure = TryFailure(C.TRANSIENT, "S3 unreachable", claimed=False, progressed=False)
    assert TryFailure.from_dict(failure.to_dict()) == failure
