"""The second night uses what the first measured: a real local run, then the next job's plan.

The first job runs with real worker processes on the echo engine, slowed to ~0.05 s a record
(``ADB_ECHO_DELAY_S``), on a pool declared at 20,000 tokens/s; its committed microbatches measure
the pool an order of magnitude slower. The next job of the same model is priced at that rate; a
job of another model is not. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from pathlib import Path

import pytest

from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.local.runner import RunOptions, run_job
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore

pytestmark = pytest.mark.integration
SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"
DECLARED = 20_000.0
POOL = PoolSpec(
    name="cpu",
    kind=PoolKind.ON_DEMAND,
    gpus=1,
    prefill_tokens_per_s=DECLARED,
    decode_tokens_per_s=DECLARED,
    startup_seconds=1.0,
)


def test_a_job_is_planned_at_the_rate_the_previous_run_of_its_model_measured(
    store: ManifestStore, tmp_path: Path
) -> None:
    first = PlanRequest(
        input_uri=str(SAMPLE),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        model="echo-small",
        pools=(POOL,),
        workers=1,
        microbatch_size=4,
        max_invalid_fraction=0.5,
        idempotency_key="night-1",
    )
    summary = run_job(store, first, RunOptions(workers=1, worker_env={"ADB_ECHO_DELAY_S": "0.05"}))
    assert summary.state == "completed"
    declared = store.get_job(summary.job_id).admission
    assert declared["rates"][0]["source"] == "declared"

    second = plan_job(store, replace(first, idempotency_key="night-2"))
    admission = store.get_job(second.job_id).admission
    (rate,) = admission["rates"]
    measured = store.measured_rates([POOL.name], engine="echo", model="echo-small")[POOL.name]
    assert rate["source"] == "measured" and rate["commits"] == measured.commits >= 8 and rate["jobs"] == 1
    assert measured.tokens_per_s is not None and measured.tokens_per_s < DECLARED / 5
    assert rate["tokens_per_s"] == pytest.approx(measured.tokens_per_s)
    # the work is priced at the measured rate: its run time grows by the measured slowdown
    slowdown = rate["declared_tokens_per_s"] / rate["tokens_per_s"]
    work = [a["work"]["gpu_seconds"] for a in (declared, admission)]
    assert work[1] == pytest.approx(work[0] * slowdown)
    assert admission["chosen"]["run_seconds"] > declared["chosen"]["run_seconds"]
    assert admission["slack_seconds"] < declared["slack_seconds"]

    other = plan_job(store, replace(first, model="echo-large", idempotency_key="other"))
    (kept,) = store.get_job(other.job_id).admission["rates"]
    assert kept["source"] == "declared" and kept["commits"] == 0
