"""Example: the same job on Kubernetes, Spot GPU pods escalating to on-demand as slack shrinks.

Needs: an Airflow connection ``deadline_batch_store`` (PostgreSQL) for the operators, the same DSN in
the Kubernetes Secret ``deadline-batch-store`` (key ``url``) for the pods, the worker image
(``worker_image/``) in ``$ADB_WORKER_IMAGE``, and two Karpenter node pools (Spot and on-demand GPU).
Input and output live in S3: the Airflow tasks use the AWS connection ``aws_default``, the pods
their service account (IRSA). Both connections are named once, on the plan task: the shard tasks
and the sensor inherit them. See docs/kubernetes.md.
"""

from __future__ import annotations

import datetime as dt
import os

from airflow.sdk import DAG, AsyncCallback, DeadlineAlert, DeadlineReference, task

from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.notifiers.deadline_risk import DeadlineRiskNotifier
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import DEADLINE_WEIGHT_RULE, DeadlineShardPodOperator
from airflow_deadline_batch.sensors.completeness import CompletenessSensor

GPU = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
POOLS = [
    PoolSpec(
        name="l4-spot",
        kind=PoolKind.SPOT,
        gpus=8,
        price_per_gpu_hour=0.35,
        prefill_tokens_per_s=20_000,
        decode_tokens_per_s=1_500,
        startup_seconds=240,
        preemptions_per_hour=0.2,
        preemption_notice_seconds=120,
        node_selector={"karpenter.sh/capacity-type": "spot", "karpenter.k8s.aws/instance-gpu-name": "l4"},
        tolerations=(GPU,),
    ),
    PoolSpec(
        name="l4-on-demand",
        kind=PoolKind.ON_DEMAND,
        gpus=8,
        price_per_gpu_hour=0.80,
        prefill_tokens_per_s=20_000,
        decode_tokens_per_s=1_500,
        startup_seconds=240,
        node_selector={
            "karpenter.sh/capacity-type": "on-demand",
            "karpenter.k8s.aws/instance-gpu-name": "l4",
        },
        tolerations=(GPU,),
    ),
]

with DAG(
    dag_id="example_deadline_batch_kubernetes",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    catchup=False,
    tags=["deadline-batch", "example", "kubernetes"],
    # params are plain values (Airflow does not render templates inside params); the templates that
    # use them are in the operators' templated fields below. ``run_after`` is set on every run,
    # manual ones included (``ds`` is not: a manual run of an unscheduled DAG has no logical date).
    params={"bucket": "my-bucket", "deadline_hours": 6},
    default_args={"retries": 6, "retry_delay": dt.timedelta(seconds=30)},
    deadline=DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=dt.timedelta(hours=6),
        callback=AsyncCallback("airflow_deadline_batch.notifiers.deadline_risk.log_hard_deadline_miss"),
    ),
) as dag:
    at_risk = DeadlineRiskNotifier(threshold_s=1800)

    plan = DeadlineBatchOperator(
        task_id="plan",
        input_uri="s3://{{ params.bucket }}/batches/{{ dag_run.run_after | ds }}/requests.jsonl",
        output_uri="s3://{{ params.bucket }}/batch-results",
        deadline="{{ (dag_run.run_after + macros.timedelta(hours=params.deadline_hours)).isoformat() }}",
        store_conn_id="deadline_batch_store",
        aws_conn_id="aws_default",
        engine="vllm",
        model="HuggingFaceTB/SmolLM2-1.7B-Instruct",
        generation={"max_tokens": 256, "temperature": 0.0},
        pools=POOLS,
        workers=8,
        risk_notifier=at_risk,
        retries=0,
    )
    shards = DeadlineShardPodOperator.partial(
        task_id="shard",
        image=os.environ.get("ADB_WORKER_IMAGE", "ghcr.io/example/deadline-batch-worker:0.1.0"),
        namespace=os.environ.get("ADB_NAMESPACE", "deadline-batch"),
        store_secret_name="deadline-batch-store",
        service_account_name="deadline-batch-worker",
        get_logs=True,
        on_finish_action="delete_succeeded_pod",
        # wait for each GPU pod in the triggerer, not in a worker slot (shards run for hours);
        # at most the plan's 8 workers run at once, without an XCom sidecar (the defaults)
        deferrable=True,
        poll_interval=30,
        # the shards of the job due soonest are queued first (docs/airflow.md, *Priority weights*)
        weight_rule=DEADLINE_WEIGHT_RULE,
    ).expand_kwargs(plan.output)
    done = CompletenessSensor(
        task_id="verify",
        plan_task_id="plan",  # the job and its connections, from the plan task
        deferrable=True,
        poke_interval=60,
        timeout=8 * 3600,
        expire_unfinished=True,
        risk_notifier=at_risk,
        retries=0,
    )

    @task
    def announce(manifest_uri: str) -> str:
        print(f"published {manifest_uri}")
        return manifest_uri

    # The sensor waits beside the shard pods, in the triggerer: it warns on-call while they run
    # (risk_notifier) and publishes as soon as the store says every shard is over.
    plan >> [shards, done]
    announce(done.output)
