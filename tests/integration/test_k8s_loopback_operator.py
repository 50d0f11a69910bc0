"""The real ``DeadlineShardPodOperator`` against the loopback Kubernetes API: its pod runs the real
worker, which reads the store URL from a Secret; a Spot-style eviction mid-shard is classified as
preempted and the next try resumes after the last committed microbatch.

The operator runs through its own ``execute(context)`` (the KubernetesPodOperator's synchronous
path, unchanged) with a minimal context: a task instance that records its XComs, a run ID and a
DAG. It reaches the API through ``config_file=`` (a kubeconfig), as a user's deployment would.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowRescheduleException,
    TaskDeferred,
)
from kubernetes import client

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.operators.placement import PlacementView, decide_for_try, read_job_view
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import read_manifest, read_outcomes
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
WAIT_S = 120.0  # deadline for conditions on a loaded 2-core machine (nothing sleeps)
SECRET = "deadline-batch-store"
JOB_LABEL = "deadline-batch.io/job-id"
DEFERRABLE = {"deferrable": True, "poll_interval": 0.5}


@pytest.fixture()
def loopback_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


@dataclass
class TaskInstance:
    """What ``execute`` reads from ``context["ti"]``; XComs are recorded, not stored."""

    try_number: int = 1
    dag_id: str = "k8s_loopback"
    task_id: str = "shard"
    map_index: int = 0
    xcoms: dict[str, Any] = field(default_factory=dict)

    def xcom_push(self, key: str, value: Any, **_: Any) -> None:
        self.xcoms[key] = value


def context(try_number: int) -> dict[str, Any]:
    ti = TaskInstance(try_number=try_number)
    return {"ti": ti, "run_id": "manual__2026-01-01T00:00:00+00:00", "dag": SimpleNamespace(dag_id=ti.dag_id)}


@dataclass(frozen=True)
class PlannedJob:
    store_url: str
    job_id: str
    expected_lines: list[int]


@pytest.fixture()
def planned(tmp_path: Path) -> PlannedJob:
    """A one-shard echo job of 24 lines (a few invalid), planned by the package's planner."""
    mixed = mixed_input(24, seed=8, bad_fraction=0.1, blank_fraction=0.0)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(store_url)
    try:
        result = plan_job(
            store,
            PlanRequest(
                input_uri=str(mixed.write(tmp_path / "input.jsonl")),
                deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
                output_uri=str(tmp_path / "out"),
                engine="echo",
                pools=default_local_pools("echo"),
                workers=1,
                microbatch_size=4,
                max_shards=1,
                max_invalid_fraction=0.5,
            ),
        )
    finally:
        store.close()
    assert result.shards == 1
    return PlannedJob(store_url, result.job_id, sorted(e.line for e in mixed.expected))


def store_secret(cluster: LoopbackCluster, store_url: str) -> None:
    """The Secret the pod's ``ADB_STORE_URL`` refers to, created through the API as kubectl would."""
    cluster.core_v1().create_namespaced_secret(
        cluster.namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=SECRET),
            data={"url": base64.b64encode(store_url.encode()).decode()},
        ),
    )


def shard_operator(
    cluster: LoopbackCluster,
    job: PlannedJob,
    *worker_args: str,
    operator_class: type[DeadlineShardPodOperator] = DeadlineShardPodOperator,
    **options: Any,
) -> DeadlineShardPodOperator:
    return operator_class(
        task_id="shard",
        job_id=job.job_id,
        shard_index=0,
        image="registry.example/deadline-batch-worker@sha256:" + "0" * 64,
        namespace=cluster.namespace,
        store_url=job.store_url,
        store_secret_name=SECRET,
        config_file=str(cluster.kubeconfig),
        startup_check_interval_seconds=1,
        worker_args=list(worker_args),
        **options,
    )


def test_a_shard_pod_runs_the_real_worker_and_commits(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    store_secret(loopback_k8s, planned.store_url)
    ctx = context(try_number=1)
    assert shard_operator(loopback_k8s, planned).execute(ctx) is None

    store = ManifestStore.open(planned.store_url)
    try:
        shard = store.get_shard(planned.job_id, 0)
        assert shard.state is ShardState.SUCCEEDED and shard.cursor == shard.num_microbatches
        [attempt] = store.list_attempts(planned.job_id)
        assert attempt.outcome is AttemptOutcome.SUCCEEDED
        result = finalize_job(store, planned.job_id)
        assert result.state is JobState.COMPLETED and result.report.complete
        assert result.manifest_uri is not None
        assert sorted(read_outcomes(read_manifest(result.manifest_uri))) == planned.expected_lines
    finally:
        store.close()

    [created] = loopback_k8s.api.created_pods
    assert planned.store_url not in json.dumps(created)  # the DSN only by reference
    [container] = created["spec"]["containers"]
    [store_env] = [e for e in container["env"] if e["name"] == "ADB_STORE_URL"]
    assert store_env["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": "url"}
    assert container["command"] == ["python3", "-m", "airflow_deadline_batch.worker"]
    assert created["metadata"]["labels"][JOB_LABEL] == planned.job_id
    assert ctx["ti"].xcoms["placement"]["action"] == "run"
    assert ctx["ti"].xcoms["pod_name"] == created["metadata"]["name"]
    assert loopback_k8s.api.pods(loopback_k8s.namespace) == []  # on_finish_action: delete_pod
    assert not [r for r in loopback_k8s.api.requests if "watch=true" in r[1]]


def test_an_evicted_shard_pod_is_preempted_and_the_next_try_resumes(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, planned.store_url)
    slow = ("--engine-option", "delay_s_per_record=0.5")  # 2 s a microbatch of 4: evicted mid-shard
    # the retry-spending path, whose exception says what happened (the default reschedules instead:
    # the deferrable test below)
    operator = shard_operator(loopback_k8s, planned, *slow, reschedule_retryable=False)
    failure: list[BaseException] = []

    def first_try() -> None:
        try:
            operator.execute(context(try_number=1))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failure.append(exc)

    runner = threading.Thread(target=first_try, name="shard-try-1")
    runner.start()
    try:
        pod = api.wait_for_pod(ns, labels=f"{JOB_LABEL}={planned.job_id}", phase="Running", timeout_s=WAIT_S)
        name = pod["metadata"]["name"]
        api.wait_for_log(ns, name, "committed microbatch 1/", timeout_s=WAIT_S)
        api.evict(ns, name)  # the Spot reclaim: DisruptionTarget, SIGTERM, grace, SIGKILL
    finally:
        runner.join(timeout=WAIT_S)
    assert not runner.is_alive(), "the operator did not return after the eviction"

    [error] = failure
    assert isinstance(error, AirflowException) and not isinstance(error, AirflowFailException)
    assert "preempted" in str(error) and "node shutdown" in str(error)
    evicted = api.created_pods[0]["metadata"]["name"]
    assert evicted == name
    store = ManifestStore.open(planned.store_url)
    try:
        shard = store.get_shard(planned.job_id, 0)
        assert shard.state is not ShardState.SUCCEEDED and shard.cursor >= 1
        [first] = store.list_attempts(planned.job_id)
        assert first.outcome is AttemptOutcome.PREEMPTED
        kept = shard.cursor

        # the retry: a fresh operator instance, as Airflow builds one per try
        assert shard_operator(loopback_k8s, planned).execute(context(try_number=2)) is None
        shard = store.get_shard(planned.job_id, 0)
        assert shard.state is ShardState.SUCCEEDED
        second = [a for a in store.list_attempts(planned.job_id) if a.attempt_id != first.attempt_id]
        assert [a.outcome for a in second] == [AttemptOutcome.SUCCEEDED]
        commits = [c for c in store.list_commits(planned.job_id) if c.shard_index == 0]
        assert sorted(c.seq for c in commits) == list(range(shard.num_microbatches))  # each once
        assert sum(c.attempt_id == first.attempt_id for c in commits) == kept  # nothing redone
        result = finalize_job(store, planned.job_id)
        assert result.report.complete
    finally:
        store.close()
    assert len(api.created_pods) == 2


def defer(operator: DeadlineShardPodOperator, ctx: dict[str, Any]) -> TaskDeferred:
    """Deferrable mode's first half: ``execute`` creates the pod and defers to its trigger."""
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(ctx)
    return deferred.value


def first_trigger_event(deferred: TaskDeferred) -> dict[str, Any]:
    """Run the trigger until its first event, in an event loop of its own as the triggerer does."""

    async def first_event() -> dict[str, Any]:
        async for event in deferred.trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(first_event())


def resume(fresh: DeadlineShardPodOperator, deferred: TaskDeferred, ctx: dict[str, Any], event: Any) -> Any:
    """The second half: a *fresh* operator instance (Airflow rebuilds the task) gets the event."""
    return getattr(fresh, deferred.method_name)(ctx, event)


def test_a_deferred_shard_pod_completes_through_its_trigger(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    store_secret(loopback_k8s, planned.store_url)
    ctx = context(try_number=1)
    deferred = defer(shard_operator(loopback_k8s, planned, **DEFERRABLE), ctx)
    event = first_trigger_event(deferred)
    assert event["status"] == "success", event
    resume(shard_operator(loopback_k8s, planned, **DEFERRABLE), deferred, ctx, event)
    store = ManifestStore.open(planned.store_url)
    try:
        assert store.get_shard(planned.job_id, 0).state is ShardState.SUCCEEDED
    finally:
        store.close()
    assert loopback_k8s.api.pods(loopback_k8s.namespace) == []


def test_a_deferred_shard_pod_evicted_mid_shard_is_preempted(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, planned.store_url)
    slow = ("--engine-option", "delay_s_per_record=0.5")
    ctx = context(try_number=1)
    deferred = defer(shard_operator(loopback_k8s, planned, *slow, **DEFERRABLE), ctx)
    events: list[dict[str, Any]] = []
    triggerer = threading.Thread(
        target=lambda: events.append(first_trigger_event(deferred)), name="triggerer"
    )
    triggerer.start()
    try:
        pod = api.wait_for_pod(ns, labels=f"{JOB_LABEL}={planned.job_id}", phase="Running", timeout_s=WAIT_S)
        api.wait_for_log(ns, pod["metadata"]["name"], "committed microbatch 1/", timeout_s=WAIT_S)
        api.evict(ns, pod["metadata"]["name"])
    finally:
        triggerer.join(timeout=WAIT_S)
    assert not triggerer.is_alive(), "the trigger did not fire after the eviction"
    [event] = events
    # the default: a preempted try reschedules the task, spending no retry (docs/design.md §6.6)
    with pytest.raises(AirflowRescheduleException):
        resume(shard_operator(loopback_k8s, planned, *slow, **DEFERRABLE), deferred, ctx, event)
    store = ManifestStore.open(planned.store_url)
    try:
        [attempt] = store.list_attempts(planned.job_id)
        assert attempt.outcome is AttemptOutcome.PREEMPTED
    finally:
        store.close()


SPOT_NODES = ("deadline-batch.io/node-pool", "local-spot")
#: how long the tests below let a Spot pod wait for capacity (the decision's own timeout is at least
#: 60 s, core.placement.MIN_STARTUP_TIMEOUT_S; the wait's length is not what they test)
SHORT_STARTUP_S = 3


class ShortStartupShardPodOperator(DeadlineShardPodOperator):
    """The real operator, giving up on a Pending pod after :data:`SHORT_STARTUP_S`."""

    def apply_decision(self, decision: Any) -> None:
        super().apply_decision(decision)
        self.startup_timeout_seconds = self.schedule_timeout_seconds = SHORT_STARTUP_S


def spot_without_capacity(cluster: LoopbackCluster) -> list[dict[str, Any]]:
    """The job's pools, the Spot one on nodes of its own, which have no room for a pod."""
    pools = [p.to_dict() for p in default_local_pools("echo")]
    pools[0]["node_selector"] = dict([SPOT_NODES])
    cluster.api.set_capacity(*SPOT_NODES, pods=0)
    return pools


def unschedulable_operator(
    cluster: LoopbackCluster, job: PlannedJob, pools: list[dict[str, Any]], **options: Any
) -> DeadlineShardPodOperator:
    return shard_operator(cluster, job, operator_class=ShortStartupShardPodOperator, pools=pools, **options)


def assert_recorded_unschedulable(job: PlannedJob, pools: list[dict[str, Any]], pod: dict[str, Any]) -> None:
    """One ``unschedulable`` attempt on the Spot pool from the pod's creation; the next decision
    sees the pool out of capacity and waits for it instead of taking it as available."""
    store = ManifestStore.open(job.store_url)
    try:
        [attempt] = store.list_attempts(job.job_id)
        assert attempt.outcome is AttemptOutcome.UNSCHEDULABLE and attempt.pool == "local-spot"
        assert attempt.failure_class == "transient"  # the try gave up: a failed try
        assert attempt.worker == pod["metadata"]["name"]
        created = dt.datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
        assert attempt.started_at == created and attempt.ended_at is not None
        assert (attempt.ended_at - attempt.started_at).total_seconds() >= SHORT_STARTUP_S - 1
        assert "0/1 nodes are available" in (attempt.error or "")
        assert store.get_shard(job.job_id, 0).state is ShardState.PENDING  # no lease was taken
        view = read_job_view(store, job.job_id, now=dt.datetime.now(dt.timezone.utc), pools=pools)
        assert isinstance(view, PlacementView)
        learned = view.pool_availability["local-spot"]
        assert learned.absent_s > 0 and not learned.available(view.now.timestamp())
        decision = decide_for_try(view, store.get_shard(job.job_id, 0))
        assert decision.pool is not None and decision.pool.name == "local-spot"
        assert "wait for Spot" in decision.reason
    finally:
        store.close()


def test_a_spot_pod_unschedulable_until_its_startup_timeout_is_recorded(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    store_secret(loopback_k8s, planned.store_url)
    pools = spot_without_capacity(loopback_k8s)
    ctx = context(try_number=1)
    with pytest.raises(AirflowRescheduleException):  # a timed-out start is transient: no retry spent
        unschedulable_operator(loopback_k8s, planned, pools).execute(ctx)
    assert ctx["ti"].xcoms["placement"]["capacity"] == "spot"
    [pod] = loopback_k8s.api.created_pods
    assert pod["spec"]["nodeSelector"][SPOT_NODES[0]] == SPOT_NODES[1]
    assert_recorded_unschedulable(planned, pools, pod)


def test_a_deferred_spot_pod_unschedulable_until_its_startup_timeout_is_recorded(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    store_secret(loopback_k8s, planned.store_url)
    pools = spot_without_capacity(loopback_k8s)
    ctx = context(try_number=1)
    deferred = defer(unschedulable_operator(loopback_k8s, planned, pools, **DEFERRABLE), ctx)
    event = first_trigger_event(deferred)
    assert event["status"] == "timeout", event
    with pytest.raises(AirflowException):
        resume(unschedulable_operator(loopback_k8s, planned, pools, **DEFERRABLE), deferred, ctx, event)
    [pod] = loopback_k8s.api.created_pods
    assert_recorded_unschedulable(planned, pools, pod)


def poll(probe: Any, *, timeout_s: float, what: str) -> Any:
    """Re-evaluate ``probe`` every 0.2 s until it is truthy (a wait measured on the wall clock:
    the API sees no change while a pod waits, so its ``wait_until`` would not wake)."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while (value := probe()) is None:
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        tick.wait(0.2)
    return value


def test_a_spot_pod_scheduled_after_waiting_records_its_wait_and_runs(
    loopback_k8s: LoopbackCluster, planned: PlannedJob
) -> None:
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, planned.store_url)
    pools = spot_without_capacity(loopback_k8s)
    failure: list[BaseException] = []

    def run_try() -> None:
        try:
            shard_operator(loopback_k8s, planned, pools=pools).execute(context(try_number=1))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failure.append(exc)

    runner = threading.Thread(target=run_try, name="shard-try")
    runner.start()
    try:
        # the pod waits unschedulable; capacity comes back once it has waited a few whole seconds
        def waited() -> dict[str, Any] | None:
            for pod in api.pods(ns, labels=f"{JOB_LABEL}={planned.job_id}"):
                created = dt.datetime.fromisoformat(
                    pod["metadata"]["creationTimestamp"].replace("Z", "+00:00")
                )
                conditions = pod["status"].get("conditions") or []
                pending = any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conditions)
                if pending and (dt.datetime.now(dt.timezone.utc) - created).total_seconds() >= 4:
                    return pod
            return None

        pod = poll(waited, timeout_s=WAIT_S, what="a Spot pod that waited for capacity")
        api.set_capacity(*SPOT_NODES, pods=1)
    finally:
        runner.join(timeout=WAIT_S)
    assert not runner.is_alive() and failure == []
    store = ManifestStore.open(planned.store_url)
    try:
        assert store.get_shard(planned.job_id, 0).state is ShardState.SUCCEEDED
        by_outcome = {a.outcome: a for a in store.list_attempts(planned.job_id)}
        assert sorted(o.value for o in by_outcome) == ["succeeded", "unschedulable"]
        wait, ran = by_outcome[AttemptOutcome.UNSCHEDULABLE], by_outcome[AttemptOutcome.SUCCEEDED]
        assert wait.failure_class is None and wait.worker == pod["metadata"]["name"]  # no failed try
        assert wait.ended_at is not None and (wait.ended_at - wait.started_at).total_seconds() >= 3
        assert wait.ended_at <= ran.started_at + dt.timedelta(seconds=1)  # scheduled, then claimed
        view = read_job_view(store, planned.job_id, now=dt.datetime.now(dt.timezone.utc), pools=pools)
        assert isinstance(view, PlacementView)
        learned = view.pool_availability["local-spot"]
        assert learned.absent_s >= 3 and learned.present_s > 0
        assert learned.available(view.now.timestamp())  # it ran: the pool has capacity
    finally:
        store.close()
