"""Predictive "deadline at risk" alerts, delivered through any Airflow notifier.

:func:`assess_risk` is pure: from the job's :class:`~airflow_deadline_batch.core.job_view.JobView`
(committed progress, measured rates) it takes the predicted finish and the slack, and says
whether on-call should hear about it *now*, while there is still time to act (add GPUs, move to
on-demand). :class:`DeadlineRiskNotifier` renders one message and forwards the context, with the
assessment under ``deadline_risk``, to the wrapped notifiers (Slack, PagerDuty, SMTP, ...).

**Once per crossing** (:func:`track_risk`): the alert fires when the predicted finish crosses
``deadline - threshold_s`` (slack falls below the threshold) while the watch is *armed*; firing
disarms it, and it re-arms only once slack is back at or above the threshold. The armed flag is
the whole state; its owners persist it: ``CompletenessTrigger`` in its serialized kwargs
(``risk_armed``, so a triggerer restart neither repeats nor loses an alert), the poking sensor on
itself. :func:`risk_causes` names why from the same view (Spot gone, throughput below plan,
failed tries), and the alert carries the job page's link.
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

from airflow_deadline_batch.core.job_view import AttemptFields, JobView
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.core.states import PREEMPTION_OUTCOMES, AttemptOutcome, is_preemption
from airflow_deadline_batch.links.progress import airflow_base_url, progress_url
from airflow_deadline_batch.triggers.completeness import plain

log = logging.getLogger(__name__)

DEFAULT_MESSAGE = (
    "Deadline at risk for job {{ deadline_risk.job_id }}: {{ deadline_risk.reason }} "
    "(predicted finish {{ deadline_risk.predicted_finish }}, deadline {{ deadline_risk.deadline }}, "
    "slack {{ deadline_risk.slack_s | round | int }} s, "
    "{{ deadline_risk.committed_records }}/{{ deadline_risk.total_records }} records committed)"
    "{% if deadline_risk.causes %}; cause: {{ deadline_risk.causes | join('; ') }}{% endif %}"
    "{% if deadline_risk.page_url %}; page: {{ deadline_risk.page_url }}{% endif %}"
)

#: measured throughput this much below the plan's nominal rate counts as a throughput drop
THROUGHPUT_DROP = 1.25
#: failed tries (not preemptions) that count as a cause
FAILED_OUTCOMES = frozenset({AttemptOutcome.FAILED_RETRYABLE, AttemptOutcome.FAILED_TERMINAL})


def failed_try(attempt: AttemptFields) -> bool:
    """A try that failed rather than was preempted: a failed outcome, or a crash that ended it
    with a preemption outcome (the launcher saw the worker die of a crash)."""
    outcome = AttemptOutcome(attempt.outcome)
    if outcome in FAILED_OUTCOMES:
        return True
    return outcome in PREEMPTION_OUTCOMES and not is_preemption(outcome, attempt.failure_class)


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
    #: why, in words on-call acts on (:func:`risk_causes`); empty when nothing stands out
    causes: tuple[str, ...] = ()
    #: the job's page in Airflow's UI
    page_url: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(plain(self))


def risk_causes(view: JobView, attempts: Sequence[AttemptFields] = ()) -> tuple[str, ...]:
    """What is eating the slack, read from the view (and the job's tries, when given).

    * **Spot gone**: the job has Spot pools and its latest Spot tries were preempted without
      committing (the view's storm count), or every worker runs on on-demand now;
    * **throughput drop**: the measured rate is :data:`THROUGHPUT_DROP` times slower than planned
      (the view's ``work_scale``);
    * **failures**: tries that failed (not preempted), a crash the launcher saw included
      (an ``abandoned`` try of a crash class: :func:`~core.states.is_preemption`).
    """
    causes = []
    has_spot = any(p.kind is PoolKind.SPOT for p in view.pools)
    if has_spot and view.spot_tries.fruitless > 0:
        causes.append(
            f"Spot gone: the last {view.spot_tries.fruitless} Spot tries were preempted before committing"
        )
    elif has_spot and view.on_demand_shards and not view.spot_shards:
        causes.append(f"Spot gone: all {len(view.on_demand_shards)} running worker(s) are on on-demand")
    if view.work_scale >= THROUGHPUT_DROP:
        causes.append(f"throughput drop: measured throughput is {view.work_scale:.1f}x slower than planned")
    failed = [a for a in attempts if failed_try(a)]
    if failed:
        causes.append(
            f"failures: {len(failed)} failed tries on {len({a.shard_index for a in failed})} shard(s)"
        )
    return tuple(causes)


def assess_risk(
    view: JobView,
    threshold_s: float = 600.0,
    *,
    attempts: Sequence[AttemptFields] = (),
    base_url: str | None = None,
) -> RiskAssessment | None:
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
        causes=risk_causes(view, attempts),
        page_url=progress_url(airflow_base_url() if base_url is None else base_url, view.job_id),
    )


@dataclasses.dataclass(frozen=True)
class RiskWatch:
    """One observation of the once-per-crossing watch: the alert to send now (if any) and the state after."""

    alert: RiskAssessment | None
    armed: bool


def track_risk(
    view: JobView,
    threshold_s: float,
    *,
    armed: bool,
    attempts: Sequence[AttemptFields] = (),
    base_url: str | None = None,
) -> RiskWatch:
    """Fire once when slack crosses below ``threshold_s`` while armed; re-arm once it is back above.

    A stopped job changes nothing (no alert, same state): its page and the hard-miss
    ``DeadlineAlert`` take over.
    """
    if view.stopped:
        return RiskWatch(None, armed)
    risk = assess_risk(view, threshold_s, attempts=attempts, base_url=base_url)
    if risk is None:
        return RiskWatch(None, True)
    if armed:
        return RiskWatch(risk, False)
    return RiskWatch(None, False)


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
        return self.notify_payload(context, risk.to_dict())

    def notify_payload(self, context: Mapping[str, Any], risk: Mapping[str, Any]) -> str:
        """Send one alert for a :meth:`RiskAssessment.to_dict` (as a trigger event carries it)."""
        sender = copy.copy(self)
        merged = dict(context)
        merged["deadline_risk"] = dict(risk)
        sender(merged)
        return sender.rendered or ""


async def log_hard_deadline_miss(context: Any = None, **kwargs: Any) -> None:
    """``DeadlineAlert`` callback for the hard miss (runs in the triggerer): one clear error line.

    Point a ``DeadlineAlert`` at a notifier class instead (for example Slack's) to page on-call; this
    default keeps the example DAGs free of external services.
    """
    dag_run = (context or {}).get("dag_run") if isinstance(context, Mapping) else None
    log.error("deadline missed for DAG run %s (%s)", getattr(dag_run, "run_id", None) or "?", kwargs or "")
