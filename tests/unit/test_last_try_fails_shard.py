"""A shard task's try that Airflow will not retry fails its shard in the store (s25).

Beside the shards (``plan >> [shards, done]``), the completeness sensor never sees a shard task
fail: when a task's retries were spent while the store still had its shard retryable (a pod that
never scheduled, a worker lost before the store counted its try), the shard stayed pending and the
sensor waited until its timeout. ``_ShardTryMixin.run_try`` now fails the shard in the store
(``ManifestStore.fail_shard``) when its try spends the task's last retry. A try Airflow retries,
a skip, a configuration error (``AirflowFailException``: fixed, then the task cleared), or a shard
the store already committed is left as it is; a store that cannot be written is logged and the
try's own error is raised. A real SQLite store; each try's body raises as the operator's own failure paths do.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.operators.shard import LocalShardOperator
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.commits import commit_rest
from tests.unit.test_pod_spec import job_id as job_id  # noqa: F401 - a fixture (4 shards, SQLite)
from tests.unit.test_pod_spec import store_url as store_url  # noqa: F401 - a fixture

LOST = "shard 1 of job j preempted: worker exit 75; the next try re-decides its pool from the slack left"


def context(try_number: int, max_tries: int) -> dict[str, Any]:
    ti = SimpleNamespace(
        dag_id="d",
        task_id="shard",
        map_index=1,
        try_number=try_number,
        max_tries=max_tries,
        xcom_push=lambda **_: None,
    )
    return {"ti": ti}


def run_failing_try(op: LocalShardOperator, ctx: dict[str, Any], error: BaseException) -> BaseException:
    """Run one try whose body raises ``error``; what leaves ``run_try``."""

    def body() -> Any:
        raise error

    with pytest.raises(BaseException) as raised:
        op.run_try(ctx, body)
    return raised.value


def shard_of(store_url: str, job_id: str) -> Any:
    store = ManifestStore(store_url)
    try:
        return store.get_shard(job_id, 1)
    finally:
        store.close()


@pytest.fixture()
def op(store_url: str, job_id: str) -> LocalShardOperator:
    return LocalShardOperator(
        task_id="shard", job_id=job_id, shard_index=1, store_url=store_url, reschedule_retryable=False
    )


@pytest.mark.parametrize(
    ("try_number", "max_tries", "error"),
    [
        pytest.param(2, 1, AirflowException(LOST), id="last-try"),
        pytest.param(1, 0, AirflowException(LOST), id="no-retries"),
        pytest.param(2, 1, RuntimeError("the store went away mid-try"), id="last-try-any-error"),
    ],
)
def test_a_try_airflow_will_not_retry_fails_its_shard_in_the_store(
    op: LocalShardOperator, store_url: str, job_id: str, try_number: int, max_tries: int, error: BaseException
) -> None:
    assert shard_of(store_url, job_id).state is ShardState.PENDING
    raised = run_failing_try(op, context(try_number, max_tries), error)

    assert raised is error  # the task fails with its own error
    shard = shard_of(store_url, job_id)
    assert shard.state is ShardState.TERMINAL_FAILURE
    assert shard.last_error == f"its Airflow task shard[1] failed for good on try {try_number}: {error}"


@pytest.mark.parametrize(
    ("try_number", "max_tries", "error"),
    [
        pytest.param(1, 1, AirflowException(LOST), id="a-retry-follows"),
        pytest.param(3, 5, RuntimeError("a worker crashed before it counted"), id="retries-left"),
        pytest.param(2, 1, AirflowSkipException("job j is cancelled"), id="skip"),
        # a configuration error: the user fixes it and clears the task, which must find the shard
        pytest.param(2, 1, AirflowFailException("shard 1: configuration: bad image"), id="fail-exception"),
    ],
)
def test_a_try_airflow_retries_or_skips_leaves_its_shard_retryable(
    op: LocalShardOperator, store_url: str, job_id: str, try_number: int, max_tries: int, error: BaseException
) -> None:
    raised = run_failing_try(op, context(try_number, max_tries), error)

    assert raised is error
    shard = shard_of(store_url, job_id)
    assert shard.state is ShardState.PENDING and shard.last_error is None


def test_a_shard_the_store_committed_stays_succeeded_when_its_last_try_fails(
    op: LocalShardOperator, store_url: str, job_id: str
) -> None:
    """The commit landed, then the try was lost: the store is the truth for records."""
    store = ManifestStore(store_url)
    try:
        lease = store.claim_shard(job_id, 1, ttl_s=60, worker="w:1", pool="gpu-spot")
        store.complete_shard(commit_rest(store, lease))
    finally:
        store.close()
    error = AirflowException("the pod was lost after its worker committed")

    assert run_failing_try(op, context(2, 1), error) is error
    assert shard_of(store_url, job_id).state is ShardState.SUCCEEDED


def test_a_store_that_cannot_be_written_does_not_hide_the_tries_own_error(
    op: LocalShardOperator, store_url: str, job_id: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The store goes away during the try (the task now reads an empty one): failing the shard
    is logged, and the task fails with the try's error, not the store's."""
    error = AirflowException(LOST)

    def body() -> Any:
        op.store_url = f"sqlite:///{tmp_path / 'empty.db'}"
        raise error

    with pytest.raises(AirflowException) as raised:
        op.run_try(context(2, 1), body)

    assert raised.value is error
    logged = "".join(capfd.readouterr())  # the task's logger, as Airflow's task log gets it
    assert "could not fail it in the store after its task failed for good" in logged
    assert "StoreError" in logged
    assert shard_of(store_url, job_id).state is ShardState.PENDING


def test_a_worker_that_exits_0_with_its_shard_not_committed_fails_its_try(
    store_url: str, job_id: str
) -> None:
    """An engine that ends the process with ``os._exit(0)`` (nothing in the worker can catch it)
    made the worker exit 0 with its shard leased and unfinished, and the task succeeded: before,
    ``_settle_exit`` took exit 0 for done. Now the store decides: the try fails deterministic."""
    op = LocalShardOperator(task_id="shard", job_id=job_id, shard_index=1, store_url=store_url)
    decision = op.decide(None)
    with pytest.raises(AirflowException, match="the worker exited 0 with its shard pending, not committed"):
        op._settle_exit(0, decision)
    assert shard_of(store_url, job_id).state is ShardState.PENDING


def test_a_worker_that_exits_0_with_its_shard_committed_succeeds(store_url: str, job_id: str) -> None:
    op = LocalShardOperator(task_id="shard", job_id=job_id, shard_index=1, store_url=store_url)
    decision = op.decide(None)
    store = ManifestStore(store_url)
    try:
        lease = store.claim_shard(job_id, 1, ttl_s=60, worker="w:1", pool="gpu-spot")
        store.complete_shard(commit_rest(store, lease))
    finally:
        store.close()
    assert op._settle_exit(0, decision) == decision.to_dict()
