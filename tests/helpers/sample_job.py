"""A small job of the local example's sample input, planned (echo engine, local pools): what the
Jobs view tests show, each with the DAG run its idempotency key names."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore

SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"


def plan_sample_job(
    store: ManifestStore, key: str, output: Path, *, deadline_in: dt.timedelta = dt.timedelta(hours=1)
) -> str:
    """Plan the sample input under ``key`` (``dag/run/task``) with its deadline ``deadline_in`` from
    now; its job ID."""
    return plan_job(
        store,
        PlanRequest(
            input_uri=str(SAMPLE),
            deadline=dt.datetime.now(dt.timezone.utc) + deadline_in,
            output_uri=str(output),
            engine="echo",
            pools=default_local_pools("echo"),
            workers=2,
            microbatch_size=4,
            idempotency_key=key,
        ),
    ).job_id
