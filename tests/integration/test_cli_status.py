"""`deadline-batch status` tells on-call the slack of a job that is still running."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.cli import main
from airflow_deadline_batch.core.calibration import prior_tokens_per_s
from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.commits import commit

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
    largest_shard = max(s.est_work_s for s in store.list_shards(plan.job_id))
    store.close()
    assert main(["status", plan.job_id, "--store", url, "--json"]) == 0
    status = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    predicted = dt.datetime.fromisoformat(status["predicted_finish"])
    # nothing committed yet: all the planned work lies ahead at the pools' nominal rates, shared by
    # the job's 2 workers, after a changeover (20 s startup of the local pools), plus half a shard
    # of imbalance between the two workers: the on-demand need placement decides with
    work_left = dt.timedelta(seconds=20 + progress.remaining_work_s / 2 + largest_shard / 2)
    assert progress.remaining_work_s > 0
    assert status["remaining_work_s"] == pytest.approx(progress.remaining_work_s, abs=0.001)
    assert abs((predicted - dt.datetime.now(dt.timezone.utc)) - work_left) < dt.timedelta(seconds=30)
    assert status["slack_s"] == pytest.approx((deadline - predicted).total_seconds(), abs=0.01)
    assert [(r["pool"], r["measured"]) for r in status["rates"]] == [
        ("local-spot", False),
        ("local-on-demand", False),
    ]
    assert status["work_scale"] == 1.0
    assert main(["status", plan.job_id, "--store", url]) == 0
    text = capsys.readouterr().out
    assert "predicted finish" in text and "slack +" in text and "not measured yet" in text


def test_status_shows_the_rates_measured_from_committed_microbatches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    pools = default_local_pools("transformers")
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(SAMPLE),
            deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
            output_uri=str(tmp_path / "out"),
            engine="transformers",
            pools=pools,
            workers=2,
            microbatch_size=4,
        ),
    )
    before = store.progress(plan.job_id).remaining_work_s
    lease = store.claim_shard(plan.job_id, 0, ttl_s=60, worker="test", pool="local-spot")
    # microbatches at a tenth of the Spot pool's nominal rate for their mix of tokens
    nominal = prior_tokens_per_s(pools[0], 0.5)
    for seq in range(3):
        lease = commit(
            store,
            lease,
            seq,
            records=4,
            prompt_tokens=4000,
            completion_tokens=4000,
            elapsed_s=10 * 8000 / nominal,
            pool="local-spot",
        )
    store.close()
    assert main(["status", plan.job_id, "--store", url, "--json"]) == 0
    status = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    spot, on_demand = status["rates"]
    assert spot["pool"] == "local-spot" and spot["measured"] and spot["microbatches"] == 3
    assert spot["tokens_per_s"] < spot["nominal_tokens_per_s"]
    assert not on_demand["measured"]
    # the work left is priced at the measured rate: more of it than planned, though less is left
    assert status["work_scale"] > 1.5
    assert status["remaining_work_s"] > before
    assert main(["status", plan.job_id, "--store", url]) == 0
    assert "measured over 3 microbatch(es)" in capsys.readouterr().out


def test_status_says_why_a_job_stopped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url)
    plan = plan_job(
        store,
        PlanRequest(
            input_uri=str(SAMPLE),
            deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
            output_uri=str(tmp_path / "out"),
            engine="echo",
            pools=default_local_pools("echo"),
            workers=2,
        ),
    )
    cause = "configuration error (shard 0): the model file is missing"
    store.set_job_state(plan.job_id, "failed", error=cause)
    store.close()
    assert main(["status", plan.job_id, "--store", url, "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out.splitlines()[-1])["error"] == cause
    assert main(["status", plan.job_id, "--store", url]) == 0
    assert f"stopped because: {cause}" in capsys.readouterr().out
