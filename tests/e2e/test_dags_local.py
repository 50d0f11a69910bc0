"""The local example DAG end to end under Airflow's real ``dag.test()``, with injected preemptions.

Each run happens in a subprocess with its own ``AIRFLOW_HOME`` (Airflow reads its configuration at
import time), on a freshly migrated SQLite metadata database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "dags" / "example_deadline_batch_local.py"
SAMPLE = REPO / "dags" / "data" / "sample_reviews.jsonl"
RUNNER = """
import json, runpy, sys
dag = runpy.run_path(sys.argv[1])["dag"]
run = dag.test(run_conf=json.loads(sys.argv[2]))
states = {}
for ti in run.get_task_instances():
    states.setdefault(ti.task_id, []).append([ti.map_index, str(ti.state), ti.try_number])
print("RESULT " + json.dumps({"state": str(run.state), "tasks": states}))
"""


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("airflow_home")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "ADB_EXAMPLE_DIR": str(home / "example"),
    }
    env.pop("ADB_STORE_URL", None)
    subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), "db", "migrate"],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return env


def run_dag(env: dict[str, str], conf: dict) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(DAG_FILE), json.dumps(conf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), output


def states(result: dict, task_id: str) -> list[str]:
    return [state for _, state, _ in result["tasks"].get(task_id, [])]


def test_local_dag_publishes_one_outcome_per_line_despite_preemptions(airflow_env, tmp_path):
    from airflow_deadline_batch.store import ManifestStore

    conf = {"output_uri": str(tmp_path / "out"), "deadline": "+2h"}
    result, output = run_dag(airflow_env, conf)

    assert result["state"] == "success", output[-5000:]
    assert set(states(result, "shard")) == {"success"}
    assert states(result, "verify") == ["success"] and states(result, "summarise") == ["success"]
    assert "injecting a preemption" in output
    assert max(t for _, _, t in result["tasks"]["shard"]) >= 2  # at least one shard was retried

    store = ManifestStore(f"sqlite:///{Path(airflow_env['ADB_EXAMPLE_DIR']) / 'store.db'}")
    (job,) = [j for j in store.list_jobs() if j.manifest_uri]
    manifest = json.loads(Path(job.manifest_uri.removeprefix("file://")).read_text())
    lines = [line for line in SAMPLE.read_text().splitlines() if line.strip()]
    assert sum(manifest["outcomes"].values()) == len(lines)
    seen: list[int] = []
    for entry in manifest["shards"]:
        for row in Path(entry["uri"].removeprefix("file://")).read_text().splitlines():
            seen.append(json.loads(row)["line"])
    assert sorted(seen) == list(range(1, len(lines) + 1))


def test_infeasible_deadline_fails_at_plan_and_nothing_downstream_runs(airflow_env, tmp_path):
    result, output = run_dag(airflow_env, {"output_uri": str(tmp_path / "out"), "deadline": "+1s"})

    assert result["state"] == "failed"
    assert states(result, "plan") == ["failed"]
    assert "rejected at admission" in output
    for task_id in ("shard", "verify", "summarise"):
        assert set(states(result, task_id)) <= {"upstream_failed"}, result
