"""Shard tasks' priority weights under Airflow's real scheduler code (``dag.test()``).

A DAG plans three jobs on the sample input (due in 1 h, 3 h, and 2 h through a Jinja template) and
maps a shard task over each plan's output with ``weight_rule=DEADLINE_WEIGHT_RULE``. Airflow
computes each task instance's ``priority_weight`` as it creates it; the weights are read back
from Airflow's database. Runs in a subprocess with its own ``AIRFLOW_HOME`` (Airflow reads its
configuration at import time); most of its ~30 s is migrating a fresh metadata database.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from airflow_deadline_batch.plugins.priority import deadline_weight

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "dags" / "data" / "sample_reviews.jsonl"

DAG = """
import datetime as dt
from airflow.sdk import DAG, task
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import DEADLINE_WEIGHT_RULE

with DAG(dag_id="weights", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
         params={"templated": "+2h"}) as dag:
    @task(weight_rule=DEADLINE_WEIGHT_RULE)
    def shard(job_id: str, shard_index: int) -> None:
        print(job_id, shard_index)

    for name, deadline in (("soon", "+1h"), ("late", "+3h"), ("templated", "{{ params.templated }}")):
        plan = DeadlineBatchOperator(
            task_id=f"plan_{name}", input_uri=INPUT, output_uri=OUTPUT, deadline=deadline,
            store_url=STORE, workers=2, microbatch_size=4,
        )
        shard.override(task_id=f"shard_{name}").expand_kwargs(plan.output)
"""

RUN = """
import json, runpy, sys
from airflow.utils.db import upgradedb
upgradedb()
dag = runpy.run_path(sys.argv[1])["dag"]
run = dag.test()
from airflow.models.taskinstance import TaskInstance
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
with create_session() as session:
    tis = session.query(TaskInstance).filter(TaskInstance.dag_id == "weights").all()
    rows = [[t.task_id, t.map_index, t.priority_weight, str(t.state)] for t in tis]
    reports = XComModel.get_many(run_id=run.run_id, key="admission_report", dag_ids="weights")
    deadlines = {x.task_id: XComModel.deserialize_value(x)["deadline"] for x in session.scalars(reports)}
    out = {"state": str(run.state), "tis": rows, "deadlines": deadlines}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = home / "dags"
    dags.mkdir()
    header = (
        f"INPUT = {str(SAMPLE)!r}\nOUTPUT = {str(home / 'out')!r}\nSTORE = {f'sqlite:///{home}/store.db'!r}\n"
    )
    dag_file = dags / "weights.py"
    dag_file.write_text(header + textwrap.dedent(DAG))
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
    }
    proc = subprocess.run(
        [sys.executable, "-c", RUN, str(dag_file)], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-5000:]
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def _shards(result: dict[str, Any], name: str) -> dict[int, int]:
    return {index: weight for task_id, index, weight, _ in result["tis"] if task_id == f"shard_{name}"}


def test_shards_of_the_job_due_sooner_weigh_more(weights: dict[str, Any]) -> None:
    assert weights["state"].endswith("success"), weights
    soon, late = _shards(weights, "soon"), _shards(weights, "late")
    assert len(soon) >= 2 and len(late) >= 2, weights
    assert min(soon.values()) > max(late.values())
    # two hours apart: about 120 weight units (one a minute)
    assert 100 < min(soon.values()) - max(late.values()) < 140


def test_expanded_shards_weigh_by_the_deadline_the_plan_reported(weights: dict[str, Any]) -> None:
    for name in ("soon", "late", "templated"):
        deadline = dt.datetime.fromisoformat(weights["deadlines"][f"plan_{name}"].replace("Z", "+00:00"))
        expanded = {i: w for i, w in _shards(weights, name).items() if i > 0}
        assert expanded and set(expanded.values()) == {deadline_weight(deadline)}, (name, weights)


def test_map_index_0_keeps_the_weight_airflow_gave_it_before_the_plan_ran(weights: dict[str, Any]) -> None:
    """Index 0 is the placeholder created with the run: a literal deadline ranks it, a template cannot."""
    soon, late, templated = (_shards(weights, n) for n in ("soon", "late", "templated"))
    assert abs(soon[0] - soon[1]) <= 2 and abs(late[0] - late[1]) <= 2  # "+1h" read a moment earlier
    assert templated[0] == 1  # the fixed weight: "{{ params.templated }}" is not rendered by then
    assert late[1] < templated[1] < soon[1]
