"""The tail race on the production path (issue 13): the real ``DeadlineShardPodOperator`` against
the loopback Kubernetes API, with a Spot and an on-demand node pool.

The Spot pod's worker commits microbatch 0, writes microbatch 1 and stalls before committing it
(the worker's ``ADB_FAULT_PAUSE_AFTER_WRITE`` hook: a Spot node gone slow). The job's clock then
jumps to 80 s before the deadline, so the safety rule would escalate the try and
``core.placement.should_speculate`` finds racing worth it: the operator's tail watch creates one
racer pod on the on-demand nodes running ``worker --race``. Either the racer wins (the stalled Spot
pod is deleted as the loser) or, with the racer stalled too, the Spot pod goes on and wins (the
racer's pod is deleted). Either way the try succeeds once, the shard is done once, and no pod is left.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from airflow.sdk.exceptions import AirflowRescheduleException
from kubernetes.client import models as k8s

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.pools import PoolKind, default_local_pools
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.operators.placement import TryDecision
from airflow_deadline_batch.operators.shard import RACE_LABEL, DeadlineShardPodOperator
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import AttemptRow, ManifestStore
from tests.e2e.conftest import run_cli, wait_for
from tests.helpers.inputs import mixed_input
from tests.integration.test_k8s_loopback_operator import (
    JOB_LABEL,
    PlannedJob,
    context,
    shard_operator,
    store_secret,
)
from tests.k8s.fixtures import LoopbackCluster, loopback_cluster, no_pod_left

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WAIT_S = 60.0  # deadline for conditions on a loaded 2-core machine (nothing sleeps)
SPOT_NODES = ("deadline-batch.io/node-pool", "local-spot")
ON_DEMAND_NODES = ("deadline-batch.io/node-pool", "local-on-demand")
PAUSE = "ADB_FAULT_PAUSE_AFTER_WRITE"
PAUSE_SEQ = "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ"


@pytest.fixture()
def loopback_k8s(tmp_path: Path) -> Iterator[LoopbackCluster]:
    with loopback_cluster(tmp_path) as cluster:
        # one node of each pool: a pod lands only where its node selector says
        cluster.api.set_capacity(*SPOT_NODES, pods=1)
        cluster.api.set_capacity(*ON_DEMAND_NODES, pods=1)
        yield cluster


@dataclasses.dataclass(frozen=True)
class Tail:
    job: PlannedJob
    pools: list[dict[str, Any]]
    clock: ManualClock
    #: 80 s before the deadline: the safety rule escalates the Spot try (a shard of ~45 s of work
    #: left, a 20 s changeover), and racing it beats escalating it
    tail: dt.datetime


@pytest.fixture()
def tail(tmp_path: Path) -> Tail:
    """A one-shard echo job of 20 lines in microbatches of 4, planned for two workers (one free
    for a racer), its Spot and on-demand pools on node pools of their own."""
    start = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    deadline = start + dt.timedelta(hours=1)
    pools = [p.to_dict() for p in default_local_pools()]
    for pool, nodes in zip(pools, (SPOT_NODES, ON_DEMAND_NODES), strict=True):
        pool["node_selector"] = dict([nodes])
    mixed = mixed_input(20, seed=3)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(store_url)
    try:
        plan = plan_job(
            store,
            PlanRequest(
                input_uri=str(mixed.write(tmp_path / "input.jsonl")),
                deadline=deadline,
                output_uri=str(tmp_path / "out"),
                engine="echo",
                pools=tuple(default_local_pools()),
                workers=2,
                microbatch_size=4,
                max_shards=1,
                max_invalid_fraction=0.5,
            ),
        )
    finally:
        store.close()
    assert plan.shards == 1
    job = PlannedJob(store_url, plan.job_id, sorted(e.line for e in mixed.expected))
    return Tail(job, pools, ManualClock(start), deadline - dt.timedelta(seconds=80))


class RacingShardPodOperator(DeadlineShardPodOperator):
    """The real operator; its racer pod's fault hooks are the test's (``racer_env``), not the Spot pod's."""

    racer_env: dict[str, str] = {}

    def racer_pod(self, decision: TryDecision) -> k8s.V1Pod:
        pod = super().racer_pod(decision)
        [container] = pod.spec.containers
        kept = [e for e in container.env or [] if e.name not in (PAUSE, PAUSE_SEQ)]
        container.env = [*kept, *(k8s.V1EnvVar(name=k, value=v) for k, v in self.racer_env.items())]
        return pod


def racing_operator(
    cluster: LoopbackCluster, tail: Tail, stalled: Path, racer_env: dict[str, str]
) -> RacingShardPodOperator:
    operator = shard_operator(
        cluster,
        tail.job,
        operator_class=RacingShardPodOperator,
        pools=tail.pools,
        clock=tail.clock,
        race_check_interval_s=0.5,
        env_vars={PAUSE: str(stalled), PAUSE_SEQ: "1"},
    )
    assert isinstance(operator, RacingShardPodOperator)
    operator.racer_env = racer_env
    return operator


def run_in_thread(operator: DeadlineShardPodOperator) -> tuple[threading.Thread, list[Any]]:
    """``execute`` of try 1 in a thread of its own (the test drives the clock and the faults)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(operator.execute(context(try_number=1)))
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, name="shard-try-1")
    thread.start()
    return thread, outcome


def race_to_the_tail(cluster: LoopbackCluster, tail: Tail, stalled: Path) -> dict[str, Any]:
    """Wait for the Spot pod to stall before committing microbatch 1, move the job's clock to its
    tail, and return the racer pod the operator then creates."""
    wait_for(stalled.exists, timeout_s=WAIT_S, what="the Spot pod's worker to stall before microbatch 1")
    assert cluster.api.pods(cluster.namespace, labels=RACE_LABEL) == []  # no race while slack is ample
    tail.clock.set(tail.tail)
    return cluster.api.wait_for_pod(cluster.namespace, labels=f"{RACE_LABEL}=true", timeout_s=WAIT_S)


def finish(thread: threading.Thread, outcome: list[Any], operator: DeadlineShardPodOperator) -> None:
    """Join the try; if it hangs (a failed wait above), kill it as Airflow would, deleting its pods."""
    thread.join(timeout=WAIT_S)
    if thread.is_alive():
        operator.on_kill()
        thread.join(timeout=WAIT_S)
        raise AssertionError("the operator did not return")
    assert outcome == [None], outcome  # the try succeeded, once


def attempts_by_kind(store: ManifestStore, job_id: str) -> tuple[AttemptRow, AttemptRow]:
    """The Spot try and the racer's (the racing lease: a speculative attempt on on-demand)."""
    [spot] = [a for a in store.list_attempts(job_id) if not a.speculative]
    [racer] = [a for a in store.list_attempts(job_id) if a.speculative]
    assert (spot.pool, racer.pool) == ("local-spot", "local-on-demand")
    return spot, racer


def assert_done_once(store: ManifestStore, tail: Tail, tmp_path: Path) -> dict[int, str]:
    """The shard is done, each microbatch committed once; the job publishes and verifies."""
    shard = store.get_shard(tail.job.job_id, 0)
    assert shard.state is ShardState.SUCCEEDED and shard.failures == 0
    by_seq = {c.seq: c.attempt_id for c in store.list_commits(tail.job.job_id)}
    assert sorted(by_seq) == list(range(shard.num_microbatches))
    assert finalize_job(store, tail.job.job_id).report.complete
    verified = run_cli("verify", tail.job.job_id, "--store", tail.job.store_url, "--json", cwd=tmp_path)
    assert verified.code == 0, verified.describe()
    return by_seq


def assert_racer_spec(racer: dict[str, Any], spot: dict[str, Any]) -> None:
    """The racer is the Spot pod with the on-demand placement and ``--race``: a valid Pod."""
    kubernetes_validate.validate(racer, "1.30", strict=True)
    labels = racer["metadata"]["labels"]
    assert labels["deadline-batch.io/capacity"] == "on-demand" and labels[RACE_LABEL] == "true"
    assert (
        labels["deadline-batch.io/pool"] == "local-on-demand"
        and labels[JOB_LABEL] == spot["metadata"]["labels"][JOB_LABEL]
    )
    assert racer["spec"]["nodeSelector"] == dict([ON_DEMAND_NODES])
    [container] = racer["spec"]["containers"]
    assert (
        "--race" in container["args"]
        and container["args"][container["args"].index("--pool") + 1] == "local-on-demand"
    )
    assert container["image"] == spot["spec"]["containers"][0]["image"]
    [store_env] = [e for e in container["env"] if e["name"] == "ADB_STORE_URL"]
    assert "value" not in store_env and store_env["valueFrom"]["secretKeyRef"]["key"] == "url"  # by reference


def test_the_racer_wins_and_the_stalled_spot_pod_is_deleted(
    loopback_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, tail.job.store_url)
    stalled = tmp_path / "stalled"
    operator = racing_operator(loopback_k8s, tail, stalled, racer_env={})
    thread, outcome = run_in_thread(operator)
    try:
        racer = race_to_the_tail(loopback_k8s, tail, stalled)
    finally:
        finish(thread, outcome, operator)
    [spot_pod] = [p for p in api.created_pods if p["metadata"]["name"] != racer["metadata"]["name"]]
    assert spot_pod["metadata"]["labels"]["deadline-batch.io/capacity"] == "spot"
    assert_racer_spec(racer, spot_pod)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)  # one racer, and no pod left
    assert not stalled.with_name("stalled.resume").exists()  # the Spot pod was never let go

    store = ManifestStore.open(tail.job.store_url)
    try:
        spot, raced = attempts_by_kind(store, tail.job.job_id)
        assert (spot.outcome, raced.outcome) == (AttemptOutcome.LOST_RACE, AttemptOutcome.SUCCEEDED)
        assert spot.failure_class is None  # the loser's try is no failure
        by_seq = assert_done_once(store, tail, tmp_path)
        assert by_seq[0] == spot.attempt_id
        assert {by_seq[s] for s in by_seq if s > 0} == {raced.attempt_id}
    finally:
        store.close()


def test_the_spot_pod_wins_and_the_racer_pod_is_deleted(
    loopback_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, tail.job.store_url)
    stalled, racer_stalled = tmp_path / "stalled", tmp_path / "racer-stalled"
    racer_env = {PAUSE: str(racer_stalled), PAUSE_SEQ: "1"}  # the racer stalls on the same microbatch
    operator = racing_operator(loopback_k8s, tail, stalled, racer_env)
    thread, outcome = run_in_thread(operator)
    store = ManifestStore.open(tail.job.store_url)
    try:
        try:
            racer = race_to_the_tail(loopback_k8s, tail, stalled)
            wait_for(racer_stalled.exists, timeout_s=WAIT_S, what="the racer to stall before microbatch 1")
            [raced] = [a for a in store.list_attempts(tail.job.job_id) if a.speculative]
            assert raced.outcome is AttemptOutcome.RUNNING  # it holds the racing lease
            stalled.with_name("stalled.resume").touch()  # the Spot pod goes on: it wins microbatch 1
        finally:
            finish(thread, outcome, operator)
        # the racer, stalled for good, was deleted (gracefully: its object goes once its process ended)
        deleted = api.pod(ns, racer["metadata"]["name"])
        assert deleted is None or "deletionTimestamp" in deleted["metadata"]
        api.wait_for_deletion(ns, racer["metadata"]["name"], timeout_s=WAIT_S)
        assert no_pod_left(api, ns) and len(api.created_pods) == 2
        spot, raced = attempts_by_kind(store, tail.job.job_id)
        assert (spot.outcome, raced.outcome) == (AttemptOutcome.SUCCEEDED, AttemptOutcome.LOST_RACE)
        by_seq = assert_done_once(store, tail, tmp_path)
        assert set(by_seq.values()) == {spot.attempt_id}
    finally:
        store.close()


def test_a_try_finding_a_live_racer_on_its_shard_reschedules_without_a_pod(
    loopback_k8s: LoopbackCluster, tail: Tail
) -> None:
    """The task's next try while an earlier try's racer still holds the shard (say, the Airflow
    worker running the try died): a pod of its own would be refused, so it reschedules, spending
    no retry, and creates no pod."""
    store_secret(loopback_k8s, tail.job.store_url)
    store = ManifestStore.open(tail.job.store_url)
    try:
        store.claim_shard(tail.job.job_id, 0, ttl_s=600, worker="spot-pod", pool="local-spot")
        store.claim_race(tail.job.job_id, 0, ttl_s=600, worker="racer-pod", pool="local-on-demand")
        operator = shard_operator(loopback_k8s, tail.job, pools=tail.pools, clock=tail.clock)
        with pytest.raises(AirflowRescheduleException):
            operator.execute(context(try_number=2))
        assert loopback_k8s.api.created_pods == []
        assert store.get_shard(tail.job.job_id, 0).failures == 0
    finally:
        store.close()


def test_race_is_off_with_race_false_or_without_an_on_demand_pool(
    loopback_k8s: LoopbackCluster, tail: Tail
) -> None:
    store = ManifestStore.open(tail.job.store_url)
    try:
        spot_only = [p for p in tail.pools if p["kind"] == PoolKind.SPOT.value]
        decision = shard_operator(loopback_k8s, tail.job, pools=tail.pools, clock=tail.clock).decide()
        assert decision.pool is not None and decision.pool.kind is PoolKind.SPOT
        assert shard_operator(loopback_k8s, tail.job, pools=tail.pools).races(store, decision)
        assert not shard_operator(loopback_k8s, tail.job, pools=tail.pools, race=False).races(store, decision)
        assert not shard_operator(loopback_k8s, tail.job, pools=spot_only).races(store, decision)
        with pytest.raises(Exception, match="race=True needs a Spot and an on-demand pool"):
            shard_operator(loopback_k8s, tail.job, pools=spot_only, race=True).races(store, decision)
    finally:
        store.close()


def test_a_racer_that_outlives_its_reclaimed_spot_pod_finishes_the_shard_in_the_same_try(
    loopback_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    """The Spot node is reclaimed while the racer runs: the try waits for its racer (no reschedule,
    no third pod) and succeeds once the racer has finished the shard."""
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, tail.job.store_url)
    stalled, racer_stalled = tmp_path / "stalled", tmp_path / "racer-stalled"
    operator = racing_operator(loopback_k8s, tail, stalled, {PAUSE: str(racer_stalled), PAUSE_SEQ: "1"})
    thread, outcome = run_in_thread(operator)
    try:
        race_to_the_tail(loopback_k8s, tail, stalled)
        wait_for(racer_stalled.exists, timeout_s=WAIT_S, what="the racer to stall before microbatch 1")
        [spot_pod] = api.pods(ns, labels="deadline-batch.io/capacity=spot")
        api.evict(ns, spot_pod["metadata"]["name"])  # the Spot reclaim: SIGTERM, grace, SIGKILL
        api.wait_for_deletion(ns, spot_pod["metadata"]["name"], timeout_s=WAIT_S)
        assert thread.is_alive()  # the try waits for its racer
        racer_stalled.with_name("racer-stalled.resume").touch()
    finally:
        finish(thread, outcome, operator)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)
    store = ManifestStore.open(tail.job.store_url)
    try:
        _, raced = attempts_by_kind(store, tail.job.job_id)
        assert raced.outcome is AttemptOutcome.SUCCEEDED
        by_seq = assert_done_once(store, tail, tmp_path)
        assert {by_seq[s] for s in by_seq if s > 0} == {raced.attempt_id}
    finally:
        store.close()


def test_a_killed_try_deletes_its_racer_pod_too(
    loopback_k8s: LoopbackCluster, tail: Tail, tmp_path: Path
) -> None:
    """Airflow kills the try (``on_kill``: the task was marked failed, or its worker stops) while its
    racer runs: both pods go."""
    api, ns = loopback_k8s.api, loopback_k8s.namespace
    store_secret(loopback_k8s, tail.job.store_url)
    stalled, racer_stalled = tmp_path / "stalled", tmp_path / "racer-stalled"
    operator = racing_operator(loopback_k8s, tail, stalled, {PAUSE: str(racer_stalled), PAUSE_SEQ: "1"})
    thread, outcome = run_in_thread(operator)
    try:
        racer = race_to_the_tail(loopback_k8s, tail, stalled)
        wait_for(racer_stalled.exists, timeout_s=WAIT_S, what="the racer to stall before microbatch 1")
        operator.on_kill()
        # deleted by on_kill itself: the try's own exit (which deletes it too) waits for the Spot
        # pod's grace period first, and a killed task may never get there
        deleted = api.pod(ns, racer["metadata"]["name"])
        assert deleted is None or "deletionTimestamp" in deleted["metadata"]
        assert thread.is_alive()  # still waiting for its Spot pod to go
    finally:
        thread.join(timeout=WAIT_S)
    assert not thread.is_alive()
    [error] = outcome
    assert isinstance(error, Exception)  # the killed try does not succeed
    for pod in api.created_pods:
        api.wait_for_deletion(ns, pod["metadata"]["name"], timeout_s=WAIT_S)
    assert len(api.created_pods) == 2 and no_pod_left(api, ns)
