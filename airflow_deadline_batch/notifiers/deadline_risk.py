"""Predictive "deadline at risk" alerts, delivered through any Airflow notifier.

:func:`assess_risk` is pure: from the job's :class:`~airflow_deadline_batch.core.job_view.JobView`
(committed progress, measured rates) it takes the predicted finish and the slack, and says
whether on-call should hear about it *now*, while there is still time to act (add GPUs, move to
on-demand). :class:`DeadlineRiskNotifier` renders one message and forwards the context, with the
assessment under ``deadline_risk``, to the wrapped notifiers (Slack, PagerDuty, SMTP, ...).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import enum
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseNotifier

from airflow_deadline_batch.core.job_view import JobView
from airflow_deadline_batch.triggers.completeness import plain

log = logging.getLogger(__name__)

DEFAULT_MESSAGE = (
    "Deadline at risk for job {{ deadline_risk.job_id }}: {{ deadline_risk.reason }} "
    "(predicted finish {{ deadline_risk.predicted_finish }}, deadline {{ deadline_risk.deadline }}, "
    "slack {{ deadline_risk.slack_s | round | int }} s, "
    "{{ deadline_risk.committed_records }}/{{ deadline_risk.total_records }} records committed)"
)


class RiskLevel(str, enum.Enum):
    """How bad it is: slack below the threshold, finish predicted past the deadline, or missed."""

    THIN = "thin"
    LATE = "late"
    MISSED = "missed"


@dataclasses.dataclass(frozen=True)
class RiskAssessment:
    """Why a job's deadline is at risk, in plain values for templates and XCom."""

    job_id: str
    level: RiskLevel
    reason: str
    deadline: dt.datetime
    predicted_finish: dt.datetime
    slack_s: float
    #: expected GPU-seconds of work left (all workers together)
    remaining_work_s: float
    committed_records: int
    total_records: int

    def to_dict(self) -> dict[str, Any]:
        return plain(self)


def assess_risk(view: JobView, threshold_s: float = 600.0) -> RiskAssessment | None:
    """The job's risk from its :class:`JobView`; ``None`` while slack stays above ``threshold_s``.

    Predicted finish and slack are the view's (committed work, measured rates, the job's workers:
    the numbers placement decides with). A stopped job is never at risk any more.
    """
    if view.stopped:
        return None
    slack_s = view.slack_s
    if slack_s >= threshold_s:
        return None
    if view.now >= view.deadline:
        level, reason = RiskLevel.MISSED, "the deadline has passed with work remaining"
    elif slack_s < 0:
        level, reason = RiskLevel.LATE, f"predicted to finish {-slack_s:.0f} s after the deadline"
    else:
        level, reason = RiskLevel.THIN, f"slack {slack_s:.0f} s is below the {threshold_s:.0f} s threshold"
    return RiskAssessment(
        job_id=view.job_id,
        level=level,
        reason=reason,
        deadline=view.deadline,
        predicted_finish=view.predicted_finish,
        slack_s=slack_s,
        remaining_work_s=view.remaining_work_s,
        committed_records=view.committed_records,
        total_records=view.total_records,
    )


class DeadlineRiskNotifier(BaseNotifier):
    """Log a templated at-risk message and forward it to other notifiers.

    :param notifiers: notifiers to call with the same context (for example
        ``SlackNotifier(text="{{ deadline_risk.reason }}")``); none means log only.
    :param message: Jinja template; the context holds ``deadline_risk`` (a :class:`RiskAssessment`
        as a dict).
    :param threshold_s: slack under which a job counts as at risk.
    """

    template_fields = ("message",)

    def __init__(
        self,
        *,
        notifiers: Sequence[BaseNotifier] = (),
        message: str = DEFAULT_MESSAGE,
        threshold_s: float = 600.0,
    ) -> None:
        super().__init__()
        self.notifiers = list(notifiers)
        self.message = message
        self.threshold_s = float(threshold_s)
        self.rendered: str | None = None

    def notify(self, context: Any) -> None:
        self.rendered = str(self.message)
        log.warning("%s", self.rendered)
        for notifier in self.notifiers:
            try:
                copy.copy(notifier)(context)
            except Exception:  # one broken channel must not silence the others
                log.exception("deadline-risk notifier %s failed", type(notifier).__name__)

    def notify_risk(self, context: Mapping[str, Any], risk: RiskAssessment) -> str:
        """Send one alert for ``risk``; returns the rendered message. A fresh copy renders each time."""
        sender = copy.copy(self)
        merged = dict(context)
        merged["deadline_risk"] = risk.to_dict()
        sender(merged)
        return sender.rendered or ""


async def log_hard_deadline_miss(context: Any = None, **kwargs: Any) -> None:
    """``DeadlineAlert`` callback for the hard miss (runs in the triggerer): one clear error line.

    Point a ``DeadlineAlert`` at a notifier class instead (for example Slack's) to page on-call; this
    default keeps the example DAGs free of external services.
    """
    dag_run = (context or {}).get("dag_run") if isinstance(context, Mapping) else None
    log.error("deadline missed for DAG run %s (%s)", getattr(dag_run, "run_id", None) or "?", kwargs or "")
