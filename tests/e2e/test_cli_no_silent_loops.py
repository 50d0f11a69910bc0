"""No silent loops: workers that die before claiming stop ``run`` with the cause (docs/design.md §6.6).

A worker that cannot even start (an interpreter it cannot import into, credentials the store
refuses after admission, a disk that fills before the claim) used to be relaunched silently until
the deadline. Here every worker process dies at start-up, before it touches the store: a
``sitecustomize`` on the workers' ``PYTHONPATH`` exits 1 in any process that carries the
workers' store variable (the ``run`` process itself does not, so planning and admission run).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import run_cli
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

_BREAK = """\
import os, signal
how = os.environ.get("ADB_TEST_BREAK_WORKERS")
if os.environ.get("ADB_STORE_URL") and how:
    os.write(2, b"sitecustomize: this worker cannot start\\n")
    if how == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(int(how))
"""


@pytest.mark.parametrize(
    ("how", "said"),
    [
        # exit 1 is the worker's "no retry can help": the run stops at the first one
        ("1", "configuration error: worker exited 1"),
        # anything else that never claims: the run stops after a few launches in a row
        ("3", "worker launches in a row died before claiming"),
        ("crash", "worker launches in a row died before claiming"),
    ],
)
def test_workers_that_die_before_claiming_stop_run_with_the_cause(
    tmp_path: Path, how: str, said: str
) -> None:
    breaker = tmp_path / "breaker"
    breaker.mkdir()
    (breaker / "sitecustomize.py").write_text(_BREAK)
    path = mixed_input(60, seed=5).write(tmp_path / "input.jsonl")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    pythonpath = os.pathsep.join(p for p in (str(breaker), os.environ.get("PYTHONPATH", "")) if p)
    result = run_cli(
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2",
        "--store", store_url, "--output", str(tmp_path / "out"), "--max-invalid-fraction", "0.5", "--json",
        cwd=tmp_path,
        env={"PYTHONPATH": pythonpath, "ADB_TEST_BREAK_WORKERS": how},
    )  # fmt: skip
    assert result.code == 2, result.describe()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("deadline-batch: error:")]
    assert len(errors) == 1 and said in errors[0] and lines[-1] == errors[0], result.describe()
    assert "Traceback" not in result.stderr
    summary = result.json()
    assert summary["state"] != "completed"
    store = ManifestStore.open(store_url, migrate=False)
    try:
        (job,) = store.list_jobs()
        assert store.progress(job.job_id).succeeded == 0
        assert store.list_attempts(job.job_id) == []  # nothing ever claimed a shard
    finally:
        store.close()
