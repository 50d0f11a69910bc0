"""``run``'s exit code and ``--json`` line when the store or the storage goes away mid-job
(docs/design.md §8): exit 4, one line naming the cause and how to resume, the job resumable."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_deadline_batch import cli
from airflow_deadline_batch.exceptions import StorageError, StoreError
from airflow_deadline_batch.local import runner
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _failing_run(error: Exception) -> Callable[..., Any]:
    """``run_job`` that plans the job for real, then loses its store or storage."""

    def run_job(store: Any, request: Any, options: Any, *, on_plan: Any = None, **_: Any) -> Any:
        plan = runner.plan_job(store, request)
        if on_plan:
            on_plan(plan)
        raise error

    return run_job


@pytest.mark.parametrize(
    "error",
    [
        StoreError("postgresql+psycopg://u:***@db/x: connection refused; check the --store URL"),
        StorageError("cannot write s3://bucket/out/x: endpoint unreachable; check the network"),
        ConnectionResetError("connection reset by peer"),
    ],
    ids=["store", "storage", "unexpected"],
)
def test_store_or_storage_gone_exits_4_with_the_json_line(
    error: Exception,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "run_job", _failing_run(error))
    path = mixed_input(20, seed=1, bad_fraction=0.0).write(tmp_path / "in.jsonl")
    store_url = f"sqlite:///{tmp_path / 's.db'}"
    code = cli.main([
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--store", store_url,
        "--output", str(tmp_path / "out"), "--json",
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 4, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "rerun the same command to resume" in lines[0], lines[0]
    payload = orjson.loads(out.strip().splitlines()[-1])
    assert payload["job_id"] and payload["state"] == "admitted" and payload["resumable"] is True, payload
    assert payload["error"], payload
