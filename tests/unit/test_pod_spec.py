"""Shard pods built by the provider's real ``build_pod_request_obj(dry_run=True)``, validated offline."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import kubernetes_validate
import pytest
from airflow.sdk.exceptions import AirflowFailException
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.operators.placement import TryAction
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator, PodOutcome, classify_pod
from airflow_deadline_batch.store import ManifestStore, NewJob
from tests.helpers.commits import commit_rest
from tests.helpers.shards import uniform_shards

T0 = dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.timezone.utc)
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SPOT = PoolSpec(
    name="gpu-spot",
    kind=PoolKind.SPOT,
    startup_seconds=120,
    preemptions_per_hour=0.5,
    preemption_notice_seconds=120,
    node_selector={"karpenter.sh/capacity-type": "spot", "karpenter.k8s.aws/instance-gpu-name": "l4"},
    tolerations=(
        GPU_TOLERATION,
        {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
    ),
)
ON_DEMAND = PoolSpec(
    name="gpu-on-demand",
    kind=PoolKind.ON_DEMAND,
    price_per_gpu_hour=3.0,
    startup_seconds=120,
    node_selector={"karpenter.sh/capacity-type": "on-demand"},
    tolerations=(GPU_TOLERATION,),
)
SECRET_PASSWORD = "s3cr3t-pw"


@pytest.fixture()
def store_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture()
def job_id(store_url: str) -> str:
    """A two-hour job of 4 shards of 10 GPU-minutes each, run by 2 workers."""
    store = ManifestStore(store_url)
    store.migrate()
    job, _ = store.create_job(
        NewJob(
            deadline=T0 + dt.timedelta(hours=2),
            input_uri="/data/in.jsonl",
            input_sha256="0" * 64,
            input_lines=40,
            input_total_lines=40,
            output_uri="/data/out",
            config={"workers": 2, "engine": "echo", "pools": [SPOT.to_dict(), ON_DEMAND.to_dict()]},
            idempotency_key="pod-spec-test",
        ),
        uniform_shards(4, microbatches=3, est_work_s=600.0),
        None,
    )
    return job.job_id


class RecordingTaskInstance:
    """The one thing the shard operator asks of its task instance outside Airflow: ``xcom_push``."""

    def __init__(self) -> None:
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


def make_operator(
    store_url: str, job_id: str, clock: ManualClock | None = None, **options: Any
) -> DeadlineShardPodOperator:
    return DeadlineShardPodOperator(
        task_id="shard",
        job_id=job_id,
        shard_index=1,
        image="registry.example.com/deadline-batch-worker:0.1.0",
        namespace="batch",
        store_url=store_url,
        clock=clock or ManualClock(T0),
        labels={"team": "data"},
        **options,
    )


def manifest_of(op: DeadlineShardPodOperator) -> dict:
    pod = op.build_pod_request_obj(dry_run=True)
    return ApiClient().sanitize_for_serialization(pod)


def test_high_slack_places_on_spot_with_valid_spec_and_secret_by_reference(store_url, job_id):
    op = make_operator(store_url, job_id, ManualClock(T0))
    decision = op.prepare_try()
    manifest = manifest_of(op)

    assert decision.action is TryAction.RUN and decision.pool == SPOT
    kubernetes_validate.validate(manifest, "1.30", strict=True)
    spec, meta = manifest["spec"], manifest["metadata"]
    assert spec["nodeSelector"] == dict(SPOT.node_selector)
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu", "spot"}
    assert meta["labels"]["karpenter.sh/capacity-type"] == "spot"
    assert meta["labels"]["deadline-batch.io/job-id"] == job_id
    assert meta["labels"]["deadline-batch.io/shard"] == "1"
    assert meta["labels"]["team"] == "data"
    assert spec["terminationGracePeriodSeconds"] == 120  # the Spot notice
    assert op.startup_timeout_seconds == decision.placement.startup_timeout_s
    assert op.startup_timeout_seconds >= 60
    container = spec["containers"][0]
    assert container["command"] == ["python3", "-m", "airflow_deadline_batch.worker"]
    assert container["args"][:6] == ["--job", job_id, "--shard", "1", "--pool", "gpu-spot"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    env = {e["name"]: e for e in container["env"]}
    assert env["ADB_STORE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "deadline-batch-store", "key": "url"}
    assert "value" not in env["ADB_STORE_URL"]
    # the worker names its attempts after its pod, whatever the pod's hostname (the downward API)
    assert env["ADB_POD_NAME"] == {
        "name": "ADB_POD_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    }
    assert store_url not in json.dumps(manifest)
    assert "store.db" not in json.dumps(manifest)


def test_low_slack_places_on_demand(store_url, job_id):
    op = make_operator(store_url, job_id, ManualClock(T0 + dt.timedelta(minutes=105)))
    decision = op.prepare_try()
    manifest = manifest_of(op)

    kubernetes_validate.validate(manifest, "1.30", strict=True)
    assert decision.pool == ON_DEMAND
    assert manifest["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand"}
    assert [t["key"] for t in manifest["spec"]["tolerations"]] == ["nvidia.com/gpu"]
    assert manifest["metadata"]["labels"]["karpenter.sh/capacity-type"] == "on-demand"
    assert "--pool" in manifest["spec"]["containers"][0]["args"]
    assert manifest["spec"]["containers"][0]["args"][5] == "gpu-on-demand"


def test_retry_after_preemption_with_less_slack_escalates(store_url, job_id):
    clock = ManualClock(T0 + dt.timedelta(minutes=30))
    op = make_operator(store_url, job_id, clock)
    first = op.prepare_try()
    first_manifest = manifest_of(op)
    assert first.pool == SPOT

    # the first try's pod is preempted; Airflow retries the same task an hour later
    store = ManifestStore(store_url)
    lease = store.claim_shard(job_id, 1, ttl_s=60, worker="pod-1", pool=first.pool.name)
    store.release(lease, AttemptOutcome.PREEMPTED, error="node reclaimed")
    clock.advance(70 * 60)

    second = op.prepare_try()
    second_manifest = manifest_of(op)
    assert second.pool == ON_DEMAND
    assert second.placement.slack_s < first.placement.slack_s
    assert first_manifest["spec"]["nodeSelector"]["karpenter.sh/capacity-type"] == "spot"
    assert second_manifest["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand"}
    # the second try's spec carries only its own placement, not a mix of both tries
    assert {t["key"] for t in second_manifest["spec"]["tolerations"]} == {"nvidia.com/gpu"}
    assert [e["name"] for e in second_manifest["spec"]["containers"][0]["env"]] == [
        "ADB_STORE_URL",
        "ADB_POD_NAME",
    ]
    kubernetes_validate.validate(second_manifest, "1.30", strict=True)


POD_NAME_REF = k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path="metadata.name"))


def test_a_host_network_pod_from_a_template_keeps_the_users_env_and_its_worker_learns_the_pods_name(
    store_url, job_id, tmp_path
):
    """``hostNetwork: true`` from a pod template (its containers see the node's hostname): the
    template's and the operator's env are kept, the pod's name is added once, the spec is valid."""
    template = tmp_path / "pod.yaml"
    template.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: t}\nspec:\n  hostNetwork: true\n"
        "  containers:\n  - name: base\n    env: [{name: HF_HOME, value: /cache}]\n"
    )
    op = make_operator(store_url, job_id, pod_template_file=str(template), env_vars={"LOG_LEVEL": "debug"})
    op.prepare_try()
    manifest = manifest_of(op)
    kubernetes_validate.validate(manifest, "1.30", strict=True)
    assert manifest["spec"]["hostNetwork"] is True
    env = manifest["spec"]["containers"][0]["env"]
    assert [e["name"] for e in env] == ["HF_HOME", "LOG_LEVEL", "ADB_STORE_URL", "ADB_POD_NAME"]
    assert env[-1]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


@pytest.mark.parametrize(
    ("var", "kept"),
    [
        (k8s.V1EnvVar(name="ADB_POD_NAME", value_from=POD_NAME_REF), True),  # what the operator sets
        (k8s.V1EnvVar(name="ADB_POD_NAME", value="my-worker"), False),
        (
            k8s.V1EnvVar(
                name="ADB_POD_NAME",
                value_from=k8s.V1EnvVarSource(
                    field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName")
                ),
            ),
            False,
        ),
    ],
)
def test_the_users_own_pod_name_env_is_kept_when_it_is_the_pods_name_else_refused(
    store_url, job_id, var, kept
):
    template = k8s.V1Pod(spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="base", env=[var])]))
    op = make_operator(store_url, job_id, full_pod_spec=template)
    op.prepare_try()
    if not kept:
        with pytest.raises(AirflowFailException, match="sets env ADB_POD_NAME.*remove it from env_vars"):
            op.build_pod_request_obj(dry_run=True)
        return
    manifest = manifest_of(op)
    kubernetes_validate.validate(manifest, "1.30", strict=True)
    names = [e["name"] for e in manifest["spec"]["containers"][0]["env"]]
    assert names.count("ADB_POD_NAME") == 1


def test_committed_shard_is_a_no_op(store_url, job_id):
    store = ManifestStore(store_url)
    lease = store.claim_shard(job_id, 1, ttl_s=60, worker="w", pool="gpu-spot")
    store.complete_shard(commit_rest(store, lease))

    op = make_operator(store_url, job_id, ManualClock(T0))
    ti = RecordingTaskInstance()
    # the real execute(): with no kube config here, building or launching a pod would raise
    assert op.execute({"ti": ti}) is None
    assert ti.xcom["placement"]["action"] == TryAction.ALREADY_DONE.value
    assert ti.xcom["placement"]["pool"] is None
    assert op.pod_request_obj is None and op.pod is None
    assert op.arguments == [] and op.node_selector == {}  # nothing was prepared for a pod


def test_store_connection_secrets_never_reach_the_pod_spec(store_url, job_id, monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_ADB_STORE_TEST",
        json.dumps({"conn_type": "deadline_batch_store", "host": store_url, "password": SECRET_PASSWORD}),
    )
    op = DeadlineShardPodOperator(
        task_id="shard",
        job_id=job_id,
        shard_index=0,
        image="worker:1",
        namespace="b",
        store_conn_id="adb_store_test",
        clock=ManualClock(T0),
    )
    assert op.prepare_try().action is TryAction.RUN  # the operator read the store through the connection
    text = json.dumps(manifest_of(op))
    assert SECRET_PASSWORD not in text and store_url not in text


def _pod(
    phase: str,
    *,
    reason: str | None = None,
    exit_code: int | None = None,
    term_reason: str | None = None,
    disruption: str | None = None,
) -> k8s.V1Pod:
    statuses = None
    if exit_code is not None:
        statuses = [
            k8s.V1ContainerStatus(
                name="base",
                image="img",
                image_id="",
                ready=False,
                restart_count=0,
                state=k8s.V1ContainerState(
                    terminated=k8s.V1ContainerStateTerminated(exit_code=exit_code, reason=term_reason)
                ),
            )
        ]
    conditions = None
    if disruption:
        conditions = [
            k8s.V1PodCondition(
                type="DisruptionTarget", status="True", reason=disruption, message="node is being reclaimed"
            )
        ]
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="p"),
        status=k8s.V1PodStatus(
            phase=phase, reason=reason, container_statuses=statuses, conditions=conditions
        ),
    )


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        (_pod("Succeeded", exit_code=0), PodOutcome.SUCCEEDED),
        (_pod("Failed", reason="Evicted"), PodOutcome.PREEMPTED),
        (_pod("Failed", reason="Terminated", exit_code=143), PodOutcome.PREEMPTED),
        (_pod("Failed", exit_code=137, disruption="TerminationByKubelet"), PodOutcome.PREEMPTED),
        (_pod("Failed", exit_code=75), PodOutcome.PREEMPTED),
        (_pod("Failed", exit_code=1), PodOutcome.TERMINAL),
        (_pod("Failed", exit_code=137, term_reason="OOMKilled"), PodOutcome.RETRYABLE),
        (_pod("Failed", exit_code=2), PodOutcome.RETRYABLE),
        (None, PodOutcome.RETRYABLE),
    ],
)
def test_classify_pod(pod, expected):
    assert classify_pod(pod).outcome is expected
