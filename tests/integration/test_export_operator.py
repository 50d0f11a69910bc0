"""``DeadlineBatchExportOperator`` on a real job: the operator's files equal the CLI's, and refusals
fail the task without retries."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_deadline_batch.operators.export import DeadlineBatchExportOperator
from tests.e2e.conftest import run_cli

pytestmark = pytest.mark.timeout(300)


def test_the_operator_exports_a_published_job_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    lines = [
        {"id": "n1", "prompt": "hello there"},
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "__adb_fail_record__"}]}},
    ]  # fmt: skip
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    run = run_cli(
        "run", str(tmp_path / "in.jsonl"), "--deadline", "+1h", "--engine", "echo", "--workers", "1",
        "--store", store_url, "--output", str(tmp_path / "out"), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert run.code == 0, run.describe()
    job_id = run.json()["job_id"]

    op = DeadlineBatchExportOperator(
        task_id="export", job_id=job_id, output_uri=str(tmp_path / "exp"), store_url=store_url
    )
    summary = op.execute({})
    assert summary["job_id"] == job_id
    assert {name: f["lines"] for name, f in summary["files"].items()} == {
        "output.jsonl": 1,
        "errors.jsonl": 1,
        "retry.jsonl": 1,
    }
    assert (tmp_path / "exp" / "retry.jsonl").read_bytes() == orjson.dumps(lines[1]) + b"\n"
    cli = run_cli("export", job_id, "--output", str(tmp_path / "cli"), "--store", store_url, cwd=tmp_path)
    assert cli.code == 0, cli.describe()
    for name in ("output.jsonl", "errors.jsonl", "retry.jsonl"):
        assert (tmp_path / "exp" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes()

    missing = DeadlineBatchExportOperator(
        task_id="export2", job_id="j-nosuchjob", output_uri=str(tmp_path / "x"), store_url=store_url
    )
    with pytest.raises(AirflowFailException):
        missing.execute({})
