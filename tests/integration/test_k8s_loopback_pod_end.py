"""A shard pod that ended ends its attempt at once, with its class (issue 13 follow-up).

The real ``DeadlineShardPodOperator`` against the loopback Kubernetes API, real worker processes,
real signals. The worker pauses after writing a microbatch and before committing it
(``ADB_FAULT_PAUSE_AFTER_WRITE``: heartbeat stopped, lease held), then:

* its process dies of SIGSEGV (a crash): the attempt ends ``abandoned`` with class
  ``deterministic`` when the operator settles the pod, not ``lost_lease`` after the TTL; the job
  view and the progress report count no preemption, and the next try claims the shard at once
  (the lease TTL is 10 minutes: a claim refused until it lapsed would fail the try);
* its Spot node is reclaimed (an eviction; the paused worker outlives the notice and is killed):
  ``abandoned`` with class ``preempted``, one preemption;
* its Spot node is reclaimed while the tail race's racer pod runs: the Spot pod's attempt ends and
  the racer, promoted to the shard's lease, finishes the shard; its attempt is never touched.

The worker names its attempts ``<pod name>:<pid>``: the operator gives it the pod's name through
the downward API (``ADB_POD_NAME``), so a pod with ``hostNetwork: true``, whose containers see the
node's hostname, is traced as any other; the loopback kubelet runs containers as processes of this
host, gives their Python the pod's hostname (a worker before ``ADB_POD_NAME`` named its attempts
after it), and a host-network pod this host's (``tests/k8s/kubelet.py``).
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowRescheduleException,
    TaskDeferred,
)
from kubernetes import client

from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator
from airflow_deadline_batch.store import AttemptRow, ManifestStore
from tests.helpers.waiting import wait_for
from tests.integration import test_k8s_loopback_operator as operator_tests
from tests.integration import test_k8s_loopback_race as race
from tests.integration.test_k8s_loopback_deferred import TaskStateStore, try_context
from tests.integration.test_k8s_loopback_operator import (
    DEFERRABLE,
    JOB_LABEL,
    PlannedJob,
    context,
    defer,
    first_trigger_event,
    resume,
    shard_operator,
    store_secret,
)
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster, no_pod_left

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WAIT_S = 60.0  # deadline for conditions on a loaded 2-core machine (nothing sleeps)
PAUSE, PAUSE_SEQ = race.PAUSE, race.PAUSE_SEQ
#: longer than any test here: a lease left to lapse would refuse the next try's claim
LONG_TTL_S = 600.0


@pytest.fixture()
def k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        yield cluster


planned = operator_tests.planned  # the operator tests' one-shard echo job (a fixture)


def run_try(operator: DeadlineShardPodOperator, try_number: int) -> tuple[threading.Thread, list[Any]]:
    """``execute`` of one try in a thread (the test drives the faults meanwhile)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(operator.execute(context(try_number=try_number)))
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, name=f"shard-try-{try_number}")
    thread.start()
    return thread, outcome


def paused_try(
    cluster: LoopbackCluster, job: PlannedJob, paused: Path, **options: Any
) -> tuple[threading.Thread, list[Any], int]:
    """Try 1 on Spot, its worker paused before committing microbatch 1; returns its worker's pid."""
    operator = shard_operator(
        cluster,
        job,
        lease_ttl_s=LONG_TTL_S,
        reschedule_retryable=False,  # the exception says how the try ended
        env_vars={PAUSE: str(paused), PAUSE_SEQ: "1"},
        **options,
    )
    thread, outcome = run_try(operator, 1)
    wait_for(paused.exists, timeout_s=WAIT_S, what="the worker to pause before committing microbatch 1")
    return thread, outcome, int(paused.read_text().split()[0])


def ended_try(thread: threading.Thread, outcome: list[Any]) -> BaseException:
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive(), "the operator did not return after its pod ended"
    [error] = outcome
    assert isinstance(error, AirflowException) and not isinstance(error, AirflowFailException), error
    return error


def the_attempt(store: ManifestStore, job: PlannedJob) -> AttemptRow:
    [attempt] = store.list_attempts(job.job_id)
    assert attempt.pool == "local-spot"
    return attempt


def preemptions(store: ManifestStore, job: PlannedJob) -> tuple[int, int]:
    """Preemptions as the job view (the placement's reader) and the progress report count them."""
    view = read_job_view(store, job.job_id, now=dt.datetime.now(dt.timezone.utc))
    return view.spot_tries.preemptions, store.progress(job.job_id).preemptions


def next_try_finishes(
    cluster: LoopbackCluster, job: PlannedJob, store: ManifestStore, **options: Any
) -> None:
    """Try 2 claims the shard at once (a lapsing 10-minute lease would refuse it) and finishes it."""
    operator = shard_operator(cluster, job, lease_ttl_s=LONG_TTL_S, **options)
    assert operator.execute(context(try_number=2)) is None
    shard = store.get_shard(job.job_id, 0)
    assert shard.state is ShardState.SUCCEEDED
    commits = [c for c in store.list_commits(job.job_id) if c.shard_index == 0]
    assert sorted(c.seq for c in commits) == list(range(shard.num_microbatches))  # each once


def test_a_crashed_pod_ends_its_attempt_at_once_as_a_crash_not_a_preemption(
    k8s: LoopbackCluster, planned: PlannedJob, tmp_path: Path
) -> None:
    store_secret(k8s, planned.store_url)
    thread, outcome, pid = paused_try(k8s, planned, tmp_path / "paused")
    [pod] = k8s.api.pods(k8s.namespace, labels=f"{JOB_LABEL}={planned.job_id}")
    os.kill(pid, signal.SIGSEGV)  # the worker crashes: no handler, no release
    error = ended_try(thread, outcome)
    assert "deterministic" in str(error)
    name = pod["metadata"]["name"]
    store = ManifestStore.open(planned.store_url)
    try:
        attempt = the_attempt(store, planned)
        assert attempt.worker == f"{name}:{pid}"  # the pod's name, its worker's pid
        assert (attempt.outcome, attempt.failure_class) == (AttemptOutcome.ABANDONED, "deterministic")
        assert f"pod {name} ended" in (attempt.error or "") and "exit code 139" in (attempt.error or "")
        shard = store.get_shard(planned.job_id, 0)
        assert shard.state is ShardState.RETRYABLE_FAILURE and shard.lease_attempt_id is None
        assert shard.cursor == 1 and shard.failures == 0  # it committed microbatch 0: no budget spent
        assert preemptions(store, planned) == (0, 0)
        next_try_finishes(k8s, planned, store)
        assert preemptions(store, planned) == (0, 0)
    finally:
        store.close()


def test_a_host_network_pods_containers_see_the_nodes_hostname_and_the_downward_api_its_name(
    k8s: LoopbackCluster,
) -> None:
    """The loopback kubelet as a kubelet: a pod's own hostname is its name; ``hostNetwork: true``
    shares the node's (this host's), and only the downward API still tells it its name."""
    v1, ns = k8s.core_v1(), k8s.namespace
    code = "import os, socket; print(socket.gethostname(), os.environ['HOSTNAME'], os.environ['POD'])"
    name_ref = client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path="metadata.name"))
    for name, host_network in (("own-uts", False), ("host-net", True)):
        container = client.V1Container(
            name="base",
            image="python:3.11-slim",
            command=["python3", "-c", code],
            env=[client.V1EnvVar(name="POD", value_from=name_ref)],
        )
        spec = client.V1PodSpec(restart_policy="Never", host_network=host_network, containers=[container])
        v1.create_namespaced_pod(ns, client.V1Pod(metadata=client.V1ObjectMeta(name=name), spec=spec))
    logs = {}
    for name in ("own-uts", "host-net"):
        k8s.api.wait_for_pod(ns, name=name, phase="Succeeded", timeout_s=WAIT_S)
        logs[name] = v1.read_namespaced_pod_log(name, ns, _preload_content=False).read().decode()
    assert logs["own-uts"] == "own-uts own-uts own-uts\n"
    host = socket.gethostname()
    assert logs["host-net"] == f"{host} {host} host-net\n"


def test_a_host_network_pods_crash_ends_its_attempt_at_once_though_its_hostname_is_the_nodes(
    k8s: LoopbackCluster, planned: PlannedJob, tmp_path: Path
) -> None:
    """``hostNetwork: true`` (the pod's containers see the node's hostname): the worker names its
    attempt after the pod all the same (``ADB_POD_NAME``, the downward API), so the crash ends it at
    once, no preemption, and try 2's pod claims the shard in the same run instead of being refused
    until the 10-minute lease lapses (which would then count the crash as a lost lease)."""
    store_secret(k8s, planned.store_url)
    thread, outcome, pid = paused_try(k8s, planned, tmp_path / "paused", hostnetwork=True)
    [pod] = k8s.api.pods(k8s.namespace, labels=f"{JOB_LABEL}={planned.job_id}")
    assert pod["spec"]["hostNetwork"] is True
    os.kill(pid, signal.SIGSEGV)  # the worker crashes: no handler, no release
    error = ended_try(thread, outcome)
    assert "deterministic" in str(error)
    name = pod["metadata"]["name"]
    store = ManifestStore.open(planned.store_url)
    try:
        attempt = the_attempt(store, planned)
        assert (attempt.outcome, attempt.failure_class) == (AttemptOutcome.ABANDONED, "deterministic")
        assert attempt.worker == f"{name}:{pid}"  # the pod's name, not the node's hostname
        assert preemptions(store, planned) == (0, 0)
        next_try_finishes(k8s, planned, store, hostnetwork=True)
        assert preemptions(store, planned) == (0, 0)
    finally:
        store.close()


def test_an_evicted_spot_pod_ends_its_attempt_at_once_as_a_preemption(
    k8s: LoopbackCluster, planned: PlannedJob, tmp_path: Path
) -> None:
    store_secret(k8s, planned.store_url)
    thread, outcome, pid = paused_try(k8s, planned, tmp_path / "paused")
    [pod] = k8s.api.pods(k8s.namespace, labels=f"{JOB_LABEL}={planned.job_id}")
    k8s.api.evict(k8s.namespace, pod["metadata"]["name"], grace_s=1)  # the paused worker outlives the notice
    error = ended_try(thread, outcome)
    assert "preempted" in str(error) and "node shutdown" in str(error)
    store = ManifestStore.open(planned.store_url)
    try:
        attempt = the_attempt(store, planned)
        assert attempt.worker == f"{pod['metadata']['name']}:{pid}"
        assert (attempt.outcome, attempt.failure_class) == (AttemptOutcome.ABANDONED, "preempted")
        shard = store.get_shard(planned.job_id, 0)
        assert shard.state is ShardState.RETRYABLE_FAILURE and shard.failures == 0
        assert preemptions(store, planned) == (1, 1)
        next_try_finishes(k8s, planned, store)
    finally:
        store.close()


tail = race.tail  # the race module's job at its tail (a fixture)


@pytest.fixture()
def race_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        cluster.api.set_capacity(*race.SPOT_NODES, pods=1)
        cluster.api.set_capacity(*race.ON_DEMAND_NODES, pods=1)
        yield cluster


def test_a_reclaimed_spot_pod_ends_its_own_attempt_never_its_racers(
    race_k8s: LoopbackCluster, tail: race.Tail, tmp_path: Path
) -> None:
    """The tail race (docs/kubernetes.md): the Spot pod's node is reclaimed while its racer runs.
    The Spot pod's settle ends the Spot attempt (the racer takes the shard's lease at once) and
    leaves the racer's attempt alone, which then finishes the shard in the same try."""
    api, ns = race_k8s.api, race_k8s.namespace
    store_secret(race_k8s, tail.job.store_url)
    stalled, racer_stalled = tmp_path / "stalled", tmp_path / "racer-stalled"
    operator = race.racing_operator(race_k8s, tail, stalled, {PAUSE: str(racer_stalled), PAUSE_SEQ: "1"})
    thread, outcome = race.run_in_thread(operator)
    try:
        racer_pod = race.race_to_the_tail(race_k8s, tail, stalled)
        wait_for(racer_stalled.exists, timeout_s=WAIT_S, what="the racer to stall before microbatch 1")
        [spot_pod] = api.pods(ns, labels="deadline-batch.io/capacity=spot")
        api.evict(ns, spot_pod["metadata"]["name"], grace_s=1)  # the stalled Spot worker is killed
        store = ManifestStore.open(tail.job.store_url)
        try:

            def spot_ended() -> bool:
                return any(
                    a.outcome is AttemptOutcome.ABANDONED for a in store.list_attempts(tail.job.job_id)
                )

            wait_for(spot_ended, timeout_s=WAIT_S, what="the Spot pod's attempt to end")
            spot, raced = race.attempts_by_kind(store, tail.job.job_id)
            assert (spot.outcome, spot.failure_class) == (AttemptOutcome.ABANDONED, "preempted")
            assert spot.worker.startswith(f"{spot_pod['metadata']['name']}:")
            assert raced.outcome is AttemptOutcome.RUNNING  # the racer's attempt is not the Spot pod's
            assert raced.worker.startswith(f"{racer_pod['metadata']['name']}:")
            shard = store.get_shard(tail.job.job_id, 0)
            assert shard.lease_attempt_id == raced.attempt_id and shard.race_attempt_id is None  # promoted
        finally:
            store.close()
        racer_stalled.with_name("racer-stalled.resume").touch()
    finally:
        race.finish(thread, outcome, operator)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)
    store = ManifestStore.open(tail.job.store_url)
    try:
        spot, raced = race.attempts_by_kind(store, tail.job.job_id)
        assert spot.outcome is AttemptOutcome.ABANDONED and raced.outcome is AttemptOutcome.SUCCEEDED
        by_seq = race.assert_done_once(store, tail, tmp_path)
        assert {by_seq[s] for s in by_seq if s > 0} == {raced.attempt_id}
    finally:
        store.close()


# -- deferrable mode: the resume reads the pod's end, or finds it gone ------------------------------


@pytest.fixture()
def no_resume_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trigger's event is not held (the resume guard is not what these tests are about)."""
    monkeypatch.setenv("AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S", "0")


def crashed_deferred_try(
    cluster: LoopbackCluster, job: PlannedJob, paused: Path, ctx: dict[str, Any]
) -> tuple[TaskDeferred, str]:
    """Try 1 deferred on its pod, whose worker then crashes (SIGSEGV) before committing microbatch 1."""
    operator = shard_operator(
        cluster, job, lease_ttl_s=LONG_TTL_S, env_vars={PAUSE: str(paused), PAUSE_SEQ: "1"}, **DEFERRABLE
    )
    deferred = defer(operator, ctx)
    wait_for(paused.exists, timeout_s=WAIT_S, what="the worker to pause before committing microbatch 1")
    os.kill(int(paused.read_text().split()[0]), signal.SIGSEGV)
    name = deferred.trigger.pod_name
    cluster.api.wait_for_pod(cluster.namespace, name=name, phase="Failed", timeout_s=WAIT_S)
    return deferred, name


def deferred_operator(cluster: LoopbackCluster, job: PlannedJob) -> DeadlineShardPodOperator:
    return shard_operator(cluster, job, lease_ttl_s=LONG_TTL_S, **DEFERRABLE)


def test_a_deferred_try_whose_pod_crashed_ends_its_attempt_on_resume(
    k8s: LoopbackCluster, planned: PlannedJob, tmp_path: Path, no_resume_delay: None
) -> None:
    store_secret(k8s, planned.store_url)
    ctx = try_context(1, TaskStateStore())
    deferred, _ = crashed_deferred_try(k8s, planned, tmp_path / "paused", ctx)
    event = first_trigger_event(deferred)
    with pytest.raises(AirflowException) as raised:  # a crash spends one of the task's retries
        resume(deferred_operator(k8s, planned), deferred, ctx, event)
    assert "deterministic" in str(raised.value) and not isinstance(raised.value, AirflowFailException)
    store = ManifestStore.open(planned.store_url)
    try:
        attempt = the_attempt(store, planned)
        assert (attempt.outcome, attempt.failure_class) == (AttemptOutcome.ABANDONED, "deterministic")
        assert preemptions(store, planned) == (0, 0)
    finally:
        store.close()


def test_a_deferred_try_whose_pod_is_gone_on_resume_ends_its_attempt(
    k8s: LoopbackCluster, planned: PlannedJob, tmp_path: Path, no_resume_delay: None
) -> None:
    """The pod garbage collector removed the pod before the task resumed: how it ended is unknown,
    so its attempt ends ``transient`` (a preemption, as a silent reclaim is), at once all the same."""
    store_secret(k8s, planned.store_url)
    ctx = try_context(1, TaskStateStore())
    deferred, name = crashed_deferred_try(k8s, planned, tmp_path / "paused", ctx)
    event = first_trigger_event(deferred)
    k8s.core_v1().delete_namespaced_pod(name, k8s.namespace, grace_period_seconds=0)
    k8s.api.wait_for_deletion(k8s.namespace, name, timeout_s=WAIT_S)
    with pytest.raises(AirflowRescheduleException):  # transient: no retry spent
        resume(deferred_operator(k8s, planned), deferred, ctx, event)
    store = ManifestStore.open(planned.store_url)
    try:
        attempt = the_attempt(store, planned)
        assert (attempt.outcome, attempt.failure_class) == (AttemptOutcome.ABANDONED, "transient")
        assert store.get_shard(planned.job_id, 0).state is ShardState.RETRYABLE_FAILURE
    finally:
        store.close()


def test_a_later_try_retiring_an_earlier_runs_crashed_pod_ends_its_attempt(
    k8s: LoopbackCluster, planned: PlannedJob, tmp_path: Path, no_resume_delay: None
) -> None:
    """Try 1 never resumed (Airflow failed it); try 2 retires its crashed pod, ending its attempt,
    and its own pod claims the shard at once (the 10-minute lease would refuse it otherwise)."""
    store_secret(k8s, planned.store_url)
    state = TaskStateStore()
    _, crashed = crashed_deferred_try(k8s, planned, tmp_path / "paused", try_context(1, state))
    ctx = try_context(2, state)
    second = defer(deferred_operator(k8s, planned), ctx)
    assert second.trigger.pod_name != crashed
    event = first_trigger_event(second)
    assert event["status"] == "success", event
    assert resume(deferred_operator(k8s, planned), second, ctx, event) is None
    store = ManifestStore.open(planned.store_url)
    try:
        first, done = store.list_attempts(planned.job_id)
        assert (first.outcome, first.failure_class) == (AttemptOutcome.ABANDONED, "deterministic")
        assert done.outcome is AttemptOutcome.SUCCEEDED
        assert store.get_shard(planned.job_id, 0).state is ShardState.SUCCEEDED
    finally:
        store.close()
