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


@pytest.mark.parametrize("dag_id", ["example_deadline_batch_local", "example_deadline_batch_kubernetes"])
def test_shape_plan_shards_verify(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert [t.task_id for t in dag.get_task("plan").downstream_list] == ["shard"]
    assert [t.task_id for t in dag.get_task("shard").downstream_list] == ["verify"]
    assert dag.get_task("verify").outlets  # the manifest Asset
    assert dag.deadline is not None
