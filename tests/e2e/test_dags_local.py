"""The local example DAG end to end under Airflow's real ``dag.test()``, with injected preemptions.

Each run goes through ``scripts/run_example_dag.py`` (the README's demo path), run as its
``__main__`` with the module's ``AIRFLOW_HOME`` (Airflow reads its configuration at import time) in
one warm interpreter the module's runs share (tests/helpers/warm_airflow.py: Airflow's fixed start-up
cost once, not per run); the script migrates the SQLite metadata database, runs ``dag.test()`` and
prints a JSON summary read back from Airflow's database and the manifest store. The worker engine is
``echo`` (the DAG's default). The tests of derived examples share another interpreter, on a home of
their own whose DAG folder holds one derived example per test, each under its own ``dag_id``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.store import ManifestStore
from tests.e2e.derived_dag import derived_source
from tests.helpers.airflow_home import airflow_home
from tests.helpers.outcomes import read_manifest, read_outcomes
from tests.helpers.warm_airflow import WarmAirflow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "run_example_dag.py"
SAMPLE = REPO / "dags" / "data" / "sample_reviews.jsonl"
EXAMPLE = REPO / "dags" / "example_deadline_batch_local.py"


#: ``python SCRIPT ARGS...``: the script run as ``__main__`` with its arguments (argv[1], argv[2:])
RUN_SCRIPT = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmAirflow]:
    """The interpreter running the script for this module's tests, on one ``AIRFLOW_HOME``: a
    fresh one, which the first run migrates as a newcomer's does."""
    home = tmp_path_factory.mktemp("airflow_home")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "ADB_EXAMPLE_DIR": str(home / "example"),
        "ADB_ENGINE": "echo",
        "ADB_EXAMPLE_PREEMPT_TRIES": "1",
    }
    for name in ("ADB_STORE_URL", "ADB_EXAMPLE_INPUT", "ADB_EXAMPLE_DEADLINE"):
        env.pop(name, None)
    warm = WarmAirflow(env)
    yield warm
    warm.close()


def run_dag(example: WarmAirflow, conf: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    """Run the example DAG through the script; its exit status, JSON summary and whole output."""
    args = ["--json", "--samples", "3", "--conf", json.dumps(conf)]
    code, output = example.run(RUN_SCRIPT, str(SCRIPT), *args, timeout_s=300)
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-5000:]
    return code, json.loads(lines[-1].removeprefix("RESULT ")), output


def states(result: dict[str, Any], task_id: str) -> list[str]:
    return [state for _, state, _ in result["tasks"].get(task_id, [])]


def file_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def test_local_dag_publishes_one_outcome_per_line_despite_preemptions(example, tmp_path):
    code, result, output = run_dag(example, {"output_uri": str(tmp_path / "out"), "deadline": "+2h"})

    assert code == 0 and result["state"] == "success", output[-5000:]
    assert states(result, "plan") == ["success"]
    assert len(states(result, "shard")) >= 2 and set(states(result, "shard")) == {"success"}
    assert states(result, "verify") == ["success"] and states(result, "summarise") == ["success"]
    # the injected preemption hit every shard's first try, and Airflow's retry finished each one
    assert "injecting a preemption" in output and "preempted (worker exit" in output
    assert {tries for _, _, tries in result["tasks"]["shard"]} == {2}
    # the sensor runs after the shards: the job is over, so it publishes without deferring
    assert "[DAG TEST] running trigger in line" not in output and "every shard succeeded" in output

    manifest_uri = result["manifest"]
    assert manifest_uri and file_path(manifest_uri).is_relative_to(tmp_path / "out" / result["job_id"])
    manifest = json.loads(file_path(manifest_uri).read_text())
    numbered = list(enumerate(SAMPLE.read_text().splitlines(), start=1))
    records = [number for number, line in numbered if line.strip()]  # blank lines get no outcome
    assert len(records) < len(numbered)  # the sample has a blank line, so this checks numbering
    assert manifest["job_id"] == result["job_id"] and result["job_state"] == "completed"
    assert sum(manifest["outcomes"].values()) == len(records) and manifest["outcomes"] == result["outcomes"]
    seen: list[int] = []
    for entry in manifest["shards"]:
        for row in file_path(entry["uri"]).read_text().splitlines():
            seen.append(json.loads(row)["line"])
    assert sorted(seen) == records  # one outcome per input line, none twice

    (event,) = result["asset_events"]
    assert event["task_id"] == "verify"
    assert event["uri"] == "deadline-batch://manifests/example_deadline_batch_local/verify"
    assert event["extra"]["manifest_uri"] == manifest_uri and event["extra"]["records"] == len(records)
    assert len(result["samples"]) == 3 and all(s["output"].startswith("echo: ") for s in result["samples"])


def test_infeasible_deadline_fails_at_plan_and_nothing_downstream_runs(example, tmp_path):
    """The sensor runs after the failed plan (its trigger rule is ``all_done``) and ends in one line
    saying so, rather than looking for a job that was never planned."""
    code, result, output = run_dag(example, {"output_uri": str(tmp_path / "out"), "deadline": "+1s"})

    assert code == 1 and result["state"] == "failed"
    assert states(result, "plan") == ["failed"]
    assert "job rejected at admission" in output and "infeasible" in output
    assert "slack" in output  # the admission report's reasons reach the task log
    for task_id in ("shard", "summarise"):
        assert set(states(result, task_id)) <= {"upstream_failed"}, result
    assert states(result, "verify") == ["failed"]
    assert "plan task 'plan' is failed: no job was planned, so there is nothing to verify" in output
    assert "JobNotFound" not in output and "ConfigurationError" not in output
    assert result["manifest"] is None and result["asset_events"] == []
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("manifest.json"))


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"], ids=["empty", "blank-lines"])
def test_an_input_without_records_still_publishes_its_manifest(example, tmp_path, content):
    """The plan returns no shard, so Airflow skips the mapped shard task; the sensor after it runs
    anyway (its trigger rule is ``all_done``) and publishes the job's empty manifest, and the
    downstream task reads it. Before, the skip reached the sensor: no manifest, the job left admitted."""
    source = tmp_path / "tonight.jsonl"
    source.write_bytes(content)
    conf = {"output_uri": str(tmp_path / "out"), "deadline": "+2h", "input_uri": str(source)}
    code, result, output = run_dag(example, conf)

    assert code == 0 and result["state"] == "success", output[-5000:]
    assert states(result, "plan") == ["success"] and set(states(result, "shard")) == {"skipped"}
    assert states(result, "verify") == ["success"] and states(result, "summarise") == ["success"]
    assert result["job_state"] == "completed" and result["manifest"]
    manifest = json.loads(file_path(result["manifest"]).read_text())
    assert sum(manifest["outcomes"].values()) == 0 and manifest["shards"] == []
    (event,) = result["asset_events"]
    assert event["extra"]["records"] == 0


#: the local example with two shard tasks failing for good after their 5 tries (the DAG's
#: ``retries=4``): shard 1's worker is preempted at its first four tries, so the store, which saw
#: only preemptions, still has it retryable, and its last try fails before any of the operator's
#: code runs (in ``pre_execute``, as a task lost before it started), so only the sensor can fail it
#: in the store; shard 0's worker commits the whole shard, then every try of its task fails after
#: the fact (as when the commit landed and the pod was lost)
TWO_SHARD_TASKS_LOST = [
    ("        preempt_tries=PREEMPT_TRIES,\n", ""),
    (
        "    shards = LocalShardOperator.partial(\n",
        "    def lose_the_task(context, result):\n"
        "        raise RuntimeError('the shard task was lost after its worker finished')\n\n"
        "    def lose_the_last_try(context):\n"
        "        if context['ti'].try_number == 5:\n"
        "            raise RuntimeError('the last try was lost before it started')\n\n"
        "    def lose_shards_0_and_1(spec):\n"
        "        if spec['shard_index'] == 0:\n"
        "            return {**spec, 'preempt_tries': [], 'post_execute': lose_the_task}\n"
        "        if spec['shard_index'] == 1:\n"
        "            return {**spec, 'preempt_tries': [1, 2, 3, 4], 'pre_execute': lose_the_last_try}\n"
        "        return {**spec, 'preempt_tries': []}\n\n"
        "    shards = LocalShardOperator.partial(\n",
    ),
    (
        "    ).expand_kwargs(plan.output)\n",
        "    ).expand_kwargs(plan.output.map(lose_shards_0_and_1))\n",
    ),
]

#: run a DAG file (argv[2]) like scripts/run_example_dag.py (argv[1]) runs the example, conf argv[3]
RUN_DAG_FILE = """
import json, runpy, sys
script = runpy.run_path(sys.argv[1], run_name="run_example_dag")
script["migrate_metadata_db"]()
namespace = runpy.run_path(sys.argv[2])
with script["deadline_alerts_resolvable_in_dag_test"]():
    run = namespace["dag"].test(run_conf=json.loads(sys.argv[3]))
summary, _ = script["summarise"](run, str(namespace["STORE_URL"]), samples=0, seconds=0.0)
print("RESULT " + json.dumps(summary))
"""


#: the example's knobs the derived examples run without (their edits inject their own faults)
UNSET = ("ADB_STORE_URL", "ADB_EXAMPLE_INPUT", "ADB_EXAMPLE_DEADLINE", "ADB_EXAMPLE_PREEMPT_TRIES")


class Derived:
    """The Airflow home the tests of derived examples share, and the interpreter running them."""

    def __init__(self, home: Path) -> None:
        self.dags = home / "dags"
        self.dags.mkdir()
        self.store_url = f"sqlite:///{home / 'example' / 'store.db'}"
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags),
            "ADB_EXAMPLE_DIR": str(home / "example"),
            "ADB_ENGINE": "echo",
        }
        for name in UNSET:
            env.pop(name, None)
        self.warm = WarmAirflow(env)

    def write(self, dag_id: str, edits: list[tuple[str, str]]) -> Path:
        """Write the local example changed by ``edits`` into the DAG folder as DAG ``dag_id``, in
        a file of its own (a test that fixes its DAG rewrites it), its retries due at once."""
        dag_file = self.dags / f"{dag_id}.py"
        dag_file.write_text(derived_source(EXAMPLE, [*edits, *derived_identity(dag_id)]))
        return dag_file

    def run(self, code: str, *args: str) -> tuple[dict[str, Any], str]:
        """Run ``code`` (a script printing a ``RESULT`` line) on this home: its ``RESULT`` and
        everything it printed."""
        _, output = self.warm.run(code, *args, timeout_s=300)
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        assert lines, output[-5000:]
        return json.loads(lines[-1].removeprefix("RESULT ")), output


def derived_identity(dag_id: str) -> list[tuple[str, str]]:
    """The edits every derived example gets: its own ``dag_id``, and no wait before a retry (the
    DAG's 1 s ``retry_delay`` costs ``dag.test()`` a 1 s sleep per retry; what a retry does does not
    depend on it)."""
    return [
        ('    dag_id="example_deadline_batch_local",\n', f"    dag_id={dag_id!r},\n"),
        ('"retry_delay": dt.timedelta(seconds=1)', '"retry_delay": dt.timedelta(0)'),
    ]


@pytest.fixture(scope="module")
def derived(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Derived]:
    runs = Derived(airflow_home(tmp_path_factory.mktemp("derived_home"), tmp_path_factory))
    yield runs
    runs.warm.close()


def run_derived_example(
    derived: Derived, tmp_path: Path, edits: list[tuple[str, str]]
) -> tuple[dict[str, Any], str, Path]:
    """Run the local example changed by ``edits`` with ``dag.test()`` (echo engine, the derived
    examples' store) as a DAG of its own: its ``RESULT`` line, everything it printed, its file."""
    dag_file = derived.write(f"derived_{tmp_path.name}", edits)
    conf = {"output_uri": str(tmp_path / "out"), "deadline": "+2h", "input_uri": str(SAMPLE)}
    result, output = derived.run(RUN_DAG_FILE, str(SCRIPT), str(dag_file), json.dumps(conf))
    return result, output, dag_file


def assert_partial_manifest(manifest_uri: str, lost: Any, shards: dict[int, Any]) -> dict[int, Any]:
    """The sample's partial manifest: one outcome per non-blank line (checksums checked), the
    ``lost`` shard's records all ``errored`` / ``shard_failed`` with no output, ``shards``' records
    succeeded; the outcomes by line."""
    manifest = read_manifest(manifest_uri)
    outcomes = read_outcomes(manifest)  # checksums, counts, no line twice
    numbered = list(enumerate(SAMPLE.read_text().splitlines(), start=1))
    assert sorted(outcomes) == [number for number, line in numbered if line.strip()]
    failed = {line for line, o in outcomes.items() if o["error"] and o["error"]["code"] == "shard_failed"}
    assert len(failed) == lost.records > 0
    assert all(lost.first_line <= line < lost.first_line + lost.line_count for line in failed)
    assert all(outcomes[line]["status"] == "errored" and outcomes[line]["output"] is None for line in failed)
    assert manifest["outcomes"]["succeeded"] == sum(s.records for s in shards.values()) > 0
    return outcomes


def test_a_shard_task_failing_for_good_still_publishes_the_partial_manifest(derived, tmp_path):
    """After the shards, a shard task whose retries are spent no longer leaves the sensor
    ``upstream_failed`` with the job unfinished: the sensor fails the shard in the store, publishes
    the ``partial`` manifest (the other shards' results, ``shard_failed`` for the lost one's
    records) and fails naming it. Before, no manifest was ever published and the job stayed running.
    A shard whose commit landed before its task was lost keeps its results: the store is the truth."""
    result, output, _ = run_derived_example(derived, tmp_path, TWO_SHARD_TASKS_LOST)

    assert result["state"] == "failed" and states(result, "plan") == ["success"], output[-5000:]
    shard_tis = {index: (state, tries) for index, state, tries in result["tasks"]["shard"]}
    assert shard_tis.pop(0) == shard_tis.pop(1) == ("failed", 5), result["tasks"]
    assert {state for state, _ in shard_tis.values()} <= {"success"}
    assert states(result, "verify") == ["failed"] and states(result, "summarise") == ["upstream_failed"]
    assert result["job_state"] == "partial" and result["manifest"], result
    manifest_uri = result["manifest"]
    assert f"ended partial; its manifest {manifest_uri}" in output  # the sensor's failure names it
    assert "shard task shard[0] failed for good; shard 0 is succeeded in the store (the store's" in output
    assert "shard task shard[1] failed for good; shard 1 is terminal_failure in the store" in output
    assert result["asset_events"] == []  # downstream never saw the partial output

    store = ManifestStore(derived.store_url)
    try:
        shards = {s.shard_index: s for s in store.list_shards(result["job_id"])}
        lost = shards.pop(1)
        assert shards[0].state is ShardState.SUCCEEDED and shards[0].last_error is None
        assert lost.state is ShardState.TERMINAL_FAILURE
        # the sensor's own verdict (the operator's says "on try N": none of its code ran on the last)
        assert lost.last_error == "its Airflow task shard[1] failed for good (no retry left)"
        assert {s.state for s in shards.values()} == {ShardState.SUCCEEDED}
        assert not [c for c in store.list_commits(result["job_id"]) if c.shard_index == 1]
    finally:
        store.close()

    outcomes = assert_partial_manifest(manifest_uri, lost, shards)
    first = shards[0]
    assert all(
        outcomes[line]["status"] == "succeeded"
        for line in range(first.first_line, first.first_line + first.line_count)
        if line in outcomes and line not in first.excluded_lines
    )


#: the local example with the sensor BESIDE the shards (``plan >> [shards, done]``, the production
#: form), polling from a worker slot (``dag.test()`` runs a deferred trigger in line, which would
#: hold the shards back) for at most 2 minutes; shard 1's task has ``retries=1`` and its worker is
#: preempted at both tries, so the store, which saw only preemptions, still has the shard retryable
SENSOR_BESIDE_ONE_SHARD_TASK_LOST = [
    ("        preempt_tries=PREEMPT_TRIES,\n", "        retries=1,\n"),
    (
        "    shards = LocalShardOperator.partial(\n",
        "    def lose_shard_1(spec):\n"
        "        return {**spec, 'preempt_tries': [1, 2] if spec['shard_index'] == 1 else []}\n\n"
        "    shards = LocalShardOperator.partial(\n",
    ),
    ("    ).expand_kwargs(plan.output)\n", "    ).expand_kwargs(plan.output.map(lose_shard_1))\n"),
    ("        deferrable=True,\n", "        deferrable=False,\n        mode='reschedule',\n"),
    ("        timeout=3 * 3600,\n", "        timeout=120,\n"),
    ("    plan >> shards >> done\n", "    plan >> [shards, done]\n"),
]


def test_a_shard_task_failing_for_good_beside_the_sensor_ends_the_job_partial(derived, tmp_path):
    """Beside the shards, the sensor never learns of a shard task that failed: the task's last try
    fails its shard in the store itself, so the sensor's next poll finds every shard terminal,
    publishes the ``partial`` manifest and fails naming it. Before, the shard stayed retryable in
    the store and the sensor waited until its timeout, with nothing published."""
    result, output, _ = run_derived_example(derived, tmp_path, SENSOR_BESIDE_ONE_SHARD_TASK_LOST)

    assert result["state"] == "failed" and states(result, "plan") == ["success"], output[-5000:]
    shard_tis = {index: (state, tries) for index, state, tries in result["tasks"]["shard"]}
    assert shard_tis.pop(1) == ("failed", 2), result["tasks"]
    assert shard_tis and {state for state, _ in shard_tis.values()} == {"success"}
    assert states(result, "verify") == ["failed"] and states(result, "summarise") == ["upstream_failed"]
    assert "shard 1 of job" in output and "its task failed for good; the shard is terminal_failure" in output
    assert result["job_state"] == "partial" and result["manifest"], result
    manifest_uri = result["manifest"]
    assert f"ended partial; its manifest {manifest_uri}" in output  # the sensor's failure names it
    assert "Sensor has timed out" not in output and result["asset_events"] == []

    store = ManifestStore(derived.store_url)
    try:
        shards = {s.shard_index: s for s in store.list_shards(result["job_id"])}
        lost = shards.pop(1)
        assert lost.state is ShardState.TERMINAL_FAILURE
        assert "its Airflow task shard[1] failed for good on try 2" in str(lost.last_error)
        assert {s.state for s in shards.values()} == {ShardState.SUCCEEDED}
    finally:
        store.close()

    assert_partial_manifest(manifest_uri, lost, shards)


#: the local example with shard 1's task given ``shard_1_store`` (another store than the plan's is
#: a configuration error: its try fails at once, without retry); no injected preemption, unless
#: ``lose_shard_0``: shard 0's worker is then preempted at each of its task's 5 tries (the DAG's
#: ``retries=4``), so the task fails for good with its shard still retryable in the store
def misconfigured_shard_1(shard_1_store: str, *, lose_shard_0: bool) -> list[tuple[str, str]]:
    preempt = "[1, 2, 3, 4, 5] if spec['shard_index'] == 0 else []" if lose_shard_0 else "[]"
    return [
        ("        preempt_tries=PREEMPT_TRIES,\n", ""),
        ("        store_url=STORE_URL,\n        preempt_after_s", "        preempt_after_s"),
        (
            "    shards = LocalShardOperator.partial(\n",
            "    def configure(spec):\n"
            f"        store_url = {shard_1_store} if spec['shard_index'] == 1 else STORE_URL\n"
            f"        return {{**spec, 'store_url': store_url, 'preempt_tries': {preempt}}}\n\n"
            "    shards = LocalShardOperator.partial(\n",
        ),
        ("    ).expand_kwargs(plan.output)\n", "    ).expand_kwargs(plan.output.map(configure))\n"),
    ]


#: a person clears ``shard[argv[3]]``, the sensor and its downstream task of the DAG run that
#: failed (Airflow's own clear, which ``airflow tasks clear`` and the UI run), then a stand-in for
#: the scheduler (``dag.test()``'s loop, without its clearing of the whole run) runs the DAG run
#: from the DAG file argv[2] (the fixed one) to its end; summarised like RUN_DAG_FILE, with the
#: XComs the shard tasks hold at the end
CLEAR_AND_RUN = """
import json, runpy, sys, time
from airflow.models.dagrun import DagRun
from airflow.models.xcom import XComModel
from airflow.sdk.definitions.dag import _run_task
from airflow.serialization.serialized_objects import DagSerialization
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState, TaskInstanceState
script = runpy.run_path(sys.argv[1], run_name="run_example_dag")
namespace = runpy.run_path(sys.argv[2])
dag = namespace["dag"]
scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
with create_session() as session:
    (run_id,) = session.query(DagRun.run_id).filter(DagRun.dag_id == dag.dag_id).one()
scheduler_dag.clear(task_ids=[("shard", int(sys.argv[3])), ("verify", -1), ("summarise", -1)], run_id=run_id)
give_up = time.monotonic() + 240
with script["deadline_alerts_resolvable_in_dag_test"](), create_session() as session:
    run = session.query(DagRun).filter(DagRun.run_id == run_id).one()
    run.dag = scheduler_dag
    run.state = DagRunState.RUNNING
    session.commit()
    while run.state == DagRunState.RUNNING:
        assert time.monotonic() < give_up, "the cleared DAG run did not end"
        session.expire_all()
        schedulable, _ = run.update_state(session=session)
        for ti in schedulable:
            if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                ti.try_number += 1
            ti.state = TaskInstanceState.SCHEDULED
        session.commit()
        for ti in run.get_task_instances(session=session):
            if ti.state == TaskInstanceState.SCHEDULED:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
    summary, _ = script["summarise"](run, str(namespace["STORE_URL"]), samples=0, seconds=0.0)
    xcoms = session.query(XComModel.map_index, XComModel.key).filter(
        XComModel.run_id == run_id, XComModel.task_id == "shard"
    )
    summary["shard_xcoms"] = sorted([index, key] for index, key in xcoms)
print("RESULT " + json.dumps(summary))
"""


@pytest.mark.parametrize("lose_shard_0", [False, True], ids=["then-complete", "then-partial"])
def test_a_shard_task_configuration_error_publishes_nothing_until_fixed_and_cleared(
    derived, tmp_path, lose_shard_0
):
    """After the shards, a shard task that failed on a configuration error (here another store
    than the plan's) will run once fixed and cleared: the sensor leaves its shard to run, publishes
    nothing and fails in one line naming the task, the error and the fix; the job is not cancelled.
    A shard task whose retries are spent is still settled (its shard fails in the store). After the
    fix and the clear the shard runs and the job's manifest is published, every record once:
    ``complete``, or ``partial`` with the spent shard's records ``shard_failed``. Before, the sensor
    failed the misconfigured shard too and published the job ``partial`` at once: that shard's
    records ``shard_failed`` for good."""
    another = "f\"sqlite:///{WORK_DIR / 'another.db'}\""
    result, output, dag_file = run_derived_example(
        derived, tmp_path, misconfigured_shard_1(another, lose_shard_0=lose_shard_0)
    )

    assert result["state"] == "failed" and states(result, "plan") == ["success"], output[-5000:]
    shard_tis = {index: (state, tries) for index, state, tries in result["tasks"]["shard"]}
    assert shard_tis.pop(1) == ("failed", 1), result["tasks"]  # no retry: a configuration error
    if lose_shard_0:
        assert shard_tis.pop(0) == ("failed", 5), result["tasks"]
    assert {state for state, _ in shard_tis.values()} <= {"success"}
    assert states(result, "verify") == ["failed"] and states(result, "summarise") == ["upstream_failed"]
    job_id = result["job_id"]
    (line,) = [
        line for line in output.splitlines() if "shard task shard[1] failed on a configuration" in line
    ]
    assert "is not in the manifest store this task reads" in line  # the shard task's own error
    assert line.endswith("fix it, then clear shard[1] and verify: the job stays open, nothing was published")
    assert "shard[1] failed for good" not in output
    assert (
        "shard task shard[0] failed for good; shard 0 is terminal_failure in the store" in output
    ) is lose_shard_0
    assert result["manifest"] is None and result["asset_events"] == []
    assert result["job_state"] in ("admitted", "running"), result  # neither cancelled nor finalized
    assert not any((tmp_path / "out").rglob("manifest.json"))

    store = ManifestStore(derived.store_url)
    try:
        shards = {s.shard_index: s for s in store.list_shards(job_id)}
        assert shards[1].state is ShardState.PENDING and shards[1].last_error is None
        if lose_shard_0:
            assert shards.pop(0).state is ShardState.TERMINAL_FAILURE
        assert {s.state for i, s in shards.items() if i != 1} <= {ShardState.SUCCEEDED}
        assert not [c for c in store.list_commits(job_id) if c.shard_index == 1]
    finally:
        store.close()

    # the fix: shard 1's task reads the plan's store; then shard[1] and verify are cleared
    derived.write(dag_file.stem, misconfigured_shard_1("STORE_URL", lose_shard_0=lose_shard_0))
    result, output = derived.run(CLEAR_AND_RUN, str(SCRIPT), str(dag_file), "1")

    assert result["job_id"] == job_id, output[-5000:]
    shard_tis = {index: (state, tries) for index, state, tries in result["tasks"]["shard"]}
    assert shard_tis.pop(1) == ("success", 2), result["tasks"]
    assert [1, "configuration_error"] not in result["shard_xcoms"]  # Airflow cleared it at try 2
    manifest_uri = result["manifest"]
    if lose_shard_0:
        assert result["state"] == "failed" and result["job_state"] == "partial", output[-5000:]
        assert states(result, "verify") == ["failed"] and result["asset_events"] == []
        assert f"ended partial; its manifest {manifest_uri}" in output
        store = ManifestStore(derived.store_url)
        try:
            shards = {s.shard_index: s for s in store.list_shards(job_id)}
        finally:
            store.close()
        lost = shards.pop(0)
        assert {s.state for s in shards.values()} == {ShardState.SUCCEEDED}
        assert_partial_manifest(manifest_uri, lost, shards)
        return
    assert result["state"] == "success" and result["job_state"] == "completed", output[-5000:]
    assert {state for state, _ in shard_tis.values()} == {"success"}
    assert states(result, "verify") == ["success"] and states(result, "summarise") == ["success"]
    outcomes = read_outcomes(read_manifest(manifest_uri))  # checksums, counts, no line twice
    numbered = list(enumerate(SAMPLE.read_text().splitlines(), start=1))
    assert sorted(outcomes) == [number for number, line in numbered if line.strip()]
    assert not [o for o in outcomes.values() if o["error"] and o["error"]["code"] == "shard_failed"]
    assert manifest_uri and result["outcomes"]["succeeded"] > 0
    (event,) = result["asset_events"]
    assert event["extra"]["manifest_uri"] == manifest_uri


#: the local example, shard 1's instance mapped with a ``preempt_tries`` the constructor refuses
#: (s27): a mapped shard instance that Airflow cannot build is no spent shard. A value only the
#: mapped XCom gives (here ``preempt_tries``, from ``expand_kwargs(plan.output.map(f))``) that the
#: shard operator's constructor refuses fails the try in the worker while Airflow unmaps the
#: instance, before any operator code: the parse-time probe cannot see it. Airflow retries it as an
#: ordinary failure; at the last try the task's failure callback (``note_unbuilt_instance``, added
#: by ``ShardPartial``) pushes ``configuration_error``, so the sensor after the shards leaves the
#: shard to run instead of failing it in the store and publishing the job ``partial``
SHARD_1_UNBUILT = [
    ("        preempt_tries=PREEMPT_TRIES,\n", ""),
    (
        "    shards = LocalShardOperator.partial(\n",
        "    def configure(spec):\n"
        "        return {**spec, 'preempt_tries': ['x'] if spec['shard_index'] == 1 else []}\n\n"
        "    shards = LocalShardOperator.partial(\n",
    ),
    ("    ).expand_kwargs(plan.output)\n", "    ).expand_kwargs(plan.output.map(configure))\n"),
]


def test_an_instance_its_constructor_refuses_leaves_its_shard_to_run(derived, tmp_path):
    """Before, the sensor failed shard 1 in the store (``its Airflow task shard[1] failed for
    good``) and published the job ``partial``, shard 1's records ``shard_failed`` for a typo."""
    result, output, _ = run_derived_example(derived, tmp_path, SHARD_1_UNBUILT)

    assert result["state"] == "failed" and states(result, "plan") == ["success"], output[-5000:]
    shard_tis = {index: (state, tries) for index, state, tries in result["tasks"]["shard"]}
    assert shard_tis.pop(1) == ("failed", 5), result["tasks"]  # Airflow's retries: no operator code ran
    assert shard_tis and {state for state, _ in shard_tis.values()} == {"success"}
    assert states(result, "verify") == ["failed"] and states(result, "summarise") == ["upstream_failed"]
    (line,) = [
        line for line in output.splitlines() if "shard task shard[1] failed on a configuration" in line
    ]
    assert (
        "(shard[1]: LocalShardOperator refuses the arguments of this mapped instance (invalid "
        "literal for int() with base 10: 'x'); fix them in the DAG file or in the values "
        "expand_kwargs maps)"
    ) in line
    assert line.endswith("fix it, then clear shard[1] and verify: the job stays open, nothing was published")
    assert "shard[1] failed for good" not in output
    assert result["manifest"] is None and result["asset_events"] == []
    assert result["job_state"] in ("admitted", "running"), result

    store = ManifestStore(derived.store_url)
    try:
        shards = {s.shard_index: s for s in store.list_shards(result["job_id"])}
        assert shards.pop(1).state is ShardState.PENDING
        assert {s.state for s in shards.values()} == {ShardState.SUCCEEDED}
    finally:
        store.close()
