"""The airflow DAG ``dags/example_deadline_batch_local.py`` on a real deployment, with one change.

The sensor's ``retries=0`` -> ``retries=10``: the workaround for an Airflow 3.3 scheduler race
described in ``example_deadline_batch_kubernetes_loopback.py`` (a deferred task that resumes before
the scheduler has processed the executor's event of the try that deferred is failed while running).
Everything else (echo engine, injected preemptions, output folder) comes from the environment and
the run conf, as docs/airflow.md describes.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.derived_dag import run_derived

EXAMPLE = Path(__file__).resolve().parents[3] / "dags" / "example_deadline_batch_local.py"
REPLACEMENTS = (("        retries=0,\n    )\n\n    @task", "        retries=10,\n    )\n\n    @task"),)

run_derived(EXAMPLE, REPLACEMENTS, dag_file=__file__, into=globals())
