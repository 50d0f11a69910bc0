"""A shard task cleared while its retry was due is not taught Airflow's latency by the clear, with
Airflow's real ``dag.test()`` and its real clear (docs/airflow.md, *Resuming tasks*).

The try ledger times how late Airflow starts each run against the time the previous one asked for.
A start that a person's action decided (the task stopped while its retry was due, then cleared
later) is no measure of the scheduler; the ledger tells it by the task instance's ``max_tries``,
which Airflow's clear sets to the try number plus the task's retries and nothing else changes.

Two DAGs, each one shard task whose first try is preempted (injected; ``retries=1``, no delay):

* ``cleared``: try 1 fails, and the run stops while its retry is due (the task's
  ``on_retry_callback`` ends the process running ``dag.test()``, as a stopped scheduler would);
  then a person clears the task with Airflow's own clear (``DAG.clear``, what the UI and
  ``airflow tasks clear`` run), and a stand-in for the scheduler starts the run and the task
  again (try 2, run in process as ``dag.test()`` runs a task): its lateness is not counted;
* ``retried``: the same shard task retried by Airflow without a clear: its lateness is counted.

Runs in two subprocesses on one ``AIRFLOW_HOME`` (Airflow reads its configuration at import time),
one after the other: ``cleared``'s first run, which ends its process, then ``cleared``'s second and,
in the same (warm) interpreter, ``retried``'s, which depends on neither (tests/helpers/
warm_airflow.py: two process starts, not three, each ~20 s of CPU; CI's three test processes share
two cores, so running ``retried`` beside the others saved little time). The home starts with a
copy of the test run's migrated metadata database (tests/helpers/airflow_home.py), which each run's
migration finds current. The two DAGs' jobs share one manifest store.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from airflow_deadline_batch.core.failures import TryLedger
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.airflow_home import airflow_home
from tests.helpers.warm_airflow import WarmAirflow
from tests.integration.test_airflow_resume_race import _plan

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(450)]

DAG = """
import datetime as dt
import os
import sys
from airflow.sdk import DAG
from airflow_deadline_batch.operators.shard import LocalShardOperator


def stop_while_the_retry_is_due(context):
    # the retry is recorded (up_for_retry) and its due time is in the try ledger: the run stops here
    print(f"STOPPED after try {context['ti'].try_number}", flush=True)
    sys.stderr.flush()
    os._exit(0)


START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
for name in ("cleared", "retried"):
    with DAG(dag_id=name, schedule=None, start_date=START) as dag:
        LocalShardOperator(
            task_id="shard", job_id=JOBS[name], shard_index=0, store_url=STORE, retries=1,
            retry_delay=dt.timedelta(0), preempt_tries=[1], preempt_after_s=0.0,
            on_retry_callback=stop_while_the_retry_is_due if name == "cleared" else None,
        )
    globals()[name] = dag
"""

RUN = """
import datetime as dt, json, runpy, sys
from airflow.utils.db import upgradedb
upgradedb()
dag = runpy.run_path(sys.argv[1])[sys.argv[2]]
logical_date = dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)
if sys.argv[3] == "test":
    run = dag.test(logical_date=logical_date)
else:  # a person clears the task of the stopped run; the scheduler starts the run and the task again
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState

    DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).clear(
        start_date=logical_date, end_date=logical_date
    )
    with create_session() as session:
        run = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id).one()
        run.state = DagRunState.RUNNING
        ti = run.get_task_instance("shard", session=session)
        ti.try_number += 1
        ti.state = TaskInstanceState.SCHEDULED
        session.commit()
        _run_task(ti=ti, task=dag.task_dict["shard"])
from airflow.models.task_state_store import TaskStateStoreModel
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
with create_session() as session:
    ti = session.query(TaskInstance).filter(TaskInstance.dag_id == dag.dag_id).one()
    state = session.query(TaskStateStoreModel).filter(TaskStateStoreModel.dag_id == dag.dag_id).all()
    out = {
        "ti": [ti.try_number, str(ti.state), ti.max_tries],
        "state_store": {s.key: s.value for s in state},
    }
print("RESULT " + json.dumps(out))
"""


def _airflow(warm: WarmAirflow, dag_file: Path, dag: str, how: str) -> tuple[dict[str, Any] | None, str]:
    """Run ``dag`` with ``dag.test()`` (``how="test"``), or clear its task and run it again."""
    code, output = warm.run(RUN, str(dag_file), dag, how, timeout_s=140)
    assert code == 0, output[-8000:]
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1].removeprefix("RESULT ")) if lines else None), output


def _ledger(result: dict[str, Any]) -> TryLedger:
    value = result["state_store"][TRY_LEDGER_KEY]
    return TryLedger.from_dict(json.loads(value) if isinstance(value, str) else value)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("clear_latency")
    store_url = f"sqlite:///{root / 'store.db'}"
    jobs = {name: _plan(store_url, root, name, 10) for name in ("cleared", "retried")}
    dags = root / "dags"
    dags.mkdir()
    dag_file = dags / "clear_latency.py"
    dag_file.write_text(f"STORE = {store_url!r}\nJOBS = {jobs!r}\n" + textwrap.dedent(DAG))
    home = airflow_home(root / "home", tmp_path_factory)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
    }
    warm = WarmAirflow(env)
    try:
        stopped, first = _airflow(warm, dag_file, "cleared", "test")  # the retry callback ends it
        again, second = _airflow(warm, dag_file, "cleared", "clear")  # a new interpreter
        retried, third = _airflow(warm, dag_file, "retried", "test")
    finally:
        warm.close()
    store = ManifestStore.open(store_url)
    try:
        shards = {name: store.get_shard(job, 0) for name, job in jobs.items()}
    finally:
        store.close()
    return {
        "stopped": stopped,
        "cleared": again,
        "retried": retried,
        "shards": shards,
        "output": {"first": first, "second": second, "third": third},
    }


def test_the_first_run_stopped_while_the_retry_was_due(runs: dict[str, Any]) -> None:
    assert runs["stopped"] is None, runs["stopped"]  # the process ended in the retry callback
    assert "STOPPED after try 1" in runs["output"]["first"]


def test_a_start_after_airflows_clear_is_not_counted(runs: dict[str, Any]) -> None:
    cleared = runs["cleared"]
    assert cleared is not None and cleared["ti"][:2] == [2, "success"], cleared
    assert cleared["ti"][2] == 1 + 1  # Airflow's clear: the try number plus the retries
    assert runs["shards"]["cleared"].state is ShardState.SUCCEEDED
    ledger = _ledger(cleared)
    assert ledger.ended == {1, 2} and ledger.due_at is None, ledger
    assert ledger.late_s == 0.0 and ledger.late == (), ledger
    assert "try 2 started after the task was cleared" in runs["output"]["second"]


def test_a_retry_without_a_clear_is_counted(runs: dict[str, Any]) -> None:
    retried = runs["retried"]
    assert retried is not None and retried["ti"] == [2, "success", 1], retried
    ledger = _ledger(retried)
    assert ledger.late_s > 0.0 and len(ledger.late) == 1, ledger
