"""A shard pod whose worker can never start (hostile review, s22): no loop the store never sees.

The pod references the store's Secret (``ADB_STORE_URL`` from ``secretKeyRef``); when the Secret is
missing, the kubelet keeps the container waiting with ``CreateContainerConfigError`` until the
operator's startup timeout. Such a try never claims, so the store never counts it. It used to be
classified *transient* (a timed-out start), which reschedules without spending a retry: every try
relaunched the same pod for ever, and Airflow's last try, which keeps its worker slot and runs
again in it (docs/airflow.md, *Resuming tasks*), did so without ever ending. Now it is a
*deterministic* try the store never saw: one retry spent, and the last try fails, naming the cause.

The real ``DeadlineShardPodOperator`` against the loopback Kubernetes API (tests/k8s/), which
models the missing Secret as a kubelet does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowRescheduleException

from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from airflow_deadline_batch.store import ManifestStore
from tests.integration.test_k8s_loopback_deferred import TaskStateStore, try_context
from tests.integration.test_k8s_loopback_operator import (
    DEFERRABLE,
    PlannedJob,
    ShortStartupShardPodOperator,
    context,
    defer,
    first_trigger_event,
    resume,
    shard_operator,
)
from tests.integration.test_k8s_loopback_operator import planned as planned  # noqa: F401 - a fixture
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WAIT_S = 60.0  # deadline for conditions on a loaded 2-core machine (nothing sleeps)
MISSING = 'secret "deadline-batch-store" not found'


@pytest.fixture()
def k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


def no_attempt(job: PlannedJob) -> bool:
    store = ManifestStore.open(job.store_url)
    try:
        return store.list_attempts(job.job_id) == [] and store.get_shard(job.job_id, 0).failures == 0
    finally:
        store.close()


def spent_a_retry(error: BaseException) -> bool:
    """An ``AirflowException`` that spends one retry: neither a reschedule nor a failure for good."""
    return isinstance(error, AirflowException) and not isinstance(
        error, (AirflowRescheduleException, AirflowFailException)
    )


def test_a_pod_whose_worker_cannot_start_spends_a_retry_instead_of_rescheduling_for_ever(
    k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    # no store_secret(): the container waits with CreateContainerConfigError
    with pytest.raises(AirflowException) as failed:
        shard_operator(k8s, planned, operator_class=ShortStartupShardPodOperator).execute(context(1))
    assert spent_a_retry(failed.value), repr(failed.value)
    assert "deterministic" in str(failed.value) and MISSING in str(failed.value)
    assert len(k8s.api.created_pods) == 1 and no_attempt(planned)


def test_a_deferred_pod_whose_worker_cannot_start_spends_a_retry(
    k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    ctx = context(1)
    deferred = defer(
        shard_operator(k8s, planned, operator_class=ShortStartupShardPodOperator, **DEFERRABLE), ctx
    )
    event = first_trigger_event(deferred)
    assert event["status"] == "timeout", event
    fresh = shard_operator(k8s, planned, operator_class=ShortStartupShardPodOperator, **DEFERRABLE)
    with pytest.raises(AirflowException) as failed:
        resume(fresh, deferred, ctx, event)
    assert spent_a_retry(failed.value), repr(failed.value)
    assert MISSING in str(failed.value)
    assert len(k8s.api.created_pods) == 1 and no_attempt(planned)


def test_the_last_try_whose_pod_cannot_start_fails_instead_of_relaunching_it_in_its_slot(
    k8s: LoopbackCluster, planned: PlannedJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S", "0")
    state = TaskStateStore()
    ctx: dict[str, Any] = try_context(6, state)
    ctx["ti"].max_tries = 5  # retries=5 spent: try 6 is Airflow's last, and keeps its slot
    operator = shard_operator(k8s, planned, operator_class=ShortStartupShardPodOperator, **DEFERRABLE)
    ended: list[BaseException | None] = []

    def last_try() -> None:
        try:
            operator.execute(ctx)
            ended.append(None)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            ended.append(exc)

    runner = threading.Thread(target=last_try, name="shard-try-6")
    runner.start()
    runner.join(timeout=WAIT_S)
    looping = runner.is_alive()
    if looping:  # stop it as Airflow would (a kill), so that the test ends either way
        operator.on_kill()
        runner.join(timeout=WAIT_S)
    pods = len(k8s.api.created_pods)
    assert not looping, f"the last try still relaunches its pod after {WAIT_S:.0f} s ({pods} pods so far)"
    [error] = ended
    assert error is not None and spent_a_retry(error), repr(error)
    assert MISSING in str(error) and pods == 1 and no_attempt(planned)
    assert state.values[TRY_LEDGER_KEY]["ended"] == [6]
