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
* an evicted pod that is gone (garbage-collected) when the try resumes still reschedules;
* a run escalated to on-demand does not reattach to its try's Spot pod still pending for capacity.

And the tail race of a deferred try (docs/kubernetes.md, *The tail race of a deferred try*), with
the synchronous race tests' job, pools and stalls (``test_k8s_loopback_race``): the trigger hands
the try back while its Spot pod runs, the resumed task launches the racer at the tail, the racer or
the Spot pod wins, or the Spot pod is reclaimed and the try waits for its racer in the
triggerer, and no pod is left; a kill while deferred deletes both pods.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowRescheduleException, TaskDeferred

from airflow_deadline_batch.core.failures import MIN_RESUME_DELAY_S
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.operators.shard import RACE_LABEL, DeadlineShardPodOperator
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.triggers.pod import RACE_KEY, ShardPodTrigger
from tests.e2e.conftest import wait_for
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
from tests.integration.test_k8s_loopback_race import (
    ON_DEMAND_NODES,
    PAUSE,
    PAUSE_SEQ,
    SPOT_NODES,
    RacingShardPodOperator,
    Tail,
    assert_done_once,
    assert_racer_spec,
    attempts_by_kind,
)
from tests.integration.test_k8s_loopback_race import tail as tail  # noqa: F401 - a fixture
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster, no_pod_left

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
    assert kwargs["resume_delay_s"] == MIN_RESUME_DELAY_S  # the hold's cap: the delay it deferred with
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


# -- the tail race in deferrable mode (docs/kubernetes.md "The tail race") --------------------------


@pytest.fixture()
def racing_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        # one node of each pool: a pod lands only where its node selector says
        cluster.api.set_capacity(*SPOT_NODES, pods=1)
        cluster.api.set_capacity(*ON_DEMAND_NODES, pods=1)
        yield cluster


def deferred_racing_operator(
    cluster: LoopbackCluster, tail: Tail, stalled: Path, racer_env: dict[str, str]
) -> RacingShardPodOperator:
    """The real operator, deferrable, looking at its running Spot pod every 0.5 s; the Spot pod's
    worker stalls before committing microbatch 1 (the racer's fault hooks are ``racer_env``)."""
    operator = shard_operator(
        cluster,
        tail.job,
        operator_class=RacingShardPodOperator,
        pools=tail.pools,
        clock=tail.clock,
        race_check_interval_s=0.5,
        env_vars={PAUSE: str(stalled), PAUSE_SEQ: "1"},
        deferrable=True,
        poll_interval=0.5,
    )
    assert isinstance(operator, RacingShardPodOperator)
    operator.racer_env = racer_env
    return operator


def step(deferred: TaskDeferred, ctx: dict[str, Any], operator: DeadlineShardPodOperator) -> Any:
    """The trigger's event, handed to a fresh operator instance: the next deferral, or the try's end
    (its result; raised exceptions propagate)."""
    event = first_trigger_event(deferred)
    try:
        return event, resume(operator, deferred, ctx, event)
    except TaskDeferred as again:
        return event, again


def race_state(deferred: TaskDeferred) -> dict[str, Any]:
    assert isinstance(deferred.trigger, ShardPodTrigger)
    state: dict[str, Any] = deferred.trigger.trigger_kwargs[RACE_KEY]
    return state


def start_race(cluster: LoopbackCluster, tail: Tail, stalled: Path, racer_env: dict[str, str]) -> Any:
    """Defer the Spot try, look once before the tail (no racer), move the job's clock to its tail:
    the next look launches the racer. Returns the context, the deferral and the racer pod."""
    api, ns = cluster.api, cluster.namespace

    def fresh() -> DeadlineShardPodOperator:
        return deferred_racing_operator(cluster, tail, stalled, racer_env)

    ctx = context(try_number=1)
    deferred = defer(fresh(), ctx)
    assert race_state(deferred) == {"pool": "local-spot", "racer": None}
    assert deferred.trigger.race_check_interval_s == 0.5
    wait_for(stalled.exists, timeout_s=WAIT_S, what="the Spot pod's worker to stall before microbatch 1")
    event, deferred = step(deferred, ctx, fresh())
    assert event["status"] == "running" and isinstance(deferred, TaskDeferred), (event, deferred)
    assert api.pods(ns, labels=RACE_LABEL) == [] and race_state(deferred)["racer"] is None  # slack ample
    tail.clock.set(tail.tail)
    event, deferred = step(deferred, ctx, fresh())
    assert event["status"] == "running" and isinstance(deferred, TaskDeferred), (event, deferred)
    racer = api.wait_for_pod(ns, labels=f"{RACE_LABEL}=true", timeout_s=WAIT_S)
    assert race_state(deferred) == {"pool": "local-spot", "racer": racer["metadata"]["name"]}
    [spot_pod] = [p for p in api.created_pods if p["metadata"]["name"] != racer["metadata"]["name"]]
    assert_racer_spec(racer, spot_pod)
    assert racer["metadata"]["name"] == f"{spot_pod['metadata']['name']}-race"
    return ctx, deferred, racer, fresh


def run_to_the_end(deferred: TaskDeferred, ctx: dict[str, Any], fresh: Any) -> tuple[Any, list[str]]:
    """Resume and defer until the try ends; its result and the events' statuses."""
    statuses: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, f"the try did not end: {statuses}"
        event, outcome = step(deferred, ctx, fresh())
        statuses.append(event["status"])
        if not isinstance(outcome, TaskDeferred):
            return outcome, statuses
        deferred = outcome


def test_a_deferred_racer_wins_and_the_stalled_spot_pod_is_deleted(
    racing_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    api, ns = racing_k8s.api, racing_k8s.namespace
    store_secret(racing_k8s, tail.job.store_url)
    stalled = tmp_path / "stalled"
    ctx, deferred, racer, fresh = start_race(racing_k8s, tail, stalled, racer_env={})
    result, statuses = run_to_the_end(deferred, ctx, fresh)
    assert result is None and set(statuses) == {"running"}, statuses  # done at a look: the Spot pod lost
    for pod in api.created_pods:
        api.wait_for_deletion(ns, pod["metadata"]["name"], timeout_s=WAIT_S)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)  # one racer, and no pod left
    assert not stalled.with_name("stalled.resume").exists()  # the Spot pod was never let go
    store = ManifestStore.open(tail.job.store_url)
    try:
        spot, raced = attempts_by_kind(store, tail.job.job_id)
        assert (spot.outcome, raced.outcome) == (AttemptOutcome.LOST_RACE, AttemptOutcome.SUCCEEDED)
        by_seq = assert_done_once(store, tail, tmp_path)
        assert {by_seq[s] for s in by_seq if s > 0} == {raced.attempt_id}
    finally:
        store.close()


def test_a_deferred_spot_pod_wins_and_the_racer_pod_is_deleted(
    racing_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    api, ns = racing_k8s.api, racing_k8s.namespace
    store_secret(racing_k8s, tail.job.store_url)
    stalled, racer_stalled = tmp_path / "stalled", tmp_path / "racer-stalled"
    racer_env = {PAUSE: str(racer_stalled), PAUSE_SEQ: "1"}  # the racer stalls on the same microbatch
    ctx, deferred, racer, fresh = start_race(racing_k8s, tail, stalled, racer_env)
    wait_for(racer_stalled.exists, timeout_s=WAIT_S, what="the racer to stall before microbatch 1")
    stalled.with_name("stalled.resume").touch()  # the Spot pod goes on: it wins microbatch 1
    result, statuses = run_to_the_end(deferred, ctx, fresh)
    assert result is None, statuses
    api.wait_for_deletion(ns, racer["metadata"]["name"], timeout_s=WAIT_S)
    for pod in api.created_pods:
        api.wait_for_deletion(ns, pod["metadata"]["name"], timeout_s=WAIT_S)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)
    store = ManifestStore.open(tail.job.store_url)
    try:
        spot, raced = attempts_by_kind(store, tail.job.job_id)
        assert (spot.outcome, raced.outcome) == (AttemptOutcome.SUCCEEDED, AttemptOutcome.LOST_RACE)
        assert set(assert_done_once(store, tail, tmp_path).values()) == {spot.attempt_id}
    finally:
        store.close()


def test_killing_a_deferred_racing_try_deletes_both_its_pods(
    racing_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    """Marked failed while deferred: the triggerer calls the trigger's ``on_kill`` (Airflow 3.3),
    which deletes the racer pod with the Spot pod, no task instance being there to do it."""
    api, ns = racing_k8s.api, racing_k8s.namespace
    store_secret(racing_k8s, tail.job.store_url)
    _, deferred, racer, _ = start_race(racing_k8s, tail, tmp_path / "stalled", racer_env={})
    trigger = ShardPodTrigger(**deferred.trigger.serialize()[1])  # as the triggerer rebuilt it
    asyncio.run(trigger.on_kill())
    for pod in api.created_pods:
        api.wait_for_deletion(ns, pod["metadata"]["name"], timeout_s=WAIT_S)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)
    assert racer["metadata"]["name"] in {p["metadata"]["name"] for p in api.created_pods}


def test_killing_a_deferred_racing_try_deletes_both_pods_though_airflow_cancels_on_kill_again(
    racing_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    """Airflow 3.3's triggerer cancels a cancelled trigger again at each of its loops until it has
    ended, so ``on_kill`` is itself cancelled as soon as it waits. Before, it waited on the Spot
    pod's deletion before asking for the racer's, and the racer pod kept running."""
    api, ns = racing_k8s.api, racing_k8s.namespace
    store_secret(racing_k8s, tail.job.store_url)
    _, deferred, racer, _ = start_race(racing_k8s, tail, tmp_path / "stalled", racer_env={})
    trigger = ShardPodTrigger(**deferred.trigger.serialize()[1])

    async def killed_and_cancelled_again() -> None:
        kill = asyncio.ensure_future(trigger.on_kill())
        await asyncio.sleep(0)  # one loop turn: on_kill runs to its first wait (no time passes)
        kill.cancel("__airflow_user_action__")  # the triggerer's next loop
        with pytest.raises(asyncio.CancelledError):
            await kill
        # the triggerer's event loop goes on running: so does this one while the pods go
        for pod in api.created_pods:
            await asyncio.to_thread(api.wait_for_deletion, ns, pod["metadata"]["name"], timeout_s=WAIT_S)

    asyncio.run(killed_and_cancelled_again())
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)
    assert racer["metadata"]["name"] in {p["metadata"]["name"] for p in api.created_pods}


def test_a_deferred_try_whose_spot_pod_is_reclaimed_waits_for_its_racer_in_the_triggerer(
    racing_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    """The Spot node is reclaimed while the racer runs: the try defers on its racer (no worker slot
    held, no reschedule, no third pod) and succeeds once the racer has finished the shard."""
    api, ns = racing_k8s.api, racing_k8s.namespace
    store_secret(racing_k8s, tail.job.store_url)
    stalled, racer_stalled = tmp_path / "stalled", tmp_path / "racer-stalled"
    racer_env = {PAUSE: str(racer_stalled), PAUSE_SEQ: "1"}
    ctx, deferred, racer, fresh = start_race(racing_k8s, tail, stalled, racer_env)
    racer_name = racer["metadata"]["name"]
    wait_for(racer_stalled.exists, timeout_s=WAIT_S, what="the racer to stall before microbatch 1")
    [spot_pod] = api.pods(ns, labels="deadline-batch.io/capacity=spot")
    api.evict(ns, spot_pod["metadata"]["name"])  # the Spot reclaim: SIGTERM, grace, SIGKILL
    deadline = time.monotonic() + WAIT_S
    while deferred.trigger.pod_name != racer_name:  # a look may come before the Spot pod's end
        assert time.monotonic() < deadline, "the try never deferred on its racer"
        event, outcome = step(deferred, ctx, fresh())
        assert isinstance(outcome, TaskDeferred), (event, outcome)
        deferred = outcome
    assert race_state(deferred) == {"pool": "local-spot", "racer": racer_name, "promoted": True}
    assert deferred.trigger.race_check_interval_s is None  # the race is over: only the racer's end
    api.wait_for_deletion(ns, spot_pod["metadata"]["name"], timeout_s=WAIT_S)  # on_finish_action
    racer_stalled.with_name("racer-stalled.resume").touch()
    result, statuses = run_to_the_end(deferred, ctx, fresh)
    assert result is None and statuses == ["success"], statuses
    api.wait_for_deletion(ns, racer_name, timeout_s=WAIT_S)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)
    store = ManifestStore.open(tail.job.store_url)
    try:
        _, raced = attempts_by_kind(store, tail.job.job_id)
        assert raced.outcome is AttemptOutcome.SUCCEEDED
        assert_done_once(store, tail, tmp_path)
    finally:
        store.close()


def test_a_run_escalated_to_on_demand_does_not_reattach_to_the_spot_pod_still_pending(
    racing_k8s: LoopbackCluster, tail: Tail
) -> None:
    """Seen on the deployment: a deferred try's Spot pod waited for capacity; its resume failed to
    start (the DAG did not parse in time) and was rescheduled; the next run of the same try decided
    on-demand, yet the provider reattached it to the Spot pod, which waited on past its last safe
    start. That run now deletes the pending Spot pod (it holds no lease) and launches its own."""
    api, ns = racing_k8s.api, racing_k8s.namespace
    store_secret(racing_k8s, tail.job.store_url)
    api.set_capacity(*SPOT_NODES, pods=0)  # no room on Spot: its pod waits to be scheduled
    state = TaskStateStore()

    def fresh() -> DeadlineShardPodOperator:
        return shard_operator(racing_k8s, tail.job, pools=tail.pools, clock=tail.clock, race=False, **EXAMPLE)

    first = defer(fresh(), try_context(1, state))
    [spot] = api.created_pods
    assert spot["metadata"]["labels"]["deadline-batch.io/capacity"] == "spot"
    assert first.trigger.pod_name == spot["metadata"]["name"]
    tail.clock.set(tail.tail)  # the run that comes back decides at the tail: on-demand
    ctx = try_context(1, state)
    second = defer(fresh(), ctx)
    assert ctx["ti"].xcoms["placement"]["capacity"] == "on_demand"
    assert second.trigger.pod_name != spot["metadata"]["name"], "reattached to the pending Spot pod"
    [_, mine] = api.created_pods
    assert mine["metadata"]["labels"]["deadline-batch.io/capacity"] == "on-demand"
    api.wait_for_deletion(ns, spot["metadata"]["name"], timeout_s=WAIT_S)
    event = first_trigger_event(second)
    assert event["status"] == "success", event
    assert resume(fresh(), second, ctx, event) is None
    assert shard_state(tail.job) is ShardState.SUCCEEDED
    assert no_pod_left(api, ns)


def test_the_shard_pod_trigger_serializes_to_plain_values() -> None:
    """What the triggerer stores and rebuilds the trigger from: the provider's arguments, unchanged,
    plus the hold, its cap and the race's look interval."""
    started = dt.datetime(2026, 12, 1, 6, 0, tzinfo=dt.timezone.utc)
    trigger = ShardPodTrigger(
        pod_name="deadline-batch-shard-abc",
        pod_namespace="deadline-batch",
        trigger_start_time=started,
        base_container_name="base",
        poll_interval=30,
        trigger_kwargs={RACE_KEY: {"pool": "l4-spot", "racer": None}},
        resume_after=1796104805.5,
        resume_delay_s=30,
        race_check_interval_s=300,
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_deadline_batch.triggers.pod.ShardPodTrigger"
    assert kwargs == {
        "pod_name": "deadline-batch-shard-abc",
        "pod_namespace": "deadline-batch",
        "base_container_name": "base",
        "kubernetes_conn_id": None,
        "connection_extras": None,
        "poll_interval": 30,
        "cluster_context": None,
        "config_dict": None,
        "in_cluster": None,
        "get_logs": True,
        "startup_timeout": 120,
        "startup_check_interval": 5,
        "schedule_timeout": 120,
        "trigger_start_time": started,
        "on_finish_action": "delete_pod",
        "on_kill_action": "delete_pod",
        "termination_grace_period": None,
        "last_log_time": None,
        "logging_interval": None,
        "trigger_kwargs": {RACE_KEY: {"pool": "l4-spot", "racer": None}},
        "resume_after": 1796104805.5,
        "resume_delay_s": 30.0,
        "race_check_interval_s": 300.0,
    }
    assert ShardPodTrigger(**kwargs).serialize() == (classpath, kwargs)
