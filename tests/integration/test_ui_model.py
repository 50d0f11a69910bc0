"""The job page's numbers are the job view's (``read_job_view``) and the store's, on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import AttemptOutcome, JobState
from airflow_deadline_batch.metrics import attempt_totals
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.ui import model
from tests.helpers.commits import Microbatch, commit

SAMPLE = Path(__file__).resolve().parents[2] / "dags" / "data" / "sample_reviews.jsonl"
UTC = dt.timezone.utc


#: the fixture's microbatches: four records of 400 + 400 tokens in 2 s each
MICROBATCH: Microbatch = {"records": 4, "prompt_tokens": 400, "completion_tokens": 400, "elapsed_s": 2.0}


@pytest.fixture()
def job(store: ManifestStore, tmp_path: Path) -> str:
    """Planned by a DAG run; shard 0: two microbatches, then preempted; shard 1 leased with one."""
    job_id = plan_job(
        store,
        PlanRequest(
            input_uri=str(SAMPLE),
            deadline=dt.datetime.now(UTC) + dt.timedelta(hours=1),
            output_uri=str(tmp_path / "out"),
            engine="echo",
            pools=default_local_pools("echo"),
            workers=2,
            microbatch_size=4,
            idempotency_key="nightly/scheduled__2026-03-01T00:00:00+00:00/plan",
        ),
    ).job_id
    first = store.claim_shard(job_id, 0, ttl_s=60, worker="w0", pool="local-spot")
    first = commit(store, first, 0, **MICROBATCH)
    first = commit(store, first, 1, **MICROBATCH)
    assert store.release(first, AttemptOutcome.PREEMPTED)
    second = store.claim_shard(job_id, 1, ttl_s=60, worker="w1", pool="local-on-demand")
    commit(store, second, 0, **MICROBATCH)
    return job_id


def test_page_numbers_are_the_job_views(store: ManifestStore, job: str) -> None:
    now = dt.datetime.now(UTC)
    page = model.read_job_page(store, job, now=now)
    view = read_job_view(store, job, now=now)
    s = page.summary
    assert (s.state, s.deadline, s.predicted_finish, s.slack_s) == (
        view.state,
        view.deadline,
        view.predicted_finish,
        view.slack_s,
    )
    assert (s.committed_records, s.total_records) == (view.committed_records, view.total_records)
    totals = attempt_totals(view, store.list_attempts(job), store.list_commits(job))
    assert s.cost.so_far == pytest.approx(totals.cost) and s.cost.redone_work_s == pytest.approx(
        totals.redone_work_s
    )
    assert s.cost.projected >= s.cost.so_far
    assert s.cost.spot_share is not None and s.cost.on_demand_share is not None
    assert s.cost.spot_share + s.cost.on_demand_share == pytest.approx(1.0)
    assert s.planned_by == model.DagRunRef(
        dag_id="nightly", run_id="scheduled__2026-03-01T00:00:00+00:00", task_id="plan"
    )
    progress = store.progress(job)
    assert page.preemptions == progress.preemptions == 1
    assert sum(n for (_state, _pool), n in page.shards_by_state_pool.items()) == progress.shards_total
    assert {line.shard_index: (line.attempts, line.preemptions) for line in page.shards} == {
        0: (1, 1),
        1: (1, 0),
    }
    assert page.errors.errored_records == progress.errored


def test_history_replays_the_view_from_the_commits(store: ManifestStore, job: str) -> None:
    now = dt.datetime.now(UTC)
    page = model.read_job_page(store, job, now=now)
    first, last = page.history[0], page.history[-1]
    assert first.at == page.started_at and last.at == now
    # before any commit but the planner's validation object, every valid record was left
    validation = sum(c.records for c in store.list_commits(job) if c.shard_index < 0)
    assert first.remaining_records == page.summary.total_records - validation
    assert last.remaining_records == page.summary.total_records - page.summary.committed_records
    assert (last.predicted_finish, last.slack_s) == (page.summary.predicted_finish, page.summary.slack_s)
    remaining = [p.remaining_records for p in page.history]
    assert remaining == sorted(remaining, reverse=True), "committed work only grows"
    lo, hi = page.finish_spread
    assert lo <= page.summary.predicted_finish <= hi


def test_history_is_bounded(store: ManifestStore, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model, "MAX_POINTS", 3)
    page = model.read_job_page(store, job, now=dt.datetime.now(UTC))
    assert len(page.history) <= 3 and page.history[-1].remaining_records < page.history[0].remaining_records


def test_a_stopped_job_projects_no_more_cost(store: ManifestStore, job: str) -> None:
    store.set_job_state(job, JobState.CANCELLED)
    page = model.read_job_page(store, job, now=dt.datetime.now(UTC))
    assert page.summary.stopped
    assert page.summary.cost.projected == pytest.approx(page.summary.cost.so_far)


def test_published_outcomes_are_read_once_per_manifest_and_failures_are_not_cached(tmp_path: Path) -> None:
    """A published manifest is immutable: the refreshing page reads it once; an unreadable one is retried."""
    manifest = tmp_path / "manifest.json"
    uri = manifest.as_uri()
    assert model.published_outcomes(uri) is None  # not there yet: None, and nothing cached
    manifest.write_text('{"outcomes": {"succeeded": 3, "expired": 1}}')
    assert model.published_outcomes(uri) == {"succeeded": 3, "expired": 1}
    manifest.write_text('{"outcomes": {"succeeded": 0}}')  # never happens to a published one
    assert model.published_outcomes(uri) == {"succeeded": 3, "expired": 1}
    counts = model.published_outcomes(uri)
    assert counts is not None
    counts["succeeded"] = 99  # type: ignore[index]  # a caller's copy, not the cached counts
    assert model.published_outcomes(uri) == {"succeeded": 3, "expired": 1}


def test_a_live_racer_shows_on_its_shard_and_counts_as_a_running_worker(
    store: ManifestStore, job: str
) -> None:
    page = model.read_job_page(store, job, now=dt.datetime.now(UTC))
    assert page.running_workers == 1  # shard 1's primary
    assert all(line.racing_on is None for line in page.shards)
    racer = store.claim_race(job, 1, ttl_s=60, worker="w2", pool="local-spot")
    page = model.read_job_page(store, job, now=dt.datetime.now(UTC))
    assert page.running_workers == 2
    assert {line.shard_index: (line.pool, line.racing_on) for line in page.shards} == {
        0: ("local-spot", None),
        1: ("local-on-demand", "local-spot"),
    }
    # once its racing lease has expired, the racer is neither shown nor counted
    later = dt.datetime.fromtimestamp(racer.expires_at + 1, UTC)
    page = model.read_job_page(store, job, now=later)
    assert page.running_workers == 1 and page.shards[1].racing_on is None
