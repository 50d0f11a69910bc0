"""CompletenessTrigger: plain-value serialize() round trip and its events against a real SQLite store."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
from airflow.triggers.base import TriggerEvent

from airflow_deadline_batch.store import ManifestStore, NewJob, NewShard
from airflow_deadline_batch.triggers.completeness import (
    CompletenessEvent,
    CompletenessStatus,
    CompletenessTrigger,
    evaluate_progress,
)
from tests.helpers.commits import commit

NOW = dt.datetime.now(dt.timezone.utc)


@pytest.fixture()
def store(tmp_path) -> ManifestStore:
    s = ManifestStore(f"sqlite:///{tmp_path / 'store.db'}")
    s.migrate()
    return s


def make_job(store: ManifestStore, shards: int = 2) -> str:
    job, _ = store.create_job(
        NewJob(
            deadline=NOW + dt.timedelta(hours=1),
            input_uri="/in.jsonl",
            input_sha256="0" * 64,
            input_lines=2 * shards,
            input_total_lines=2 * shards,
            output_uri="/out",
            config={"workers": 1},
        ),
        [
            NewShard(
                shard_index=i,
                byte_start=i,
                byte_end=i + 1,
                first_line=i + 1,
                line_count=2,
                records=2,
                num_microbatches=1,
                input_sha256="0" * 64,
                est_work_s=10.0,
            )
            for i in range(shards)
        ],
        None,
    )
    return job.job_id


def finish_shard(store: ManifestStore, job_id: str, index: int) -> None:
    lease = store.claim_shard(job_id, index, ttl_s=60, worker="w")
    store.complete_shard(commit(store, lease, 0, records=2))


def collect(trigger: CompletenessTrigger) -> list[TriggerEvent]:
    async def run() -> list[TriggerEvent]:
        return [event async for event in trigger.run()]

    return asyncio.run(asyncio.wait_for(run(), timeout=60))


def test_serialize_returns_plain_values_and_round_trips():
    trigger = CompletenessTrigger(
        job_id="j-abc",
        store_url="sqlite:////tmp/x.db",
        poll_interval_s=5,
        timeout_at="2026-01-01T06:00:00+00:00",
        dag_id="d",
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_deadline_batch.triggers.completeness.CompletenessTrigger"
    assert kwargs == {
        "job_id": "j-abc",
        "store_url": "sqlite:////tmp/x.db",
        "store_conn_id": None,
        "poll_interval_s": 5.0,
        "timeout_at": "2026-01-01T06:00:00+00:00",
        "dag_id": "d",
        "aws_conn_id": None,
        "first_poll_delay_s": 0.0,
    }
    module, _, name = classpath.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls(**kwargs).serialize() == (classpath, kwargs)


def test_complete_event_when_every_shard_succeeded(store):
    job_id = make_job(store)
    for index in (0, 1):
        finish_shard(store, job_id, index)
    events = collect(CompletenessTrigger(job_id=job_id, store_url=store.url, poll_interval_s=0.01))
    assert len(events) == 1
    payload = events[0].payload
    assert set(payload) == {"status", "job_id", "progress", "message"}
    event = CompletenessEvent.from_payload(payload)
    assert event.status is CompletenessStatus.COMPLETE and event.job_id == job_id
    assert payload["progress"]["committed_records"] == 4
    assert payload["progress"]["shards_by_state"] == {"succeeded": 2}
    assert isinstance(payload["progress"]["deadline"], str)  # plain values only


def test_timeout_event_while_shards_are_pending(store):
    job_id = make_job(store)
    finish_shard(store, job_id, 0)
    past = (NOW - dt.timedelta(seconds=1)).isoformat()
    events = collect(
        CompletenessTrigger(job_id=job_id, store_url=store.url, poll_interval_s=0.01, timeout_at=past)
    )
    event = CompletenessEvent.from_payload(events[0].payload)
    assert event.status is CompletenessStatus.TIMEOUT
    assert event.progress["committed_records"] == 2


def test_failed_event_when_the_job_is_cancelled(store):
    job_id = make_job(store)
    store.cancel_job(job_id)
    event = CompletenessEvent.from_payload(
        collect(CompletenessTrigger(job_id=job_id, store_url=store.url, poll_interval_s=0.01))[0].payload
    )
    assert event.status is CompletenessStatus.FAILED
    assert "cancelled" in event.message


def test_failed_event_names_why_the_job_stopped(store):
    job_id = make_job(store)
    cause = "configuration error (shard 0): bucket 'nope' does not exist"
    store.set_job_state(job_id, "failed", error=cause)
    event = CompletenessEvent.from_payload(
        collect(CompletenessTrigger(job_id=job_id, store_url=store.url, poll_interval_s=0.01))[0].payload
    )
    assert event.status is CompletenessStatus.FAILED
    assert event.message.endswith(cause), event.message


def test_store_failure_becomes_an_error_event_not_an_exception(store):
    events = collect(CompletenessTrigger(job_id="j-doesnotexist", store_url=store.url, poll_interval_s=0.01))
    event = CompletenessEvent.from_payload(events[0].payload)
    assert event.status is CompletenessStatus.ERROR
    assert "j-doesnotexist" in event.message


@pytest.mark.parametrize(
    ("by_state", "state", "expected"),
    [
        ({"succeeded": 3}, "running", CompletenessStatus.COMPLETE),
        ({"succeeded": 2, "terminal_failure": 1}, "running", CompletenessStatus.FAILED),
        ({"succeeded": 2, "pending": 1}, "running", None),
        ({"succeeded": 2, "leased": 1}, "cancelled", CompletenessStatus.FAILED),
        ({"succeeded": 1, "retryable_failure": 1}, "running", None),
    ],
)
def test_evaluate_progress(by_state, state, expected):
    event = evaluate_progress("j-x", {"shards_by_state": by_state, "state": state})
    assert (event.status if event else None) is expected
