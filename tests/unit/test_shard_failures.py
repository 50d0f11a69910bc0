"""The shard operators read the worker's class of a failed try and act on it (docs/design.md §6.6)."""

from __future__ import annotations

import datetime as dt
import logging

import orjson
import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowRescheduleException
from kubernetes.client import models as k8s

from airflow_deadline_batch.core.failures import MIN_RESUME_DELAY_S, FailureClass, TryFailure
from airflow_deadline_batch.operators.shard import (
    LocalShardOperator,
    PodOutcome,
    classify_pod,
    failure_class_of,
)


def _pod(code: int, message: str | None = None, reason: str | None = None) -> k8s.V1Pod:
    terminated = k8s.V1ContainerStateTerminated(exit_code=code, message=message, reason=reason)
    status = k8s.V1ContainerStatus(
        name="base",
        image="w",
        image_id="w",
        ready=False,
        restart_count=0,
        state=k8s.V1ContainerState(terminated=terminated),
    )
    return k8s.V1Pod(status=k8s.V1PodStatus(phase="Failed", container_statuses=[status]))


def _message(failure: FailureClass, **kw: object) -> str:
    return orjson.dumps(TryFailure(failure, "S3 unreachable", **kw).to_dict()).decode()  # type: ignore[arg-type]


def test_the_pod_operator_reads_the_class_from_the_termination_message() -> None:
    found = classify_pod(_pod(75, _message(FailureClass.TRANSIENT)))
    assert found.failure is not None and failure_class_of(found) is FailureClass.TRANSIENT
    assert "S3 unreachable" in found.reason
    deterministic = classify_pod(_pod(75, _message(FailureClass.DETERMINISTIC)))
    assert failure_class_of(deterministic) is FailureClass.DETERMINISTIC
    config = classify_pod(_pod(1, _message(FailureClass.CONFIGURATION)))
    assert failure_class_of(config) is FailureClass.CONFIGURATION
    # no message: the exit code and the pod's status decide
    assert failure_class_of(classify_pod(_pod(137))) is FailureClass.PREEMPTED
    assert classify_pod(_pod(0)).outcome is PodOutcome.RETRYABLE  # exit 0 but phase Failed


def _operator(**kw: object) -> LocalShardOperator:
    op = LocalShardOperator(task_id="shard", job_id="j-x", shard_index=0, store_url="sqlite://", **kw)  # type: ignore[arg-type]
    op.transient_in_a_row = lambda: 3  # type: ignore[method-assign]
    op.slack_s = lambda: 3600.0  # type: ignore[method-assign]
    return op


def test_only_deterministic_failures_spend_an_airflow_retry(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    op = _operator()
    before = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(AirflowRescheduleException) as rescheduled:
        op.settle_failure(FailureClass.PREEMPTED, "SIGTERM")
    # never back within a scheduler loop: Airflow 3.3 would fail the next start (docs/airflow.md)
    assert rescheduled.value.reschedule_date >= before + dt.timedelta(seconds=MIN_RESUME_DELAY_S)
    with pytest.raises(AirflowRescheduleException):
        op.settle_failure(FailureClass.TRANSIENT, "S3 unreachable")
    with pytest.raises(AirflowException) as spent:
        op.settle_failure(FailureClass.DETERMINISTIC, "ValueError")
    assert not isinstance(spent.value, AirflowRescheduleException | AirflowFailException)
    with pytest.raises(AirflowFailException, match="bad credentials"):
        op.settle_failure(FailureClass.CONFIGURATION, "bad credentials")
    with pytest.raises(AirflowFailException):
        op.settle_failure(FailureClass.DETERMINISTIC, "poison", shard_failed=True)
    # injected preemptions are keyed by try number: such an operator retries instead
    with pytest.raises(AirflowException) as retried:
        _operator(preempt_tries=[1]).settle_failure(FailureClass.PREEMPTED, "SIGTERM")
    assert not isinstance(retried.value, AirflowRescheduleException)
