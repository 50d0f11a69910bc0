"""Hostile input to the shard pod's newest parts (review s22): what names a pod's attempts, the
resume delay's range, and how a pod whose worker never started is classified.

* The worker names its attempts ``<pod name>:<pid>`` from ``ADB_POD_NAME`` (the downward API), and
  the operator finds a dead pod's attempts by it. A ``--worker-name`` in ``worker_args`` (in any
  form the worker's ``argparse`` takes) or a second ``ADB_POD_NAME`` entry after the operator's
  (Kubernetes takes the last) renamed them silently: the pod's end then ended nothing, and the
  next try's claim was refused until the lease's TTL ran out. Both are refused now, naming the fix,
  and so is every other option the operator sets (``worker_args=["--race"]`` made every pod a
  racer, which exits 0 on a shard nobody holds: the shard task succeeded, its shard never ran).
* ``[deadline_batch] min_resume_delay_s`` far too large (``1e12``) crashed the try with an
  ``OverflowError`` (a reschedule date past year 9999), spending a retry and naming nothing; it is
  refused with the option's one-line error now, as a negative one is.
* A pod whose worker container waits on its configuration (a missing Secret) or an image that
  cannot be pulled is a deterministic try the store never saw; a wait for capacity, a slow pull or
  a registry's passing outage stays transient.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException
from kubernetes.client import models as k8s

from airflow_deadline_batch.core.failures import MAX_RESUME_DELAY_S, FailureClass, parse_resume_delay
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.core.worker_command import given_options, worker_arguments, worker_command
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.operators.shard import (
    LocalShardOperator,
    classify_pod,
    failure_class_of,
    pod_ended,
)
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.worker.__main__ import build_parser
from tests.unit.test_pod_spec import POD_NAME_REF, make_operator, manifest_of
from tests.unit.test_pod_spec import job_id as job_id  # noqa: F401 - a fixture
from tests.unit.test_pod_spec import store_url as store_url  # noqa: F401 - a fixture

ENV = "AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S"


@pytest.mark.parametrize(
    "worker_args",
    [
        ["--worker-name", "mine"],
        ["--worker-name=mine"],
        ["--worker", "mine"],  # argparse's abbreviation
        ["--engine-option", "k=v", "--w=mine"],
    ],
)
def test_a_worker_name_in_worker_args_is_refused_naming_the_fix(
    store_url: str, job_id: str, worker_args: list[str]
) -> None:
    op = make_operator(store_url, job_id, worker_args=worker_args)
    op.prepare_try()
    args = op.arguments
    # what the pod's worker would do with them: name its attempts "mine", not after its pod
    assert build_parser().parse_args(args).worker_name == "mine"
    with pytest.raises(AirflowFailException, match="remove --worker-name from worker_args") as refused:
        op.build_pod_request_obj(dry_run=True)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("args", "given"),
    [
        (["--engine-option", "delay_s_per_record=0.5"], []),
        (["--engine-option", "worker=3"], []),  # a value, not the option
        (["--", "--worker-name", "x"], []),  # after "--": not an option
        (["--worker-n", "x"], ["--worker-name"]),
        (["--race"], ["--race"]),
        (["--r"], ["--race"]),
        (["--shard=2", "--lease-ttl", "5"], ["--shard", "--lease-ttl"]),
    ],
)
def test_given_options_reads_arguments_as_the_workers_argparse_does(
    args: list[str], given: list[str]
) -> None:
    assert given_options(args) == given
    if "--" not in args:
        parsed, _ = build_parser().parse_known_args(["--job", "j", "--shard", "0", *args])
        assert (parsed.worker_name is not None) is ("--worker-name" in given)
        assert parsed.race is ("--race" in given)


@pytest.mark.parametrize("worker_args", [["--race"], ["--shard", "2"], ["--pool=gpu-on-demand"]])
def test_options_the_operator_sets_are_refused_in_worker_args(
    store_url: str, job_id: str, worker_args: list[str]
) -> None:
    op = make_operator(store_url, job_id, worker_args=worker_args)
    op.prepare_try()
    option = worker_args[0].split("=")[0]
    with pytest.raises(AirflowFailException, match=f"remove {option} from worker_args"):
        op.build_pod_request_obj(dry_run=True)


def test_a_worker_told_race_on_a_shard_nobody_holds_exits_0_without_running_it(
    store_url: str, job_id: str, tmp_path: Path
) -> None:
    """Why ``--race`` is refused: a pod whose worker got it from ``worker_args`` would succeed, and
    its shard task with it, while the shard stays pending (the real worker, as a subprocess)."""
    argv = worker_command(
        sys.executable, worker_arguments(job_id, 1, pool="gpu-spot", store_url=store_url, extra=["--race"])
    )
    env = {**os.environ, "ADB_TERMINATION_LOG": str(tmp_path / "termination-log")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "nothing to race (not_running)" in done.stderr
    store = ManifestStore(store_url)
    try:
        assert store.get_shard(job_id, 1).state is ShardState.PENDING
    finally:
        store.close()


def test_a_second_pod_name_entry_after_the_operators_own_is_refused(store_url: str, job_id: str) -> None:
    """Kubernetes takes a variable's last entry: the worker would be named ``evil:<pid>``."""
    op = make_operator(
        store_url,
        job_id,
        env_vars=[
            k8s.V1EnvVar(name="ADB_POD_NAME", value_from=POD_NAME_REF),
            k8s.V1EnvVar(name="ADB_POD_NAME", value="evil"),
        ],
    )
    op.prepare_try()
    with pytest.raises(AirflowFailException, match="sets env ADB_POD_NAME.*remove it from env_vars"):
        op.build_pod_request_obj(dry_run=True)


def test_a_pod_name_from_env_from_is_overridden_by_the_operators_env(store_url: str, job_id: str) -> None:
    """``envFrom`` (a ConfigMap or Secret defining ``ADB_POD_NAME``) loses to ``env`` in Kubernetes
    whatever the order; the operator's downward-API entry is there, once."""
    source = k8s.V1EnvFromSource(config_map_ref=k8s.V1ConfigMapEnvSource(name="has-adb-pod-name"))
    op = make_operator(store_url, job_id, env_from=[source])
    op.prepare_try()
    container = manifest_of(op)["spec"]["containers"][0]
    assert container["envFrom"] == [{"configMapRef": {"name": "has-adb-pod-name"}}]
    assert [e for e in container["env"] if e["name"] == "ADB_POD_NAME"] == [
        {"name": "ADB_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]


@pytest.mark.parametrize("value", ["1e12", "1e300", str(MAX_RESUME_DELAY_S + 1)])
def test_a_huge_resume_delay_names_the_option_instead_of_overflowing(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigurationError, match="min_resume_delay_s must be a number of seconds"):
        parse_resume_delay(value)
    monkeypatch.setenv(ENV, value)
    op = LocalShardOperator(task_id="shard", job_id="j-x", shard_index=0, store_url="sqlite://")
    op.slack_s = lambda: None  # type: ignore[method-assign]
    with pytest.raises(AirflowFailException, match=f"got '{value}'"):
        op.settle_failure(FailureClass.PREEMPTED, "SIGTERM")


def test_the_longest_resume_delay_still_reschedules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, f"{MAX_RESUME_DELAY_S:g}")
    op = LocalShardOperator(task_id="shard", job_id="j-x", shard_index=0, store_url="sqlite://")
    before = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(AirflowRescheduleException) as rescheduled:
        op.settle_failure(FailureClass.PREEMPTED, "SIGTERM")
    assert rescheduled.value.reschedule_date >= before + dt.timedelta(seconds=MAX_RESUME_DELAY_S)


def waiting_pod(reason: str | None, message: str | None = None, *, scheduled: bool = True) -> k8s.V1Pod:
    """A ``Pending`` pod whose ``base`` container waits with ``reason`` (None: no container status)."""
    statuses = (
        [
            k8s.V1ContainerStatus(
                name="base",
                image="worker:1",
                image_id="",
                ready=False,
                restart_count=0,
                state=k8s.V1ContainerState(
                    waiting=k8s.V1ContainerStateWaiting(reason=reason, message=message)
                ),
            )
        ]
        if reason is not None
        else None
    )
    condition = k8s.V1PodCondition(
        type="PodScheduled",
        status="True" if scheduled else "False",
        reason=None if scheduled else "Unschedulable",
    )
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="p"),
        status=k8s.V1PodStatus(phase="Pending", conditions=[condition], container_statuses=statuses),
    )


@pytest.mark.parametrize(
    ("pod", "failure"),
    [
        (
            waiting_pod("CreateContainerConfigError", 'secret "deadline-batch-store" not found'),
            "deterministic",
        ),
        (waiting_pod("CreateContainerError", "failed to reserve container name"), "deterministic"),
        (waiting_pod("InvalidImageName", 'invalid reference format: "Worker:1"'), "deterministic"),
        (waiting_pod("ErrImagePull", "manifest unknown"), "deterministic"),
        (waiting_pod("ImagePullBackOff", 'Back-off pulling image "worker:1"'), "deterministic"),
        # the registry's passing outage, a slow pull, no capacity: a later try may start
        (waiting_pod("ErrImagePull", "toomanyrequests: rate limit exceeded"), "transient"),
        (waiting_pod("ContainerCreating"), "transient"),
        (waiting_pod(None, scheduled=False), "transient"),
    ],
)
def test_a_pod_whose_worker_cannot_start_is_deterministic_else_transient(
    pod: k8s.V1Pod, failure: str
) -> None:
    found = classify_pod(pod)
    assert failure_class_of(found) is FailureClass(failure), found
    if failure == "deterministic":
        assert found.failure is not None and not found.failure.claimed  # the store never saw it
        assert pod.status.container_statuses[0].state.waiting.reason in found.reason


@pytest.mark.parametrize("interval", [float("inf"), 1e10, float("nan"), 0.0, -1.0])
def test_a_race_check_interval_the_watch_cannot_wait_is_refused_naming_the_fix(
    store_url: str, job_id: str, interval: float
) -> None:
    """``inf`` (never look) or ``1e10`` used to be taken, and the synchronous watch thread then died of
    an ``OverflowError`` at its first wait: the race silently off, an unhandled thread error logged."""
    with pytest.raises(
        ValueError, match="race_check_interval_s must be > 0 and <= 86400 seconds.*race=False"
    ):
        make_operator(store_url, job_id, race_check_interval_s=interval)


def test_the_watch_threads_wait_overflows_past_the_bound() -> None:
    """Why the bound: ``threading.Event.wait`` (the watch's tick) cannot wait ``1e10`` seconds."""
    with pytest.raises(OverflowError):
        threading.Event().wait(1e10)
    assert not threading.Event().wait(0.0)  # a bounded wait is fine


def sidecar_pod(base: k8s.V1ContainerState, restart_policy: str = "Never") -> k8s.V1Pod:
    """A ``Running`` pod whose sidecar runs on; its ``base`` container in state ``base``."""

    def status(name: str, state: k8s.V1ContainerState) -> k8s.V1ContainerStatus:
        return k8s.V1ContainerStatus(
            name=name, image="i", image_id="", ready=False, restart_count=0, state=state
        )

    running = k8s.V1ContainerState(running=k8s.V1ContainerStateRunning())
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="p"),
        spec=k8s.V1PodSpec(
            restart_policy=restart_policy,
            containers=[k8s.V1Container(name="base"), k8s.V1Container(name="sidecar")],
        ),
        status=k8s.V1PodStatus(
            phase="Running", container_statuses=[status("base", base), status("sidecar", running)]
        ),
    )


CRASHED = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=139))


@pytest.mark.parametrize(
    ("pod", "ended"),
    [
        (sidecar_pod(CRASHED), True),  # the worker cannot run again
        (sidecar_pod(CRASHED, restart_policy="OnFailure"), False),  # the kubelet would restart it
        (sidecar_pod(k8s.V1ContainerState(running=k8s.V1ContainerStateRunning())), False),
    ],
)
def test_a_worker_container_that_terminated_beside_a_sidecar_has_ended(pod: k8s.V1Pod, ended: bool) -> None:
    assert pod_ended(pod, "base") is ended
    assert not pod_ended(pod)  # by the pod's phase alone: still running
