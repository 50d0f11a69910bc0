"""Against a real cluster (``KUBECONFIG`` set; skipped otherwise): see docs/kubernetes.md.

The shard pod for a high-slack and a low-slack try is accepted by the API server (server-side dry
run: admission webhooks, quota and schema see it, nothing is scheduled).
"""

from __future__ import annotations

import datetime as dt
import os

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator
from airflow_deadline_batch.store import ManifestStore, NewJob, NewShard

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs KUBECONFIG (a real cluster)"),
]

NAMESPACE = os.environ.get("ADB_SYSTEM_NAMESPACE", "default")
POOLS = [
    PoolSpec(name="spot", kind=PoolKind.SPOT, startup_seconds=60, preemption_notice_seconds=30),
    PoolSpec(name="on-demand", kind=PoolKind.ON_DEMAND, startup_seconds=60),
]


def _job(store: ManifestStore, now: dt.datetime) -> str:
    job, _ = store.create_job(
        NewJob(
            deadline=now + dt.timedelta(hours=1),
            input_uri="/in",
            input_sha256="0" * 64,
            input_lines=1,
            input_total_lines=1,
            output_uri="/out",
            config={"workers": 1},
        ),
        [
            NewShard(
                shard_index=0,
                byte_start=0,
                byte_end=1,
                first_line=1,
                line_count=1,
                records=1,
                num_microbatches=1,
                input_sha256="0" * 64,
                est_work_s=60.0,
            )
        ],
        None,
    )
    return job.job_id


@pytest.mark.parametrize("minutes_later", [0, 58])
def test_api_server_accepts_the_shard_pod(tmp_path, minutes_later):
    from kubernetes import client, config

    config.load_kube_config()
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = ManifestStore(url)
    store.migrate()
    now = dt.datetime.now(dt.timezone.utc)
    op = DeadlineShardPodOperator(
        task_id="shard",
        job_id=_job(store, now),
        shard_index=0,
        image="busybox:1.36",
        namespace=NAMESPACE,
        store_url=url,
        pools=POOLS,
        gpus_per_pod=0,
        capacity_label=None,
        clock=ManualClock(now + dt.timedelta(minutes=minutes_later)),
    )
    op.prepare_try()
    pod = op.build_pod_request_obj(dry_run=True)
    created = client.CoreV1Api().create_namespaced_pod(NAMESPACE, pod, dry_run="All")
    assert created.metadata.labels["deadline-batch.io/capacity"] in {"spot", "on-demand"}
