"""Airflow's last shard try, waiting in its worker slot, against a job that stops (hostile review s22).

The last try never hands its slot back: a preempted or transient end waits its delay *in the try*
(``_ShardTryMixin.wait_in_slot``) and runs again (docs/airflow.md, *Resuming tasks*). The delay is
at least ``[deadline_batch] min_resume_delay_s``, which a loaded deployment raises (minutes; up to
a day is accepted). A job cancelled meanwhile (``deadline-batch cancel``, or the DAG run marked
failed) used to be noticed only once the whole wait was over: the cancelled job's try kept its
worker slot that long. The wait now reads the store every ``SLOT_CHECK_S`` and ends at once when
the job stopped or the shard was settled elsewhere; the next run's decision ends the try (skipped).
A real SQLite store; no clock is faked.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.operators.shard import LocalShardOperator
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.commits import commit_rest
from tests.unit.test_pod_spec import job_id as job_id  # noqa: F401 - a fixture (4 shards, SQLite)
from tests.unit.test_pod_spec import store_url as store_url  # noqa: F401 - a fixture

ENV = "AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S"
WAIT_S = 30.0  # far below the hour the try would wait, far above SLOT_CHECK_S on a loaded machine


def last_try_context() -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="d", try_number=6, max_tries=5, xcom_push=lambda **_: None)
    return {"ti": ti}


def run_last_try(op: LocalShardOperator, body: Any) -> tuple[BaseException | None, bool]:
    """Run the last try in a thread; its exception, and whether it had to be killed to end."""
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            op.run_try(last_try_context(), body)
            ended.append(None)
        except BaseException as exc:  # noqa: BLE001 - asserted by the caller
            ended.append(exc)

    runner = threading.Thread(target=run, name="shard-try-6")
    runner.start()
    runner.join(timeout=WAIT_S)
    killed = runner.is_alive()
    if killed:  # as Airflow would end it: the test ends either way
        op.on_kill()
        runner.join(timeout=WAIT_S)
    return (ended or [None])[0], killed


@pytest.mark.parametrize("how", ["cancelled", "done elsewhere"])
def test_the_last_try_waiting_in_its_slot_ends_promptly_when_its_job_stops_or_its_shard_is_done(
    store_url: str, job_id: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv(ENV, "3600")  # a loaded deployment's delay: the try would wait an hour
    op = LocalShardOperator(task_id="shard", job_id=job_id, shard_index=1, store_url=store_url)
    store = ManifestStore.open(store_url)
    runs: list[str] = []

    def body() -> Any:
        runs.append("run")
        if len(runs) == 1:  # the first run is preempted; meanwhile the job stops or the shard is done
            if how == "cancelled":
                store.cancel_job(job_id)
            else:  # a racer of an earlier try, say, committed the shard
                lease = store.claim_shard(job_id, 1, ttl_s=60, worker="racer:1", pool="gpu-on-demand")
                store.complete_shard(commit_rest(store, lease))
            op.settle_failure(FailureClass.PREEMPTED, "SIGTERM")
        decision = op.decide()  # the second run decides as any run does
        if op.settle_without_running(decision):
            return decision.reason
        raise AssertionError(f"the second run would launch a worker: {decision.reason}")

    try:
        error, killed = run_last_try(op, body)
    finally:
        store.close()
    assert not killed, f"the last try still waits in its slot {WAIT_S:.0f} s after its job stopped"
    assert len(runs) == 2
    if how == "cancelled":
        assert isinstance(error, AirflowSkipException) and "cancelled" in str(error), repr(error)
    else:
        assert error is None


def test_a_store_that_cannot_be_read_keeps_the_wait_and_a_kill_still_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "3600")
    op = LocalShardOperator(task_id="shard", job_id="j-gone", shard_index=0, store_url="sqlite://")
    checks: list[float] = []
    settled = op.settled_elsewhere

    def counted(store: Any) -> bool:
        checks.append(1.0)
        if len(checks) == 2:
            op.on_kill()  # Airflow ends the try after two looks at the (unreadable) store
        return settled(store)

    op.settled_elsewhere = counted  # type: ignore[method-assign]
    error, killed = run_last_try(op, lambda: op.settle_failure(FailureClass.PREEMPTED, "SIGTERM"))
    assert not killed and isinstance(error, AirflowException) and "killed while it waited" in str(error)
    assert len(checks) == 2  # it looked every SLOT_CHECK_S, and waited on after each failed look
