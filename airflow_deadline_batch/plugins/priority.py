"""``DeadlineWeightStrategy``: shard tasks of a job due sooner get a higher Airflow priority weight.

Airflow asks a task's ``weight_rule`` for the ``priority_weight`` of a task instance when it
creates or refreshes the instance (``TaskInstance.insert_mapping`` at DAG run creation,
``refresh_from_task`` when a mapped task expands or a task is cleared), never when it queues it:
the weight is a column the scheduler sorts by. For ``expand_kwargs(plan.output)`` shards that is
once the plan has run, except map index 0, which inherits the weight of the unmapped placeholder
created with the DAG run (docs/airflow.md, *Priority weights*). So the input is what is fixed by
then, the job's **deadline**: earliest deadline first, the order the admission test assumed
(``core.admission``), not least slack, which would change as shards commit and Airflow would not
see. Where it comes from, first that holds:

1. the ``admission_report`` XCom of an upstream plan task (``DeadlineBatchOperator``), read in the
   session the scheduler is already in (no new connection, no store access);
2. the plan task's own ``deadline`` argument when it is literal (an ISO-8601 instant or
   ``+DURATION``, read at that moment), not a Jinja template;
3. else the task's fixed ``priority_weight``.

The weight is the task's ``priority_weight`` plus the minutes from the deadline to
:data:`WEIGHT_ANCHOR`, so it is the same whenever it is computed, and a deadline a minute sooner
weighs one more. ``get_weight`` never raises: any failure falls back to the fixed weight.
Registered by ``DeadlineBatchPlugin`` (``priority_weight_strategies``); a DAG names it with
``weight_rule=DEADLINE_WEIGHT_RULE`` (``operators.shard``).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from airflow.task.priority_strategy import PriorityWeightStrategy

from airflow_deadline_batch.core.deadlines import parse_deadline

if TYPE_CHECKING:
    from airflow.models.taskinstance import TaskInstance

log = logging.getLogger(__name__)

#: the instant the weights count minutes to; far enough that no deadline passes it
WEIGHT_ANCHOR = dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc)
#: Airflow stores priority weights as 32-bit integers (``db_safe_priority``)
MAX_WEIGHT = 2**31 - 1
#: the XCom key the plan task pushes its admission report under
ADMISSION_REPORT_KEY = "admission_report"


def deadline_weight(deadline: dt.datetime, base: int = 1) -> int:
    """``base`` plus the whole minutes from ``deadline`` to :data:`WEIGHT_ANCHOR` (sooner: heavier)."""
    minutes = int((WEIGHT_ANCHOR - deadline).total_seconds() // 60)
    return _in_range(max(base, min(MAX_WEIGHT, base + max(0, minutes))))


def _in_range(weight: int) -> int:
    """``weight`` clamped to Airflow's 32-bit priority weights (a huge fixed weight included)."""
    return max(-MAX_WEIGHT - 1, min(MAX_WEIGHT, weight))


class DeadlineWeightStrategy(PriorityWeightStrategy):
    """Earliest deadline first: a shard of a job due sooner gets a higher ``priority_weight``."""

    def get_weight(self, ti: TaskInstance) -> int:
        base = _fixed_weight(ti)
        try:
            deadline = _reported_deadline(ti) or _literal_deadline(ti)
        except Exception:  # a weight must come back whatever the DAG or the database holds
            log.debug("no deadline for %s; fixed weight %d", ti, base, exc_info=True)
            return base
        return base if deadline is None else deadline_weight(deadline, base)


def _fixed_weight(ti: Any) -> int:
    weight = getattr(getattr(ti, "task", None), "priority_weight", 1)
    return _in_range(weight) if isinstance(weight, int) and not isinstance(weight, bool) else 1


def _upstream_ids(ti: Any) -> list[str]:
    return sorted(getattr(ti.task, "upstream_task_ids", None) or ())


def _reported_deadline(ti: Any) -> dt.datetime | None:
    """The deadline in an upstream plan task's admission report, read in the TI's own session."""
    import sqlalchemy as sa

    state = sa.inspect(ti, raiseerr=False)  # None for anything but a mapped TaskInstance
    session = state.session if state is not None else None
    upstream = _upstream_ids(ti)
    if session is None or not upstream or not ti.run_id:
        return None  # a TI being built for a new DAG run: nothing has run yet
    from airflow.models.xcom import XComModel

    query = XComModel.get_many(
        run_id=ti.run_id,
        key=ADMISSION_REPORT_KEY,
        dag_ids=ti.dag_id,
        task_ids=upstream,
        map_indexes=-1,
    )
    return _first_deadline(XComModel.deserialize_value(row) for row in session.scalars(query))


def _first_deadline(reports: Iterable[Any]) -> dt.datetime | None:
    for report in reports:
        if isinstance(report, dict) and isinstance(report.get("deadline"), str):
            return _aware(dt.datetime.fromisoformat(report["deadline"].replace("Z", "+00:00")))
    return None


def _literal_deadline(ti: Any) -> dt.datetime | None:
    """An upstream plan task's literal ``deadline`` argument (no template), read now."""
    dag = getattr(ti.task, "dag", None)
    if dag is None:
        return None
    for task_id in _upstream_ids(ti):
        value = getattr(dag.get_task(task_id), "deadline", None)
        if isinstance(value, dt.datetime):
            return _aware(value)
        if isinstance(value, str) and "{" not in value:
            return parse_deadline(value, dt.datetime.now(dt.timezone.utc))
    return None


def _aware(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)
