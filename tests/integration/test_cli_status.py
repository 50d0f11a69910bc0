"""`deadline-batch status` tells on-call the slack of a job that is still running."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.cli import main
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore

SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"


def test_status_of_an_unfinished_job_predicts_its_finish_and_slack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(SAMPLE),
            deadline=deadline,
            output_uri=str(tmp_path / "out"),
            engine="transformers",
            pools=default_local_pools("transformers"),
            workers=2,
        ),
    )
    progress = store.progress(plan.job_id)
    store.close()
    assert main(["status", plan.job_id, "--store", url, "--json"]) == 0
    status = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    predicted = dt.datetime.fromisoformat(status["predicted_finish"])
    # nothing committed yet: all the planned work lies ahead, shared by the job's 2 workers at 80 %
    work_left = dt.timedelta(seconds=progress.remaining_work_s / (2 * 0.8))
    assert progress.remaining_work_s > 0
    assert abs((predicted - dt.datetime.now(dt.timezone.utc)) - work_left) < dt.timedelta(seconds=30)
    assert status["slack_s"] == pytest.approx((deadline - predicted).total_seconds(), abs=0.01)
    assert main(["status", plan.job_id, "--store", url]) == 0
    text = capsys.readouterr().out
    assert "predicted finish" in text and "slack +" in text
