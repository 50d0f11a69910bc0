"""Deadline-risk assessment and notifier, progress link, and the plugin app refusing anonymous requests."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest
from airflow.sdk import BaseNotifier

from airflow_deadline_batch.core.job_view import JobView, build_job_view
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import JobState, ShardState
from airflow_deadline_batch.links.progress import progress_url
from airflow_deadline_batch.notifiers.deadline_risk import DeadlineRiskNotifier, RiskLevel, assess_risk

NOW = dt.datetime(2026, 3, 1, 4, 0, tzinfo=dt.timezone.utc)
DEADLINE = dt.datetime(2026, 3, 1, 6, 0, tzinfo=dt.timezone.utc)


POOL = PoolSpec(name="gpu", kind=PoolKind.ON_DEMAND, startup_seconds=0)


@dataclasses.dataclass(frozen=True)
class Job:
    state: JobState
    job_id: str = "j-1"
    deadline: dt.datetime = DEADLINE
    created_at: dt.datetime = NOW - dt.timedelta(hours=1)
    completed_at: dt.datetime | None = None
    input_lines: int = 100
    config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"pools": [POOL.to_dict()]})


@dataclasses.dataclass(frozen=True)
class Shard:
    shard_index: int
    est_work_s: float
    state: ShardState = ShardState.PENDING
    num_microbatches: int = 10
    cursor: int = 0
    last_pool: str | None = None


@dataclasses.dataclass(frozen=True)
class Commit:
    records: int = 40
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    pool: str | None = None
    committed_at: dt.datetime = NOW


def view(
    remaining_work_s: float, parallelism: int = 1, now: dt.datetime = NOW, state: JobState = JobState.RUNNING
) -> JobView:
    """A job with ``remaining_work_s`` left in one shard per worker, 40 of 100 records committed."""
    shards = [Shard(i, remaining_work_s / parallelism) for i in range(parallelism)]
    return build_job_view(Job(state), shards, [Commit()], now=now, parallelism=parallelism)


@pytest.mark.parametrize(
    ("remaining", "parallelism", "now", "level"),
    [
        (3600, 1, NOW, None),  # 1 h of slack, threshold 10 min
        (6700, 1, NOW, RiskLevel.THIN),  # 500 s of slack, under 600
        (8000, 1, NOW, RiskLevel.LATE),  # finishes 800 s late
        (8000, 4, NOW, None),  # four workers make it (2000 s each, plus 1500 s of imbalance)
        (10, 1, DEADLINE + dt.timedelta(seconds=1), RiskLevel.MISSED),
    ],
)
def test_assess_risk(remaining, parallelism, now, level):
    risk = assess_risk(view(remaining, parallelism, now), threshold_s=600)
    assert (risk.level if risk else None) is level


def test_assess_risk_is_silent_for_stopped_jobs():
    assert assess_risk(view(99_999, state=JobState.COMPLETED), threshold_s=600) is None
    assert assess_risk(view(99_999, state=JobState.REJECTED), threshold_s=600) is None


def test_assess_risk_predicts_finish_and_slack():
    risk = assess_risk(view(8000), threshold_s=600)
    assert risk.predicted_finish == NOW + dt.timedelta(seconds=8000)
    assert risk.slack_s == pytest.approx(-800)
    assert risk.to_dict()["level"] == "late"


class RecordingNotifier(BaseNotifier):
    """Stands in for Slack/PagerDuty (no network here): records what it would have sent."""

    template_fields = ("text",)
    sent: list[str] = []

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def notify(self, context) -> None:
        RecordingNotifier.sent.append(self.text)


def test_notifier_renders_and_forwards_to_wrapped_notifiers():
    RecordingNotifier.sent = []
    notifier = DeadlineRiskNotifier(
        notifiers=[RecordingNotifier("on-call: {{ deadline_risk.reason }}")], threshold_s=600
    )
    risk = assess_risk(view(8000), threshold_s=600)
    message = notifier.notify_risk({}, risk)
    assert "j-1" in message and "800 s after the deadline" in message and "40/100" in message
    assert RecordingNotifier.sent == ["on-call: predicted to finish 800 s after the deadline"]
    # the notifier is reusable: a second alert renders afresh
    second = notifier.notify_risk({}, assess_risk(view(6700), threshold_s=600))
    assert "below the 600 s threshold" in second
    assert len(RecordingNotifier.sent) == 2


def test_progress_url_quotes_the_job_and_the_manifest():
    url = progress_url("http://airflow:8080/", "j-abc", "s3://b/j-abc/manifest.json")
    assert (
        url == "http://airflow:8080/deadline-batch/jobs/j-abc?manifest=s3%3A%2F%2Fb%2Fj-abc%2Fmanifest.json"
    )
    assert progress_url("", "j/<x>") == "/deadline-batch/jobs/j%2F%3Cx%3E"


@pytest.mark.parametrize(
    "path", ["/jobs", "/jobs/j-any", "/runs/d/r", "/api/jobs", "/api/jobs/j-any", "/api/jobs/j-any/manifest"]
)
def test_plugin_app_refuses_requests_without_an_airflow_login(tmp_path, monkeypatch, path):
    """Airflow's own ``get_user`` answers before any store read: 401 without a token or cookie."""
    from fastapi.testclient import TestClient

    from airflow_deadline_batch.plugins.progress import create_app

    monkeypatch.setenv("ADB_STORE_URL", f"sqlite:///{tmp_path / 'never-opened.db'}")
    response = TestClient(create_app()).get(path)
    assert response.status_code == 401
    assert not (tmp_path / "never-opened.db").exists()
