"""The OpenAI Batch status of a batch: a pure function of its DAG run's and its job's states.

docs/openai.md, *Status*, has the table. Inputs are plain strings (the DAG run's ``state`` as
Airflow's REST API spells it, the job's :class:`~airflow_deadline_batch.core.states.JobState`
value), so the mapping is tested without Airflow or a store.
"""

from __future__ import annotations

from typing import Final

#: OpenAI's Batch statuses, in lifecycle order
STATUSES: Final = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)
TERMINAL_STATUSES: Final = frozenset({"completed", "failed", "expired", "cancelled"})
#: job states whose manifest is published and exportable
PUBLISHED_JOB_STATES: Final = frozenset({"completed", "partial", "cancelled"})
UNFINISHED_JOB_STATES: Final = frozenset({"submitted", "admitted", "running", "finalizing"})
_ENDED_RUN_STATES: Final = frozenset({"success", "failed"})


def batch_status(
    run_state: str | None,
    job_state: str | None,
    *,
    exported: bool = False,
    cancel_requested: bool = False,
    expired_records: int = 0,
) -> str:
    """The Batch ``status``.

    ``run_state``: the DAG run's state (None: no such run). ``job_state``: the job's (None: the
    plan task has not created it yet). ``exported``: the job's OpenAI files are in the files store.
    ``expired_records``: the published manifest's ``expired`` outcomes (the deadline passed first).
    A terminal status needs the export: until the files exist the batch is ``finalizing`` (or
    ``cancelling``), so a client that sees ``completed`` can always download ``output_file_id``.
    """
    if job_state == "cancelled":
        return "cancelled" if exported else "cancelling"
    if cancel_requested and job_state in (None, *UNFINISHED_JOB_STATES):
        # asked before the job existed: the job is cancelled as soon as it appears
        if job_state is None and run_state in _ENDED_RUN_STATES:
            return "cancelled"
        return "cancelling"
    if job_state in ("completed", "partial"):
        if not exported:
            return "finalizing"
        return "expired" if expired_records else "completed"
    if job_state in ("failed", "rejected"):
        return "failed"
    if run_state == "failed":  # the run gave up before the job could publish
        return "failed"
    if job_state == "finalizing":
        return "finalizing"
    if job_state in ("admitted", "running"):
        return "in_progress"
    if job_state is None and run_state == "success":  # the run finished without planning a job
        return "failed"
    return "validating"  # queued run, running plan task, submitted job, or no run yet
