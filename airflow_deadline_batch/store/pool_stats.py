"""Read-only queries of what earlier jobs saw of a pool: the prior of placement's learned rates.

:func:`spot_history` folds the finished attempts of other jobs on each named pool into a
:class:`core.calibration.PoolHistory` (tries, preemptions, seconds on the pool), which
``operators.placement`` turns into the prior of the job's own Spot tries
(:func:`core.calibration.spot_prior`). No schema of its own: it reads ``adb_attempts``. The read is
bounded twice, by age (``since``) and by the ``limit`` most recent attempts per pool, so its cost
does not grow with the store's history; it runs once per placement decision.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.calibration import PoolHistory
from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.job_view import PREEMPTED_OUTCOMES
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.store.schema import attempts

#: how far back earlier jobs' tries count (pools change: a zone fills, a GPU type is retired)
HISTORY_DAYS = 30.0
#: the most recent finished attempts read per pool
HISTORY_LIMIT = 500

_PREEMPTED = {o.value for o in PREEMPTED_OUTCOMES}


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
            sa.select(attempts.c.started_at, attempts.c.ended_at, attempts.c.outcome)
            .where(
                attempts.c.pool == pool,
                attempts.c.ended_at.is_not(None),
                attempts.c.ended_at >= since,
                attempts.c.outcome != AttemptOutcome.RUNNING.value,
            )
            .order_by(attempts.c.ended_at.desc())
            .limit(limit)
        )
        if exclude_job is not None:
            query = query.where(attempts.c.job_id != exclude_job)
        tries = preemptions = 0
        seconds = 0.0
        for started, ended, outcome in conn.execute(query):
            span = (ensure_aware(ended, "ended_at") - ensure_aware(started, "started_at")).total_seconds()
            tries += 1
            preemptions += outcome in _PREEMPTED
            seconds += max(0.0, span)
        out[pool] = PoolHistory(pool=pool, tries=tries, preemptions=preemptions, spot_s=seconds)
    return out
