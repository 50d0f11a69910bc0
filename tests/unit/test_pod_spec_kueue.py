"""Shard pods for Kueue: the tenant's LocalQueue and a priority class from the slack, validated offline."""

from __future__ import annotations

import datetime as dt

import kubernetes_validate
import pytest
from kubernetes.client import ApiClient

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.tenants import (
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    priority_class_for_slack,
)
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.shards import uniform_shards
from tests.unit.test_pod_spec import ON_DEMAND, SPOT, T0

NEW_JOB_FIELDS = {
    "deadline": T0 + dt.timedelta(hours=2),
    "input_uri": "/data/in.jsonl",
    "input_sha256": "0" * 64,
    "input_lines": 40,
    "input_total_lines": 40,
    "output_uri": "/data/out",
    "config": {"workers": 2, "engine": "echo", "pools": [SPOT.to_dict(), ON_DEMAND.to_dict()]},
}


@pytest.fixture()
def job(tmp_path) -> tuple[str, str]:
    from airflow_deadline_batch.store import NewJob

    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    job, _ = store.create_job(
        NewJob(**NEW_JOB_FIELDS, tenant="ads"),  # type: ignore[arg-type]
        uniform_shards(4, microbatches=3, est_work_s=600.0),
    )
    store.close()
    return url, job.job_id


def _pod(url: str, job_id: str, now: dt.datetime, *, kueue: bool) -> tuple[dict, float]:
    op = DeadlineShardPodOperator(
        task_id="shard",
        job_id=job_id,
        shard_index=1,
        image="registry.example.com/deadline-batch-worker:0.1.0",
        namespace="batch",
        store_url=url,
        clock=ManualClock(now),
        kueue=kueue,
    )
    decision = op.prepare_try()
    assert decision.placement is not None
    manifest = ApiClient().sanitize_for_serialization(op.build_pod_request_obj(dry_run=True))
    kubernetes_validate.validate(manifest, "1.30", strict=True)
    return manifest, decision.placement.slack_s


@pytest.mark.parametrize("minutes_in", [0, 90, 118])
def test_kueue_labels_name_the_tenant_queue_and_the_slack_priority(job, minutes_in: int) -> None:
    url, job_id = job
    manifest, slack = _pod(url, job_id, T0 + dt.timedelta(minutes=minutes_in), kueue=True)
    labels = manifest["metadata"]["labels"]
    assert labels[KUEUE_QUEUE_LABEL] == "ads"
    assert labels[KUEUE_PRIORITY_LABEL] == priority_class_for_slack(slack)
    if minutes_in == 118:  # two minutes before the deadline with all the work left
        assert slack < 0 and labels[KUEUE_PRIORITY_LABEL] == "deadline-batch-urgent"


def test_without_kueue_no_queue_labels(job) -> None:
    url, job_id = job
    manifest, _ = _pod(url, job_id, T0, kueue=False)
    assert KUEUE_QUEUE_LABEL not in manifest["metadata"]["labels"]


@pytest.mark.parametrize(
    ("slack_s", "name"),
    [(-10.0, "deadline-batch-urgent"), (3599.0, "deadline-batch-urgent"), (3600.0, "deadline-batch-normal"),
     (6 * 3600.0, "deadline-batch-relaxed"), (float("inf"), "deadline-batch-relaxed")],
)  # fmt: skip
def test_priority_bands(slack_s: float, name: str) -> None:
    assert priority_class_for_slack(slack_s) == name


def test_docs_define_the_priority_classes_the_pods_name() -> None:
    """docs/kubernetes.md's Kueue objects: one WorkloadPriorityClass per band, with its value."""
    from pathlib import Path

    import yaml

    from airflow_deadline_batch.core.tenants import PRIORITY_BANDS

    text = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    block = text.split("## Kueue: tenants and priorities")[1].split("```yaml")[1].split("```")[0]
    objects = list(yaml.safe_load_all(block))
    classes = {o["metadata"]["name"]: o["value"] for o in objects if o["kind"] == "WorkloadPriorityClass"}
    assert classes == {name: value for _, name, value in PRIORITY_BANDS}
    flavors = [
        f["name"]
        for o in objects
        if o["kind"] == "ClusterQueue"
        for f in o["spec"]["resourceGroups"][0]["flavors"]
    ]
    assert flavors == ["gpu-spot", "gpu-on-demand"]


def _kueue_objects() -> list[dict]:
    """The Kueue objects of docs/kubernetes.md's YAML block (the one with a ClusterQueue)."""
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kind: ClusterQueue" in b]
    return [doc for doc in yaml.safe_load_all(block) if doc]


def test_the_documented_kueue_objects_admit_the_pods_the_operator_builds(job) -> None:
    """Priority classes are the bands; each try's pod fits exactly one flavor; its GPUs are covered."""
    from airflow_deadline_batch.core.tenants import PRIORITY_BANDS

    objects = _kueue_objects()
    classes = {o["metadata"]["name"]: o["value"] for o in objects if o["kind"] == "WorkloadPriorityClass"}
    assert classes == {name: value for _, name, value in PRIORITY_BANDS}
    flavors = {
        o["metadata"]["name"]: o["spec"]["nodeLabels"] for o in objects if o["kind"] == "ResourceFlavor"
    }
    (queue,) = [o for o in objects if o["kind"] == "ClusterQueue"]
    (group,) = queue["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == list(flavors)  # every flavor is in the queue
    local_queues = {o["metadata"]["name"] for o in objects if o["kind"] == "LocalQueue"}
    url, job_id = job
    used = set()
    for minutes_in in (0, 118):  # a Spot try, then an on-demand one near the deadline
        manifest, _ = _pod(url, job_id, T0 + dt.timedelta(minutes=minutes_in), kueue=True)
        spec, labels = manifest["spec"], manifest["metadata"]["labels"]
        selector = spec.get("nodeSelector") or {}
        fitting = [
            name for name, node_labels in flavors.items()
            if all(selector.get(k, v) == v for k, v in node_labels.items())
        ]  # fmt: skip
        assert len(fitting) == 1, (selector, flavors)
        used.add(fitting[0])
        assert labels[KUEUE_QUEUE_LABEL] in local_queues and labels[KUEUE_PRIORITY_LABEL] in classes
        requested = set(spec["containers"][0]["resources"]["limits"])
        assert requested <= set(group["coveredResources"])
    assert used == set(flavors)
