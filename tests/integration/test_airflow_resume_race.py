"""Shard tasks whose tries Airflow fails from outside (the resume race), under Airflow's real
``dag.test()`` and its real scheduler code.

Airflow 3.3's scheduler fails a task that resumed (same try number) before it processed the
executor's report of the exit that handed the slot back (docs/airflow.md, *Resuming tasks*). Here a
stand-in for a scheduler that is always late does exactly that at every resume: the shard task's
``pre_execute`` hook, run in the task's process as ``dag.test()`` runs it, hands the stale
"success" report of the try's earlier run to Airflow's own
``SchedulerJobRunner.process_executor_events`` (which fails the running try: "finished with state
success, but the task instance's state attribute is running", one retry spent), then ends the run
as the supervisor would once the server says so. Nothing of Airflow's is mocked; the workers are
real subprocesses on a real SQLite store; ``[deadline_batch] min_resume_delay_s`` comes from the
environment (0 s, so that reschedules come back at once).

Two shard tasks with ``retries=1``:

* ``shard_ok``: try 1 is preempted (injected), rescheduled, and lost to the race on its resume;
  try 2 is Airflow's last: it is preempted too, but runs again in its own slot and finishes.
* ``shard_budget``: every worker crashes after its first write (``max_attempts=3``); try 1 is lost
  to the race after its first crash; try 2 keeps its slot and runs the store's budget out: the
  shard fails after exactly ``max_attempts`` counted failures, never on Airflow's retries.

Runs in a subprocess with its own ``AIRFLOW_HOME`` (Airflow reads its configuration at import
time), which starts with a copy of the test run's migrated metadata database
(tests/helpers/airflow_home.py); one run serves all four tests.
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

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.airflow_home import airflow_home
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

DAG = """
import datetime as dt
from airflow.sdk import DAG
from airflow_deadline_batch.operators.shard import LocalShardOperator


def late_scheduler(context):
    # a resumed run of a try (its TI has a reschedule row): the late executor report fails it
    from sqlalchemy import func, select
    from airflow.executors.base_executor import BaseExecutor
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dagbag import DBDagBag
    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.models.taskreschedule import TaskReschedule
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    ti = context["ti"]
    with create_session() as session:
        resumed = session.scalar(select(func.count()).where(TaskReschedule.ti_id == ti.id))
        if not resumed:
            return
        executor = BaseExecutor()
        key = TaskInstanceKey(ti.dag_id, ti.task_id, ti.run_id, ti.try_number, ti.map_index)
        executor.event_buffer[key] = (TaskInstanceState.SUCCESS, None)
        SchedulerJobRunner.process_executor_events(
            executor=executor, job_id=None, scheduler_dag_bag=DBDagBag(), session=session
        )
    print(f"LATE_SCHEDULER failed try {ti.try_number} of {ti.task_id}", flush=True)
    raise RuntimeError("Server indicated the task shouldn't be running anymore")


def disk_full_once(context):
    # the first run's worker finds its disk full (ENOSPC: transient, rescheduled); the run Airflow
    # resumes finds it freed
    import os

    seen = FULL + ".seen"
    if os.path.exists(seen):
        if os.path.exists(FULL):
            os.unlink(FULL)
    else:
        open(seen, "w").close()
        open(FULL, "w").close()


START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
with DAG(dag_id="resume_race", schedule=None, start_date=START) as dag:
    common = dict(
        shard_index=0, store_url=STORE, retries=1, retry_delay=dt.timedelta(0), pre_execute=late_scheduler
    )
    LocalShardOperator(
        task_id="shard_ok", job_id=JOBS["ok"], preempt_tries=[1, 2], preempt_after_s=0.0,
        reschedule_retryable=True, **common,
    )
    LocalShardOperator(
        task_id="shard_budget", job_id=JOBS["budget"], env={"ADB_FAULT_KILL_AFTER_WRITE_PROB": "1"}, **common
    )
    LocalShardOperator(  # no late scheduler: its reschedule resumes as Airflow resumes any
        task_id="shard_resumed", job_id=JOBS["resumed"], shard_index=0, store_url=STORE, retries=1,
        retry_delay=dt.timedelta(0), env={"ADB_FAULT_DISK_FULL": FULL}, pre_execute=disk_full_once,
    )
"""

RUN = """
import json, runpy, sys
from airflow.utils.db import upgradedb
upgradedb()
dag = runpy.run_path(sys.argv[1])["dag"]
run = dag.test()
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from airflow.models.task_state_store import TaskStateStoreModel
from airflow.utils.session import create_session
with create_session() as session:
    tis = session.query(TaskInstance).filter(TaskInstance.dag_id == "resume_race").all()
    mismatches = session.query(Log).filter(Log.event == "state mismatch", Log.dag_id == "resume_race").all()
    state = session.query(TaskStateStoreModel).filter(TaskStateStoreModel.dag_id == "resume_race").all()
    out = {
        "state": str(run.state),
        "tis": {t.task_id: [t.try_number, str(t.state)] for t in tis},
        "mismatches": sorted([m.task_id, m.try_number] for m in mismatches),
        "state_store": {f"{s.task_id}/{s.key}": s.value for s in state},
    }
print("RESULT " + json.dumps(out))
"""


def _plan(store_url: str, tmp_path: Path, name: str, max_attempts: int) -> str:
    mixed = mixed_input(12, seed=3, bad_fraction=0.0, blank_fraction=0.0)
    store = ManifestStore.open(store_url)
    try:
        return plan_job(
            store,
            PlanRequest(
                input_uri=str(mixed.write(tmp_path / f"{name}.jsonl")),
                deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
                output_uri=str(tmp_path / f"out-{name}"),
                engine="echo",
                pools=default_local_pools("echo"),
                workers=1,
                microbatch_size=4,
                max_shards=1,
                max_attempts=max_attempts,
            ),
        ).job_id
    finally:
        store.close()


@pytest.fixture(scope="module")
def raced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = airflow_home(tmp_path_factory.mktemp("airflow_home"), tmp_path_factory)
    store_url = f"sqlite:///{home / 'store.db'}"
    jobs = {
        "ok": _plan(store_url, home, "ok", 10),
        "budget": _plan(store_url, home, "budget", 3),
        "resumed": _plan(store_url, home, "resumed", 10),
    }
    dags = home / "dags"
    dags.mkdir()
    dag_file = dags / "resume_race.py"
    full = str(home / "disk-full")
    dag_file.write_text(f"STORE = {store_url!r}\nJOBS = {jobs!r}\nFULL = {full!r}\n" + textwrap.dedent(DAG))
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", RUN, str(dag_file)], env=env, capture_output=True, text=True, timeout=280
    )
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, output[-8000:]
    result = dict(json.loads(lines[-1].removeprefix("RESULT ")))
    store = ManifestStore.open(store_url)
    try:
        result["shards"] = {name: store.get_shard(job, 0) for name, job in jobs.items()}
    finally:
        store.close()
    result["output"] = output
    return result


def _ledger(result: dict[str, Any], task_id: str) -> dict[str, Any]:
    value = result["state_store"][f"{task_id}/{TRY_LEDGER_KEY}"]
    return dict(json.loads(value) if isinstance(value, str) else value)


def test_airflow_itself_failed_the_resumed_tries(raced: dict[str, Any]) -> None:
    # Airflow's scheduler code recorded the state mismatch of try 1 of each task, and only try 1:
    # try 2, Airflow's last, never handed its slot back, so it never resumed
    assert raced["mismatches"] == [["shard_budget", 1], ["shard_ok", 1]], raced["mismatches"]
    assert "LATE_SCHEDULER failed try 2" not in raced["output"]


def test_a_shard_whose_tries_airflow_failed_still_finishes(raced: dict[str, Any]) -> None:
    assert raced["tis"]["shard_ok"] == [2, "success"], raced["tis"]
    assert raced["shards"]["ok"].state is ShardState.SUCCEEDED
    ledger = _ledger(raced, "shard_ok")
    assert ledger["lost"] == [1] and ledger["handed_back"] == [1], ledger
    assert "try 1 was ended by Airflow, not by this operator" in raced["output"]


def test_the_store_budget_not_airflow_retries_fails_a_shard(raced: dict[str, Any]) -> None:
    shard = raced["shards"]["budget"]
    assert raced["tis"]["shard_budget"] == [2, "failed"], raced["tis"]
    # every counted failure of the store's budget ran, though Airflow had one retry and lost it
    assert shard.state is ShardState.TERMINAL_FAILURE and shard.failures == 3, shard
    assert _ledger(raced, "shard_budget")["lost"] == [1]
    assert "is Airflow's last (max_tries=1): it keeps its worker slot" in raced["output"]


def test_a_resumed_try_measures_how_late_airflow_started_it(raced: dict[str, Any]) -> None:
    """The ledger's turnaround times through Airflow's real task state store: the preempted try
    asked to run again at once (resume delay 0); Airflow started it later, which the placement now
    allows for (docs/airflow.md, *Resuming tasks*). A lost try's due time is not measured."""
    assert raced["tis"]["shard_resumed"] == [1, "success"], raced["tis"]
    ledger = _ledger(raced, "shard_resumed")
    assert ledger["handed_back"] == [1] and ledger["lost"] == [], ledger
    assert ledger["due_at"] is None  # it succeeded: nothing is due
    assert 0.0 < ledger["late_s"] < 280.0, ledger  # later than asked, within the run's time
    assert "try 1 started" in raced["output"] and "after it was due" in raced["output"]
    assert _ledger(raced, "shard_ok")["late_s"] == 0.0  # started after a lost try: not measured
