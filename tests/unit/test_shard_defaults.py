"""Shard task defaults that fit GPU pods: no XCom sidecar, concurrency bounded by the plan's workers."""

from __future__ import annotations

import datetime as dt
import warnings

import pytest
from airflow.sdk import DAG

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import DeadlineShardPodOperator, LocalShardOperator
from tests.unit.test_pod_spec import T0, job_id, manifest_of, store_url  # noqa: F401 - fixtures

START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def plan_operator(workers: int = 3) -> DeadlineBatchOperator:
    return DeadlineBatchOperator(
        task_id="plan", input_uri="in.jsonl", output_uri="out", deadline="+1h", workers=workers
    )


@pytest.mark.parametrize("operator", [DeadlineShardPodOperator, LocalShardOperator])
def test_mapped_shards_run_at_most_the_plans_workers_at_once(operator: type) -> None:
    extra = {"image": "worker:1"} if operator is DeadlineShardPodOperator else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "Task ... was never mapped!"
        with DAG("bounded", schedule=None, start_date=START):
            plan = plan_operator(workers=3)
            shards = operator.partial(task_id="shard", **extra).expand_kwargs(plan.output)
    assert shards.max_active_tis_per_dagrun == 3


def test_an_explicit_bound_wins_over_the_plans_workers() -> None:
    with DAG("explicit", schedule=None, start_date=START, default_args={"max_active_tis_per_dagrun": 1}):
        plan = plan_operator(workers=8)
        from_defaults = DeadlineShardPodOperator.partial(task_id="a", image="w").expand_kwargs(plan.output)
        given = DeadlineShardPodOperator.partial(
            task_id="b", image="w", max_active_tis_per_dagrun=2
        ).expand_kwargs(plan.output)
    assert from_defaults.max_active_tis_per_dagrun == 1
    assert given.max_active_tis_per_dagrun == 2


def test_the_bound_survives_dag_serialization() -> None:
    from airflow.serialization.serialized_objects import DagSerialization

    with DAG("serialized", schedule=None, start_date=START) as dag:
        plan = plan_operator(workers=4)
        DeadlineShardPodOperator.partial(task_id="shard", image="w").expand_kwargs(plan.output)
    restored = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert restored.get_task("shard").max_active_tis_per_dagrun == 4


def test_shard_pods_have_no_xcom_sidecar(store_url: str, job_id: str) -> None:  # noqa: F811
    op = DeadlineShardPodOperator(
        task_id="shard",
        job_id=job_id,
        shard_index=0,
        image="worker:1",
        namespace="batch",
        store_url=store_url,
        clock=ManualClock(T0),
    )
    assert op.do_xcom_push is False
    op.prepare_try()
    spec = manifest_of(op)["spec"]
    assert [c["name"] for c in spec["containers"]] == ["base"]  # no airflow-xcom-sidecar
    assert not spec.get("volumes")  # nor its shared xcom volume


def test_mapped_shards_keep_their_default_retries_unless_the_dag_sets_them() -> None:
    with DAG("retries", schedule=None, start_date=START):
        plan = plan_operator()
        plain = DeadlineShardPodOperator.partial(task_id="a", image="w").expand_kwargs(plan.output)
        local = LocalShardOperator.partial(task_id="b").expand_kwargs(plan.output)
        given = DeadlineShardPodOperator.partial(task_id="c", image="w", retries=1).expand_kwargs(plan.output)
    with DAG("dag_retries", schedule=None, start_date=START, default_args={"retries": 2}):
        plan = plan_operator()
        from_dag = DeadlineShardPodOperator.partial(task_id="d", image="w").expand_kwargs(plan.output)
    assert plain.partial_kwargs["retries"] == local.partial_kwargs["retries"] == 5
    assert given.partial_kwargs["retries"] == 1
    assert from_dag.partial_kwargs["retries"] == 2


def test_the_weight_rule_names_the_registered_strategy_and_pools_follow_tenants() -> None:
    from airflow._shared.module_loading import qualname

    from airflow_deadline_batch.operators.shard import DEADLINE_WEIGHT_RULE, tenant_pool
    from airflow_deadline_batch.plugins.priority import DeadlineWeightStrategy
    from airflow_deadline_batch.plugins.progress import DeadlineBatchPlugin

    assert qualname(DeadlineWeightStrategy) == DEADLINE_WEIGHT_RULE
    assert DeadlineWeightStrategy in DeadlineBatchPlugin.priority_weight_strategies
    assert tenant_pool("ads") == "deadline-batch-ads"
    with pytest.raises(ValueError, match="not a valid name"):
        tenant_pool("Ads Team")
