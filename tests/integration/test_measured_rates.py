"""A new job is planned at the rates earlier jobs of its model measured, on SQLite and PostgreSQL.

An earlier job's committed microbatches (written through the store's commit API) show the pool
five times slower than declared; the next job of the same model is rated at the measured rate
(its run time grows, a deadline feasible at the declared rate is refused), a job of another model
keeps the declared rate, and a thin history is blended with the declaration. ``deadline-batch
capacity list`` shows the measured rates and the pool's dispatch state.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.cli import main
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.exceptions import AdmissionRejected
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.service.planning import (
    MIN_RATE_COMMITS,
    PlanRequest,
    plan_job,
    rate_pools,
)
from airflow_deadline_batch.store import ManifestStore, NewJob, NewShard
from tests.helpers.commits import commit_rest

pytestmark = pytest.mark.integration
UTC = dt.timezone.utc
SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"
RATE = 50.0
CPU = PoolSpec(
    name="cpu",
    kind=PoolKind.ON_DEMAND,
    gpus=1,
    prefill_tokens_per_s=RATE,
    decode_tokens_per_s=RATE,
    startup_seconds=0.0,
)


def earlier_job(store: ManifestStore, *, model: str, commits: int, tokens_per_s: float) -> str:
    """A job of ``model`` whose one shard committed ``commits`` microbatches at ``tokens_per_s`` on CPU."""
    job, _ = store.create_job(
        NewJob(
            deadline=dt.datetime.now(UTC) + dt.timedelta(hours=1),
            input_uri="/data/in.jsonl",
            input_sha256="0" * 64,
            input_lines=commits,
            input_total_lines=commits,
            output_uri=f"/data/{model}",
            config={"engine": "echo", "model": model, "workers": 1, "pools": [CPU.to_dict()]},
        ),
        [
            NewShard(
                shard_index=0,
                byte_start=0,
                byte_end=100,
                first_line=1,
                line_count=commits,
                records=commits,
                num_microbatches=commits,
                input_sha256="0" * 64,
                est_work_s=60.0,
            )
        ],
        None,
    )
    lease = store.claim_shard(job.job_id, 0, ttl_s=60, worker="w", pool=CPU.name)
    commit_rest(
        store, lease, prompt_tokens=800, completion_tokens=200, elapsed_s=1000 / tokens_per_s, pool=CPU.name
    )
    return job.job_id


def request(tmp_path: Path, *, model: str, minutes: float = 60.0) -> PlanRequest:
    return PlanRequest(
        input_uri=str(SAMPLE),
        deadline=dt.datetime.now(UTC) + dt.timedelta(minutes=minutes),
        output_uri=str(tmp_path / "out"),
        model=model,
        pools=(CPU,),
        workers=1,
    )


def run_seconds(store: ManifestStore, job_id: str) -> float:
    chosen = store.get_job(job_id).admission["chosen"]
    return float(chosen["run_seconds"])


def test_the_next_job_of_a_model_is_planned_at_the_rate_the_last_one_measured(
    store: ManifestStore, tmp_path: Path
) -> None:
    before = plan_job(store, request(tmp_path, model="m-a"))
    (declared,) = store.get_job(before.job_id).admission["rates"]
    assert declared["source"] == "declared" and declared["commits"] == 0

    earlier_job(store, model="m-a", commits=MIN_RATE_COMMITS, tokens_per_s=RATE / 5)
    after = plan_job(store, request(tmp_path, model="m-a"))
    admission = store.get_job(after.job_id).admission
    (rate,) = admission["rates"]
    assert rate["source"] == "measured" and rate["commits"] == MIN_RATE_COMMITS and rate["jobs"] == 1
    assert rate["tokens_per_s"] == pytest.approx(RATE / 5)
    # the work is priced five times slower, and the job's config (its calibration prior) says so
    assert run_seconds(store, after.job_id) > 4 * run_seconds(store, before.job_id)
    (pool,) = store.get_job(after.job_id).config["pools"]
    assert pool["prefill_tokens_per_s"] == pytest.approx(RATE / 5)
    # a shard operator given the declared pools still calibrates from the rates the job was planned at
    view = read_job_view(store, after.job_id, now=dt.datetime.now(UTC), pools=[CPU])
    assert view.pools[0].decode_tokens_per_s == pytest.approx(RATE / 5)

    # a deadline the declared rate meets is refused at the measured one, with the numbers
    tight = (run_seconds(store, before.job_id) + 180.0) / 60.0
    with pytest.raises(AdmissionRejected, match=r"pool cpu rated 10 tokens/s .*measured 10 over 8 commit"):
        plan_job(store, request(tmp_path, model="m-a", minutes=tight))

    other = plan_job(store, request(tmp_path, model="m-b", minutes=tight))
    (kept,) = store.get_job(other.job_id).admission["rates"]
    assert kept["source"] == "declared" and kept["tokens_per_s"] == pytest.approx(RATE)


def test_a_thin_history_is_blended_with_the_declared_rate(store: ManifestStore, tmp_path: Path) -> None:
    earlier_job(store, model="m-a", commits=2, tokens_per_s=RATE * 20)  # 2 commits of 1 s each
    _, (rating,) = rate_pools(store, request(tmp_path, model="m-a"))
    assert rating.source == "blended" and rating.weight == pytest.approx(2 / MIN_RATE_COMMITS)
    # seconds per token averaged: 3/4 of the declared 1/50 plus 1/4 of the measured 1/1000
    assert rating.tokens_per_s == pytest.approx(1 / (0.75 / RATE + 0.25 / (RATE * 20)))
    # history older than the window, or of a job without that model, does not count
    assert store.measured_rates([CPU.name], engine="echo", model="m-a", days=0.0)[CPU.name].commits == 0
    assert store.measured_rates([CPU.name], engine="echo", model=None)[CPU.name].commits == 0


def test_capacity_list_shows_measured_rates_and_dispatch(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ManifestStore.open(store_url, migrate=True)
    try:
        store.set_capacity(CPU.name, 1)
        earlier = earlier_job(store, model="m-a", commits=MIN_RATE_COMMITS, tokens_per_s=RATE / 5)
        later = plan_job(store, request(tmp_path, model="m-a")).job_id
        latest_start = time.time() + 3600.0
        for job_id in (earlier, later):  # one GPU: the first request is granted, the second waits
            store.request_dispatch(
                job_id, 0, tenant="default", pool=CPU.name, latest_start=latest_start, ttl_s=60
            )
    finally:
        store.close()

    assert main(["capacity", "list", "--store", store_url, "--until", "+2h", "--json"]) == 0
    [pool] = orjson.loads(capsys.readouterr().out.splitlines()[-1])["pools"]
    assert pool["pool"] == CPU.name and pool["gpus"] == 1
    assert later in {r["job_id"] for r in pool["reservations"]}
    [rate] = pool["rates"]
    assert rate["model"] == "echo:m-a" and rate["commits"] == MIN_RATE_COMMITS and rate["jobs"] == 1
    assert rate["tokens_per_s"] == pytest.approx(RATE / 5)
    assert pool["dispatch"] == {"granted": 1, "waiting": 1}

    assert main(["capacity", "list", "--store", store_url, "--until", "+2h"]) == 0
    text = capsys.readouterr().out
    assert "cpu: 1 GPU(s)" in text and "slots granted 1, requests waiting 1" in text
    assert "measured echo:m-a: 10 tokens/s per GPU over 8 commit(s) of 1 job(s)" in text
