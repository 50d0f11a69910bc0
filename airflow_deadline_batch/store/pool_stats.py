"""What earlier jobs saw of a pool, the prior of placement's learned rates; and a Spot try that
never ran.

:func:`spot_history` folds the finished attempts of other jobs on each named pool into a
:class:`core.calibration.PoolHistory`: the tries that ran (tries, preemptions by
:func:`core.states.is_preemption` — a ``stalled`` or crashed try is Spot time without one —,
seconds on the pool) and those whose pod waited for capacity in vain (``unschedulable`` attempts,
the seconds they waited), which ``operators.placement`` turns into the prior of the job's own Spot
tries (:func:`core.calibration.spot_prior`) and of the pool's availability
(:func:`core.calibration.availability_prior`). No schema of its own: it reads ``adb_attempts``.
The read is bounded twice, by age (``since``) and by the ``limit`` most recent attempts per pool,
so its cost does not grow with the store's history; it runs once per placement decision.

:func:`record_unschedulable` writes the one observation a waiting pod leaves: an ``unschedulable``
attempt row (no lease: epoch :data:`NO_LEASE_EPOCH`, no worker heartbeat, so no GPU time is billed).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.calibration import PoolHistory, gave_up_waiting
from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.ids import new_attempt_id
from airflow_deadline_batch.core.states import AttemptOutcome, is_preemption
from airflow_deadline_batch.store.schema import attempts, db_timestamp, jobs

#: how far back earlier jobs' tries count (pools change: a zone fills, a GPU type is retired)
HISTORY_DAYS = 30.0
#: the most recent finished attempts read per pool
HISTORY_LIMIT = 500

_UNSCHEDULABLE = AttemptOutcome.UNSCHEDULABLE.value
#: the epoch of an attempt that never held a lease (a lease's epoch is >= 1)
NO_LEASE_EPOCH = -1


def spot_history(
    conn: Connection,
    pools: Sequence[str],
    *,
    since: dt.datetime,
    exclude_job: str | None = None,
    limit: int = HISTORY_LIMIT,
) -> dict[str, PoolHistory]:
    """Each named pool's finished attempts of other jobs ended since ``since`` (the newest ``limit``)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    out: dict[str, PoolHistory] = {}
    for pool in dict.fromkeys(pools):
        query = (
            sa.select(
                attempts.c.started_at, attempts.c.ended_at, attempts.c.outcome, attempts.c.failure_class
            )
            .where(
                attempts.c.pool == pool,
                attempts.c.ended_at.is_not(None),
                attempts.c.ended_at >= since,
                # the store stamps every end with its own clock: a later one is corrupt, not news
                attempts.c.ended_at <= db_timestamp(),
                attempts.c.outcome != AttemptOutcome.RUNNING.value,
            )
            .order_by(attempts.c.ended_at.desc())
            .limit(limit)
        )
        if exclude_job is not None:
            query = query.where(attempts.c.job_id != exclude_job)
        tries = preemptions = unschedulable = 0
        seconds = waited = 0.0
        gave_up: dt.datetime | None = None
        started_last = _running_start(conn, pool, exclude_job)
        for started, ended, outcome, failure_class in conn.execute(query):
            started, ended = ensure_aware(started, "started_at"), ensure_aware(ended, "ended_at")
            span = max(0.0, (ended - started).total_seconds())
            if outcome == _UNSCHEDULABLE:
                unschedulable += 1
                waited += span
                if gave_up_waiting(failure_class):
                    gave_up = ended if gave_up is None else max(gave_up, ended)
                continue
            tries += 1
            started_last = started if started_last is None else max(started_last, started)
            preemptions += is_preemption(outcome, failure_class)
            seconds += span
        out[pool] = PoolHistory(
            pool=pool,
            tries=tries,
            preemptions=preemptions,
            spot_s=seconds,
            unschedulable=unschedulable,
            wait_s=waited,
            last_unschedulable_s=gave_up.timestamp() if gave_up is not None else None,
            last_start_s=started_last.timestamp() if started_last is not None else None,
        )
    return out


def _running_start(conn: Connection, pool: str, exclude_job: str | None) -> dt.datetime | None:
    """When the latest try of another job still running on ``pool`` started (None: none runs).

    With the finished tries' starts it tells whether capacity came back after a give-up (a running
    try has it now); a second, one-row read on the ``(pool, ended_at)`` index (``ended_at`` null).
    """
    query = sa.select(sa.func.max(attempts.c.started_at)).where(
        attempts.c.pool == pool,
        attempts.c.ended_at.is_(None),
        attempts.c.outcome == AttemptOutcome.RUNNING.value,
    )
    if exclude_job is not None:
        query = query.where(attempts.c.job_id != exclude_job)
    latest = conn.execute(query).scalar()
    return ensure_aware(latest, "started_at") if latest is not None else None


def record_unschedulable(
    conn: Connection,
    *,
    job_id: str,
    shard_index: int,
    pool: str,
    worker: str,
    created_at: dt.datetime,
    now: dt.datetime,
    error: str,
    scheduled_at: dt.datetime | None = None,
) -> str:
    """Record the time a Spot try's pod waited for capacity since ``created_at``.

    Until ``scheduled_at`` when it was scheduled at last, else until ``now``, when the try gave up
    (then a failed try of class ``transient``). An ``unschedulable`` attempt row, ended at once; it
    holds no lease and changes no shard. Once per pod (``worker``, a pod's unique name): a deferred
    task re-enters more than once. Returns its attempt ID.
    """
    recorded = conn.execute(
        sa.select(attempts.c.attempt_id).where(
            attempts.c.job_id == job_id,
            attempts.c.shard_index == shard_index,
            attempts.c.worker == worker,
            attempts.c.outcome == _UNSCHEDULABLE,
        )
    ).scalar()
    if recorded is not None:
        return str(recorded)
    attempt_id = new_attempt_id()
    now = ensure_aware(now, "now")
    end = now if scheduled_at is None else min(ensure_aware(scheduled_at, "scheduled_at"), now)
    # the pod's creation time is the API server's clock, not the store's: a wait counts no longer
    # than its job's whole window (creation to deadline), which bounds any try's startup timeout
    job = conn.execute(sa.select(jobs.c.created_at, jobs.c.deadline).where(jobs.c.job_id == job_id)).first()
    start = min(ensure_aware(created_at, "created_at"), end)
    if job is not None:
        window = ensure_aware(job.deadline, "deadline") - ensure_aware(job.created_at, "created_at")
        start = max(start, end - max(window, dt.timedelta(0)))
    conn.execute(
        sa.insert(attempts).values(
            attempt_id=attempt_id,
            job_id=job_id,
            shard_index=shard_index,
            epoch=NO_LEASE_EPOCH,
            worker=worker,
            pool=pool,
            started_at=start,
            ended_at=end,
            outcome=_UNSCHEDULABLE,
            error=error[:2000],
            failure_class=FailureClass.TRANSIENT.value if scheduled_at is None else None,
        )
    )
    return attempt_id
