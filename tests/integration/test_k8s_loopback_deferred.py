"""The deferrable shard pod path through a Spot eviction, on the loopback Kubernetes API.

What the deployment end-to-end test saw (the example DAG, a real scheduler and triggerer): a shard
whose pod was evicted while its try was deferred came back as try number 2, which reattached to
the dead pod. These tests run the operator's two halves as Airflow does (``execute`` defers; the
trigger runs in an event loop of its own; a *fresh* operator instance resumes with the event),
with the example DAG's pod settings (``on_finish_action="delete_succeeded_pod"``, logs read) and a
task state store, where the provider persists the pod's identity across tries (Airflow 3.3):

* the trigger's event never comes back within ``MIN_RESUME_DELAY_S`` of the deferral (Airflow 3.3
  fails a try that resumes before the scheduler processed the deferral's exit: the spent try);
* a later try never reattaches to an earlier try's evicted pod: it launches its own;
* an evicted pod that is gone (garbage-collected) when the try resumes still reschedules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowRescheduleException, TaskDeferred

from airflow_deadline_batch.core.failures import MIN_RESUME_DELAY_S
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.triggers.pod import ShardPodTrigger
from tests.integration.test_k8s_loopback_operator import (
    JOB_LABEL,
    PlannedJob,
    context,
    defer,
    first_trigger_event,
    resume,
    shard_operator,
    store_secret,
)
from tests.integration.test_k8s_loopback_operator import planned as planned  # noqa: F401 - a fixture
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WAIT_S = 120.0  # deadline for conditions on a loaded 2-core machine (nothing sleeps)
#: the example DAG's shard pod settings (dags/example_deadline_batch_kubernetes.py), a short poll
EXAMPLE = {
    "deferrable": True,
    "poll_interval": 0.5,
    "get_logs": True,
    "on_finish_action": "delete_succeeded_pod",
}
SLOW = ("--engine-option", "delay_s_per_record=0.5")  # 2 s a microbatch of 4: evicted mid-shard
CHECKED = DeadlineShardPodOperator.POD_CHECKED_KEY


@pytest.fixture()
def loopback_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


class TaskStateStore:
    """``context["task_state_store"]`` as the operator uses it: one task instance's keys, across
    its tries (Airflow 3.3 keeps them in its database; here a dict)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def set(self, key: str, value: Any, **_: Any) -> None:
        self.values[key] = value


def try_context(try_number: int, state: TaskStateStore) -> dict[str, Any]:
    return {**context(try_number), "task_state_store": state}


def operator(cluster: LoopbackCluster, job: PlannedJob) -> DeadlineShardPodOperator:
    return shard_operator(cluster, job, *SLOW, **EXAMPLE)


def evict_when_committing(cluster: LoopbackCluster, job: PlannedJob) -> str:
    """Evict the job's running pod once it has committed a microbatch; its name, once it ended."""
    api, ns = cluster.api, cluster.namespace
    pod = api.wait_for_pod(ns, labels=f"{JOB_LABEL}={job.job_id}", phase="Running", timeout_s=WAIT_S)
    name: str = pod["metadata"]["name"]
    api.wait_for_log(ns, name, "committed microbatch 1/", timeout_s=WAIT_S)
    api.evict(ns, name)  # the Spot reclaim: DisruptionTarget, SIGTERM, grace, SIGKILL
    api.wait_for_pod(ns, name=name, phase="Failed", timeout_s=WAIT_S)
    return name


def first_trigger_event_of(trigger: ShardPodTrigger) -> dict[str, Any]:
    return first_trigger_event(TaskDeferred(trigger=trigger, method_name="trigger_reentry"))


def attempts(job: PlannedJob) -> list[AttemptOutcome]:
    store = ManifestStore.open(job.store_url)
    try:
        return [a.outcome for a in store.list_attempts(job.job_id)]
    finally:
        store.close()


def shard_state(job: PlannedJob) -> ShardState:
    store = ManifestStore.open(job.store_url)
    try:
        return store.get_shard(job.job_id, 0).state
    finally:
        store.close()


def test_a_deferred_try_resumes_no_sooner_than_the_resume_delay(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    store_secret(loopback_k8s, planned.store_url)
    ctx = try_context(1, TaskStateStore())
    before = time.time()
    deferred = defer(operator(loopback_k8s, planned), ctx)
    after = time.time()
    # the provider's trigger yields at its first read of an ended pod; Airflow 3.3 fails a try that
    # resumes before the scheduler saw its deferral's exit (the try spent): ours holds the event
    assert isinstance(deferred.trigger, ShardPodTrigger), type(deferred.trigger)
    classpath, kwargs = deferred.trigger.serialize()
    assert classpath == "airflow_deadline_batch.triggers.pod.ShardPodTrigger"
    assert before + MIN_RESUME_DELAY_S <= kwargs["resume_after"] <= after + MIN_RESUME_DELAY_S
    assert kwargs["pod_name"] == loopback_k8s.api.created_pods[0]["metadata"]["name"]
    assert ShardPodTrigger(**kwargs).serialize() == (classpath, kwargs)  # the triggerer rebuilds it

    evict_when_committing(loopback_k8s, planned)
    # as the triggerer runs it when the pod ended right after the deferral: the hold still ahead
    hold = time.time() + MIN_RESUME_DELAY_S
    event = first_trigger_event_of(ShardPodTrigger(**{**kwargs, "resume_after": hold}))
    assert time.time() >= hold  # a lower bound: the event is held, however slow the machine
    assert event["status"] == "failed", event
    # and the resumed try reschedules: no retry spent
    with pytest.raises(AirflowRescheduleException):
        resume(operator(loopback_k8s, planned), deferred, ctx, event)
    assert attempts(planned) == [AttemptOutcome.PREEMPTED]


def test_a_later_try_launches_its_own_pod_instead_of_reattaching_to_an_evicted_one(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, planned.store_url)
    state = TaskStateStore()  # the task instance's, kept across its tries
    first = defer(operator(loopback_k8s, planned), try_context(1, state))
    evicted = evict_when_committing(loopback_k8s, planned)
    assert state.values["pod_identifier"]["name"] == evicted  # the provider persisted it
    # try 1 never resumes (the scheduler failed it: the resume race); try 2 starts afresh
    ctx = try_context(2, state)
    second = defer(operator(loopback_k8s, planned), ctx)
    assert second.trigger.pod_name != evicted, "try 2 reattached to try 1's evicted pod"
    assert [p["metadata"]["name"] for p in api.created_pods] == [evicted, second.trigger.pod_name]
    assert api.created_pods[1]["metadata"]["labels"]["try_number"] == "2"
    old = api.pod(ns, evicted)
    assert old is not None and old["metadata"]["labels"][CHECKED] == "True"  # never found again
    assert state.values["pod_identifier"]["name"] == second.trigger.pod_name
    assert first.trigger.pod_name == evicted

    event = first_trigger_event(second)
    assert event["status"] == "success", event
    assert resume(operator(loopback_k8s, planned), second, ctx, event) is None
    assert shard_state(planned) is ShardState.SUCCEEDED
    assert attempts(planned) == [AttemptOutcome.PREEMPTED, AttemptOutcome.SUCCEEDED]
    # delete_succeeded_pod: the evicted pod is kept for a post-mortem, the finished one deleted
    assert [p["metadata"]["name"] for p in api.pods(ns)] == [evicted]


def test_an_evicted_pod_gone_when_its_try_resumes_reschedules(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    store_secret(loopback_k8s, planned.store_url)
    ctx = try_context(1, TaskStateStore())
    deferred = defer(operator(loopback_k8s, planned), ctx)
    evicted = evict_when_committing(loopback_k8s, planned)
    event = first_trigger_event(deferred)
    assert event["status"] == "failed", event
    # the pod garbage collector removes a reclaimed node's pods: gone before the task resumes
    loopback_k8s.core_v1().delete_namespaced_pod(evicted, loopback_k8s.namespace, grace_period_seconds=0)
    loopback_k8s.api.wait_for_deletion(loopback_k8s.namespace, evicted, timeout_s=WAIT_S)
    with pytest.raises(AirflowException) as raised:
        resume(operator(loopback_k8s, planned), deferred, ctx, event)
    assert isinstance(raised.value, AirflowRescheduleException), repr(raised.value)
    assert attempts(planned) == [AttemptOutcome.PREEMPTED]
