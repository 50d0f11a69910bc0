"""The OpenAI Batch status of a batch: DAG run state + job state (+ export, cancel) → status."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.api.status import STATUSES, batch_status
from airflow_deadline_batch.core.states import JobState


@pytest.mark.parametrize(
    ("run_state", "job_state", "kwargs", "expected"),
    [
        # before the job exists
        (None, None, {}, "validating"),
        ("queued", None, {}, "validating"),
        ("running", None, {}, "validating"),
        ("running", "submitted", {}, "validating"),
        ("failed", None, {}, "failed"),
        ("success", None, {}, "failed"),  # the run ended without planning a job
        # running
        ("running", "admitted", {}, "in_progress"),
        ("running", "running", {}, "in_progress"),
        ("running", "finalizing", {}, "finalizing"),
        # published: terminal only once exported
        ("running", "completed", {}, "finalizing"),
        ("success", "completed", {}, "finalizing"),
        ("success", "completed", {"exported": True}, "completed"),
        ("running", "completed", {"exported": True}, "completed"),
        ("success", "partial", {"exported": True}, "completed"),  # errored lines: completed, as OpenAI
        ("success", "partial", {"exported": True, "expired_records": 3}, "expired"),
        ("failed", "partial", {"exported": True, "expired_records": 1}, "expired"),
        ("failed", "completed", {"exported": True}, "completed"),  # the manifest is what counts
        # failures
        ("running", "failed", {}, "failed"),
        ("running", "rejected", {}, "failed"),
        ("failed", "running", {}, "failed"),
        ("failed", "finalizing", {}, "failed"),
        # cancel
        ("running", "running", {"cancel_requested": True}, "cancelling"),
        ("running", None, {"cancel_requested": True}, "cancelling"),
        ("queued", "submitted", {"cancel_requested": True}, "cancelling"),
        ("failed", None, {"cancel_requested": True}, "cancelled"),
        ("running", "cancelled", {}, "cancelling"),  # published, not yet exported
        ("running", "cancelled", {"exported": True}, "cancelled"),
        ("failed", "cancelled", {"exported": True, "cancel_requested": True}, "cancelled"),
        # a cancel that lost to publication: the job's own outcome stands
        ("success", "completed", {"exported": True, "cancel_requested": True}, "completed"),
        ("running", "failed", {"cancel_requested": True}, "failed"),
    ],
)
def test_status_mapping(run_state: str | None, job_state: str | None, kwargs: dict, expected: str) -> None:
    assert batch_status(run_state, job_state, **kwargs) == expected


@pytest.mark.parametrize("job_state", [None, *(s.value for s in JobState)])
@pytest.mark.parametrize("run_state", [None, "queued", "running", "success", "failed"])
@pytest.mark.parametrize("exported", [False, True])
@pytest.mark.parametrize("cancel_requested", [False, True])
def test_every_combination_is_an_openai_status(
    run_state: str | None, job_state: str | None, exported: bool, cancel_requested: bool
) -> None:
    status = batch_status(run_state, job_state, exported=exported, cancel_requested=cancel_requested)
    assert status in STATUSES


def test_every_job_state_is_mapped_explicitly() -> None:
    """A new JobState must be placed in the table: unknown states must not read as ``validating``."""
    mapped = {"submitted", "admitted", "running", "finalizing", "completed", "partial", "failed"}
    mapped |= {"cancelled", "rejected"}
    assert {s.value for s in JobState} == mapped
