"""Both example DAG files import without errors in Airflow's DagBag."""

from __future__ import annotations

from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert {"example_deadline_batch_local", "example_deadline_batch_kubernetes"} <= set(dagbag.dag_ids)


@pytest.mark.parametrize(
    ("dag_id", "sensor_beside_shards"),
    [("example_deadline_batch_local", False), ("example_deadline_batch_kubernetes", True)],
)
def test_shape_plan_shards_verify(dagbag, dag_id, sensor_beside_shards):
    dag = dagbag.dags[dag_id]
    if sensor_beside_shards:  # waits in the triggerer while the shards run (warns on-call in time)
        assert sorted(t.task_id for t in dag.get_task("plan").downstream_list) == ["shard", "verify"]
        assert not dag.get_task("shard").downstream_list
    else:  # after the shards: dag.test() runs a deferred trigger in line, so it must not wait
        assert [t.task_id for t in dag.get_task("plan").downstream_list] == ["shard"]
        assert [t.task_id for t in dag.get_task("shard").downstream_list] == ["verify"]
    assert dag.get_task("verify").outlets  # the manifest Asset
    assert dag.deadline is not None


def test_kubernetes_plan_renders_input_output_and_deadline_from_the_run(dagbag):
    """Params hold plain values (Airflow does not render them); the plan's templated fields do."""
    import datetime as dt
    import types

    from airflow.sdk.execution_time import macros

    dag = dagbag.dags["example_deadline_batch_kubernetes"]
    params = dag.params.dump()
    assert not any("{{" in str(v) for v in params.values()), params
    task = dag.get_task("plan")
    run_after = dt.datetime(2026, 12, 1, 0, 30, tzinfo=dt.timezone.utc)
    context = {"params": params, "dag_run": types.SimpleNamespace(run_after=run_after), "macros": macros}
    task.render_template_fields(context, dag.get_template_env())
    assert task.input_uri == f"s3://{params['bucket']}/batches/2026-12-01/requests.jsonl"
    assert task.output_uri == f"s3://{params['bucket']}/batch-results"
    deadline = dt.datetime.fromisoformat(task.deadline)
    assert deadline == run_after + dt.timedelta(hours=params["deadline_hours"])


def test_kubernetes_shards_fit_gpus_and_name_no_connection(dagbag):
    dag = dagbag.dags["example_deadline_batch_kubernetes"]
    plan, shard, verify = (dag.get_task(t) for t in ("plan", "shard", "verify"))
    assert shard.max_active_tis_per_dagrun == plan.workers == 8  # the plan's budget, by default
    assert shard.partial_kwargs["deferrable"] is True
    assert "do_xcom_push" not in shard.partial_kwargs  # left to the operator's default: no sidecar
    # the connections are named on the plan only; the shards and the sensor inherit them
    assert plan.store_conn_id == "deadline_batch_store" and plan.aws_conn_id == "aws_default"
    assert "store_conn_id" not in shard.partial_kwargs
    assert verify.plan_task_id == "plan" and verify.store_conn_id is None
