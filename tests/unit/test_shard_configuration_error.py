"""A shard task's try that fails on a configuration error says so in XCom (s26).

After the shards (``plan >> shards >> done``), the completeness sensor fails in the store every
shard whose task failed, unless the task pushed ``CONFIGURATION_ERROR_KEY``: then the user fixes the
error and clears the task, which runs the shard (tests/e2e/test_dags_local.py runs the whole
story). So ``_ShardTryMixin.run_try`` pushes it for an ``AirflowFailException`` of the operator's
configuration paths (another store than the plan's, a worker that says ``configuration``), on any
try, and never for the store's own verdict (``ShardFailedInStore``: the shard is terminal there,
clearing cannot run it) nor for a try that spent the task's retries. A real SQLite store; the task
instance records what is pushed, as Airflow's XCom would hold it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.operators.shard import (
    CONFIGURATION_ERROR_KEY,
    LocalShardOperator,
    ShardFailedInStore,
)
from airflow_deadline_batch.store import ManifestStore
from tests.unit.test_last_try_fails_shard import LOST, shard_of
from tests.unit.test_pod_spec import job_id as job_id  # noqa: F401 - a fixture (4 shards, SQLite)
from tests.unit.test_pod_spec import store_url as store_url  # noqa: F401 - a fixture


def context(try_number: int, max_tries: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A try's context, and the XComs its task instance was pushed (by key)."""
    pushed: dict[str, Any] = {}

    def xcom_push(key: str, value: Any) -> None:
        pushed[key] = value

    ti = SimpleNamespace(
        dag_id="d",
        task_id="shard",
        run_id="r",
        map_index=1,
        try_number=try_number,
        max_tries=max_tries,
        xcom_push=xcom_push,
    )
    return {"ti": ti}, pushed


@pytest.fixture()
def op(store_url: str, job_id: str) -> LocalShardOperator:
    return LocalShardOperator(
        task_id="shard", job_id=job_id, shard_index=1, store_url=store_url, reschedule_retryable=False
    )


@pytest.mark.parametrize(("try_number", "max_tries"), [(1, 4), (5, 4)], ids=["first-try", "last-try"])
def test_another_store_than_the_plans_is_pushed_as_a_configuration_error(
    op: LocalShardOperator, store_url: str, job_id: str, tmp_path: Path, try_number: int, max_tries: int
) -> None:
    op.store_url = f"sqlite:///{tmp_path / 'another.db'}"
    ctx, pushed = context(try_number, max_tries)

    with pytest.raises(AirflowFailException) as raised:
        op.execute(ctx)

    assert "is not in the manifest store this task reads" in str(raised.value)
    assert pushed[CONFIGURATION_ERROR_KEY] == " ".join(str(raised.value).split())
    assert "\n" not in pushed[CONFIGURATION_ERROR_KEY]
    shard = shard_of(store_url, job_id)  # even on the last try: the shard is still to run
    assert shard.state is ShardState.PENDING and shard.last_error is None


def test_a_worker_that_says_configuration_is_pushed_as_a_configuration_error(
    op: LocalShardOperator, store_url: str, job_id: str
) -> None:
    ctx, pushed = context(2, 1)

    def body() -> Any:
        op.settle_failure(FailureClass.CONFIGURATION, "unknown engine 'ehco'\n(see --engine)")

    with pytest.raises(AirflowFailException):
        op.run_try(ctx, body)

    assert (
        pushed[CONFIGURATION_ERROR_KEY]
        == f"shard 1 of job {job_id}: configuration: unknown engine 'ehco' (see --engine)"
    )
    assert shard_of(store_url, job_id).state is ShardState.PENDING


def test_the_stores_verdict_is_no_configuration_error(
    op: LocalShardOperator, store_url: str, job_id: str
) -> None:
    """A shard that failed for good in the store (its budget spent, the worker said so, or found at
    the try's decision) fails the task with ``ShardFailedInStore`` and pushes nothing: the sensor
    then settles it as before and the job can be published."""
    ctx, pushed = context(1, 4)

    def body() -> Any:
        op.settle_failure(FailureClass.DETERMINISTIC, "input changed", shard_failed=True)

    with pytest.raises(ShardFailedInStore):
        op.run_try(ctx, body)
    assert CONFIGURATION_ERROR_KEY not in pushed

    store = ManifestStore(store_url)
    try:
        store.fail_shard(job_id, 1, "its budget is spent")
    finally:
        store.close()
    with pytest.raises(ShardFailedInStore) as raised:
        op.execute(ctx)  # the decision reads the shard failed for good
    assert "its budget is spent" in str(raised.value)
    assert CONFIGURATION_ERROR_KEY not in pushed and "placement" in pushed


def test_a_try_that_spends_the_tasks_retries_pushes_no_configuration_error(
    op: LocalShardOperator, store_url: str, job_id: str
) -> None:
    ctx, pushed = context(2, 1)

    def body() -> Any:
        raise AirflowException(LOST)

    with pytest.raises(AirflowException):
        op.run_try(ctx, body)

    assert CONFIGURATION_ERROR_KEY not in pushed
    assert shard_of(store_url, job_id).state is ShardState.TERMINAL_FAILURE


def mapped_shards() -> Any:
    """A mapped local shard task whose mapped values (``preempt_tries``) exist only at run time."""
    import datetime as dt

    from airflow.sdk import DAG

    from airflow_deadline_batch.operators.plan import DeadlineBatchOperator

    with DAG("unbuilt", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)):
        plan = DeadlineBatchOperator(task_id="plan", input_uri="in", output_uri="out", deadline="+1h")
        return LocalShardOperator.partial(task_id="shard").expand_kwargs(plan.output.map(lambda spec: spec))


def fail_callbacks(task: Any, ctx: dict[str, Any], error: BaseException | None) -> None:
    """Run ``task``'s failure callbacks as Airflow's task runner does once a try failed for good
    (``finalize``: ``context["exception"]`` is the try's error; the DAG processor gives none)."""
    if error is not None:
        ctx["exception"] = error
    for callback in task.on_failure_callback:
        callback({**ctx, "task": task})


def test_a_last_try_failing_while_airflow_builds_its_operator_is_a_configuration_error() -> None:
    """A value only the mapped XCom gives, refused by the constructor when Airflow unmaps the
    instance in the worker: no operator code runs, so the task's failure callback records it."""
    shards = mapped_shards()
    with pytest.raises(ValueError) as raised:
        shards.unmap({"job_id": "j", "shard_index": 1, "preempt_tries": ["x"]})  # the worker's path
    ctx, pushed = context(5, 4)

    fail_callbacks(shards, ctx, raised.value)

    assert pushed == {
        CONFIGURATION_ERROR_KEY: "LocalShardOperator refuses the arguments of this mapped instance "
        "(invalid literal for int() with base 10: 'x'); fix them in the DAG file or in the values "
        "expand_kwargs maps"
    }


def test_other_failures_of_a_mapped_shard_task_push_nothing_from_its_callback() -> None:
    """The operator's own failure (it pushes what it must itself), an unmapped instance's, and a
    lost task's (the DAG processor runs the callbacks without an exception) are left alone."""
    shards = mapped_shards()
    built = shards.unmap({"job_id": "j", "shard_index": 1, "preempt_tries": [1]})
    try:
        raise AirflowException(LOST)
    except AirflowException as exc:
        lost = exc
    for task, error in ((built, lost), (shards, lost), (shards, None)):
        ctx, pushed = context(5, 4)
        fail_callbacks(task, ctx, error)
        assert pushed == {}, (task, error)
    assert shards.on_failure_callback == built.on_failure_callback  # the instance keeps the callback


def test_the_dags_own_failure_callbacks_run_first_and_stay() -> None:
    import datetime as dt

    from airflow.sdk import DAG

    from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
    from airflow_deadline_batch.operators.shard import note_unbuilt_instance

    def from_defaults(context: Any) -> None: ...

    def given(context: Any) -> None: ...

    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    with DAG(
        "callbacks", schedule=None, start_date=start, default_args={"on_failure_callback": from_defaults}
    ):
        plan = DeadlineBatchOperator(task_id="plan", input_uri="in", output_uri="out", deadline="+1h")
        defaulted = LocalShardOperator.partial(task_id="a").expand_kwargs(plan.output)
        explicit = LocalShardOperator.partial(task_id="b", on_failure_callback=given).expand_kwargs(
            plan.output
        )
    assert defaulted.on_failure_callback == [from_defaults, note_unbuilt_instance]
    assert explicit.on_failure_callback == [given, note_unbuilt_instance]
