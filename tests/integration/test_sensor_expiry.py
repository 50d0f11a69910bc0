"""Expiry through Airflow: once the job's deadline has passed, ``CompletenessSensor`` with
``expire_unfinished=True`` publishes a verified ``partial`` manifest in which every record that did
not finish is ``expired`` (docs/airflow.md, *CompletenessSensor*)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import sqlalchemy as sa

from airflow_deadline_batch.core.states import JobState
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import LocalShardOperator
from airflow_deadline_batch.sensors.completeness import CompletenessSensor
from airflow_deadline_batch.service.finalize import verify_job
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.store.schema import jobs
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import read_manifest, read_outcomes
from tests.integration.test_airflow_connections import Run

pytestmark = [pytest.mark.integration]


def test_the_sensor_expires_what_did_not_finish_once_the_deadline_passed(tmp_path: Path) -> None:
    mixed = mixed_input(60, seed=4, bad_fraction=0.05, blank_fraction=0.0)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    run = Run()
    specs = DeadlineBatchOperator(
        task_id="plan",
        input_uri=str(mixed.write(tmp_path / "in.jsonl")),
        output_uri=str(tmp_path / "out"),
        deadline="+2h",
        store_url=store_url,
        engine="echo",
        workers=2,
        microbatch_size=4,
        max_invalid_fraction=0.5,
    ).execute(run.context("plan"))
    assert len(specs) >= 2, specs
    LocalShardOperator(task_id="shard", store_url=store_url, **specs[0]).execute(run.context("shard"))
    job_id = specs[0]["job_id"]

    # the other shards never ran and the deadline went by (moved a minute into the past)
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:
        past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=1)
        conn.execute(sa.update(jobs).where(jobs.c.job_id == job_id).values(deadline=past))
    engine.dispose()

    sensor = CompletenessSensor(
        task_id="verify", plan_task_id="plan", store_url=store_url, expire_unfinished=True
    )
    manifest_uri = sensor.execute(run.context("verify"))

    store = ManifestStore.open(store_url)
    try:
        job = store.get_job(job_id)
        assert job.state is JobState.PARTIAL and job.manifest_uri == manifest_uri
        shard0 = store.get_shard(job_id, 0)
        report = verify_job(store, job_id)
        assert report.complete, report.summary()
    finally:
        store.close()
    outcomes = read_outcomes(read_manifest(manifest_uri))
    assert sorted(outcomes) == sorted(e.line for e in mixed.expected)  # one per non-blank line
    statuses = {line: rec["status"] for line, rec in outcomes.items()}
    expired = sorted(line for line, status in statuses.items() if status == "expired")
    shard0_end = shard0.first_line + shard0.line_count
    assert expired and all(line >= shard0_end for line in expired), (shard0, expired)
    for line, status in statuses.items():  # everything else kept the outcome it earned
        if status != "expired":
            assert status == mixed.by_line[line].status
