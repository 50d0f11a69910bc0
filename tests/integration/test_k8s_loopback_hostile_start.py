"""A shard pod whose worker can never start, or beside a sidecar (hostile review, s22).

The pod references the store's Secret (``ADB_STORE_URL`` from ``secretKeyRef``); when the Secret is
missing, the kubelet keeps the container waiting with ``CreateContainerConfigError`` until the
operator's startup timeout. Such a try never claims, so the store never counts it. It used to be
classified *transient* (a timed-out start), which reschedules without spending a retry: every try
relaunched the same pod for ever, and Airflow's last try, which keeps its worker slot and runs
again in it (docs/airflow.md, *Resuming tasks*), did so without ever ending. Now it is a
*deterministic* try the store never saw: one retry spent, and the last try fails, naming the cause.

A classic sidecar from the user's pod template keeps the pod ``Running`` after the worker ended;
the provider (no XCom sidecar) waited for the pod's phase and the try never returned. Now the try
ends with the worker's container, and its attempt with it.

The real ``DeadlineShardPodOperator`` against the loopback Kubernetes API (tests/k8s/), which
models the missing Secret and several containers as a kubelet does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowRescheduleException
from kubernetes.client import models as k8s_models

from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from airflow_deadline_batch.store import ManifestStore
from tests.integration import test_k8s_loopback_pod_end as pod_end
from tests.integration.test_k8s_loopback_deferred import TaskStateStore, try_context
from tests.integration.test_k8s_loopback_operator import (
    DEFERRABLE,
    JOB_LABEL,
    PlannedJob,
    ShortStartupShardPodOperator,
    context,
    defer,
    first_trigger_event,
    resume,
    shard_operator,
    store_secret,
)
from tests.integration.test_k8s_loopback_operator import planned as planned  # noqa: F401 - a fixture
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster, no_pod_left

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


def test_a_crashed_worker_beside_a_sidecar_ends_its_try_and_its_attempt_at_once(
    k8s: LoopbackCluster, planned: PlannedJob, tmp_path: Path
) -> None:
    """A classic sidecar (a second container, as a user's pod template adds one) keeps the pod
    ``Running`` after the worker container ended. The provider, with no XCom sidecar, waited for
    the pod's phase: the try never returned. Now it ends with the worker's container, its attempt
    ``abandoned``/``deterministic`` at once (the worker cannot run again: ``restartPolicy: Never``),
    and the pod is deleted with its sidecar; the next try claims the shard at once."""
    store_secret(k8s, planned.store_url)
    sidecar = k8s_models.V1Container(
        name="log-shipper",
        image="registry.example/log-shipper:1",
        command=[sys.executable, "-c", "import threading; threading.Event().wait()"],
    )
    template = k8s_models.V1Pod(
        spec=k8s_models.V1PodSpec(containers=[k8s_models.V1Container(name="base"), sidecar])
    )
    thread, outcome, pid = pod_end.paused_try(k8s, planned, tmp_path / "paused", full_pod_spec=template)
    [pod] = k8s.api.pods(k8s.namespace, labels=f"{JOB_LABEL}={planned.job_id}")
    assert [c["name"] for c in pod["spec"]["containers"]] == ["base", "log-shipper"]
    os.kill(pid, signal.SIGSEGV)  # the worker crashes; the sidecar runs on
    try:
        error = pod_end.ended_try(thread, outcome)
    finally:
        if thread.is_alive():  # the old wait for the pod's phase: delete the pod to end the test
            k8s.core_v1().delete_namespaced_pod(
                pod["metadata"]["name"], k8s.namespace, grace_period_seconds=0
            )
            thread.join(timeout=WAIT_S)
    assert "deterministic" in str(error)
    store = ManifestStore.open(planned.store_url)
    try:
        attempt = pod_end.the_attempt(store, planned)
        assert attempt.worker == f"{pod['metadata']['name']}:{pid}"
        assert (attempt.outcome, attempt.failure_class) == (AttemptOutcome.ABANDONED, "deterministic")
        assert pod_end.preemptions(store, planned) == (0, 0)
        pod_end.next_try_finishes(k8s, planned, store, full_pod_spec=template)
    finally:
        store.close()
    assert no_pod_left(k8s.api, k8s.namespace)  # the sidecar went with its pod
