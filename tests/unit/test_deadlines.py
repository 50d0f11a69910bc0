from __future__ import annotations

import datetime as dt

import pytest

from airflow_deadline_batch.core.deadlines import parse_deadline, parse_duration
from airflow_deadline_batch.core.ids import new_attempt_id, new_job_id, shard_id

NOW = dt.datetime(2026, 11, 30, 1, 0, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("+30m", 1800), ("+2h", 7200), ("+1h30m", 5400), ("+45s", 45), ("+1d", 86400), ("+1.5h", 5400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == seconds
    assert parse_deadline(text, NOW) == NOW + dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["30m", "+", "+0m", "+5x", "+-5m", "tomorrow"])
def test_bad_durations_and_deadlines_name_the_fix(text: str) -> None:
    with pytest.raises(ValueError, match=r"\+DURATION|ISO 8601"):
        parse_deadline(text, NOW)


def test_iso_deadlines_are_converted_to_utc() -> None:
    assert parse_deadline("2026-12-01T06:00:00Z", NOW) == dt.datetime(2026, 12, 1, 6, tzinfo=dt.timezone.utc)
    assert parse_deadline("2026-12-01T07:00:00+01:00", NOW) == dt.datetime(
        2026, 12, 1, 6, tzinfo=dt.timezone.utc
    )


def test_naive_deadline_is_refused_with_a_fix() -> None:
    with pytest.raises(ValueError, match="no time zone: add one"):
        parse_deadline("2026-12-01T06:00:00", NOW)
    with pytest.raises(ValueError, match="timezone-aware"):
        parse_deadline(dt.datetime(2026, 12, 1, 6), NOW)


def test_identifiers_are_unique_and_path_safe() -> None:
    jobs = {new_job_id() for _ in range(1000)}
    assert len(jobs) == 1000
    for job in jobs:
        assert job.startswith("j-") and len(job) == 22 and job[2:].isalnum() and job == job.lower()
    attempt = new_attempt_id()
    assert attempt.startswith("a-") and len(attempt) == 34
    assert shard_id(7) == "00007" and shard_id(-1) == "validation"
