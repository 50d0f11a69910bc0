"""The at-risk alert fires once per crossing of ``deadline - threshold`` and re-arms above it.

The pure watch (``track_risk``) over real job views, then the trigger that persists the watch in
its serialized kwargs, against a real SQLite store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest
from airflow.sdk import BaseNotifier
from airflow.sdk.exceptions import TaskDeferred

from airflow_deadline_batch.core.job_view import JobView, build_job_view
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.notifiers.deadline_risk import DeadlineRiskNotifier, risk_causes, track_risk
from airflow_deadline_batch.sensors.completeness import CompletenessSensor
from airflow_deadline_batch.store import ManifestStore, NewJob, NewShard
from airflow_deadline_batch.triggers.completeness import (
    CompletenessEvent,
    CompletenessStatus,
    CompletenessTrigger,
    _Poll,
)

NOW = dt.datetime(2026, 3, 1, 4, 0, tzinfo=dt.timezone.utc)
DEADLINE = NOW + dt.timedelta(hours=2)
SPOT = PoolSpec(name="spot", kind=PoolKind.SPOT, startup_seconds=0, queue_wait_seconds=0)
OD = PoolSpec(name="od", kind=PoolKind.ON_DEMAND, startup_seconds=0, queue_wait_seconds=0)
THRESHOLD = 600.0


@dataclasses.dataclass(frozen=True)
class Job:
    state: JobState = JobState.RUNNING
    job_id: str = "j-1"
    deadline: dt.datetime = DEADLINE
    created_at: dt.datetime = NOW - dt.timedelta(hours=1)
    completed_at: dt.datetime | None = None
    input_lines: int = 100
    config: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"pools": [OD.to_dict()]})


@dataclasses.dataclass(frozen=True)
class Shard:
    est_work_s: float
    shard_index: int = 0
    state: ShardState = ShardState.PENDING
    num_microbatches: int = 10
    cursor: int = 0
    last_pool: str | None = None


@dataclasses.dataclass(frozen=True)
class Attempt:
    attempt_id: str
    shard_index: int
    pool: str | None
    started_at: dt.datetime
    ended_at: dt.datetime | None
    outcome: AttemptOutcome
    failure_class: str | None = None


def view(slack_s: float, *, state: JobState = JobState.RUNNING, **job: Any) -> JobView:
    """A one-worker job whose predicted finish leaves ``slack_s`` before the deadline."""
    work = (DEADLINE - NOW).total_seconds() - slack_s
    return build_job_view(Job(state=state, **job), [Shard(work)], [], now=NOW)


def test_fires_once_per_crossing_and_re_arms_above_the_threshold():
    armed, fired = True, []
    # slack over successive polls: above, crosses, stays below, back above, crosses again
    for slack in (3000, 900, 500, 300, -100, 700, 2000, 400, 100):
        watch = track_risk(view(slack), THRESHOLD, armed=armed, base_url="http://af")
        armed = watch.armed
        fired.append(watch.alert.slack_s if watch.alert else None)
    assert fired == [None, None, 500, None, None, None, None, 400, None]


def test_the_alert_says_job_slack_cause_and_page():
    watch = track_risk(view(100), THRESHOLD, armed=True, base_url="http://af:8080/")
    assert watch.alert is not None and not watch.armed
    payload = watch.alert.to_dict()
    assert payload["job_id"] == "j-1" and payload["slack_s"] == pytest.approx(100)
    assert payload["page_url"] == "http://af:8080/deadline-batch/jobs/j-1"
    assert payload["level"] == "thin"


def test_a_stopped_job_neither_fires_nor_re_arms():
    for armed in (True, False):
        watch = track_risk(view(-500, state=JobState.COMPLETED), THRESHOLD, armed=armed, base_url="")
        assert watch.alert is None and watch.armed is armed


def test_causes_name_spot_gone_throughput_drop_and_failures():
    pools = [SPOT.to_dict(), OD.to_dict()]
    attempts = [
        Attempt(
            f"a{i}", 0, "spot", NOW - dt.timedelta(minutes=10 - i), NOW - dt.timedelta(minutes=9 - i), outcome
        )
        for i, outcome in enumerate((AttemptOutcome.PREEMPTED, AttemptOutcome.PREEMPTED))
    ]
    failed = Attempt("a9", 0, "od", NOW - dt.timedelta(minutes=5), NOW, AttemptOutcome.FAILED_RETRYABLE)
    job = Job(config={"pools": pools})
    spot_gone = build_job_view(job, [Shard(5000)], [], now=NOW, attempts=attempts)
    causes = risk_causes(spot_gone, [*attempts, failed])
    assert causes[0].startswith("Spot gone: the last 2 Spot tries")
    assert causes[-1] == "failures: 1 failed tries on 1 shard(s)"
    slow = dataclasses.replace(
        spot_gone, work_scale=2.0, spot_tries=dataclasses.replace(spot_gone.spot_tries, fruitless=0)
    )
    assert risk_causes(slow) == ("throughput drop: measured throughput is 2.0x slower than planned",)
    assert risk_causes(view(100)) == ()


# -- the trigger persists the watch in its kwargs ------------------------------------------------------


@pytest.fixture()
def store(tmp_path) -> ManifestStore:
    s = ManifestStore(f"sqlite:///{tmp_path / 'store.db'}")
    s.migrate()
    return s


def make_job(store: ManifestStore, work_s: float) -> str:
    """A running-or-admitted job whose one shard has ``work_s`` of work left, deadline in 2 h."""
    job, _ = store.create_job(
        NewJob(
            deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2),
            input_uri="/in.jsonl",
            input_sha256="0" * 64,
            input_lines=2,
            input_total_lines=2,
            output_uri="/out",
            config={"workers": 1, "pools": [OD.to_dict()]},
        ),
        [
            NewShard(
                shard_index=0,
                byte_start=0,
                byte_end=1,
                first_line=1,
                line_count=2,
                records=2,
                num_microbatches=1,
                input_sha256="0" * 64,
                est_work_s=work_s,
            )
        ],
        None,
    )
    return job.job_id


def first_event(trigger: CompletenessTrigger) -> CompletenessEvent:
    """The trigger's one event."""

    async def run() -> list[CompletenessEvent]:
        return [CompletenessEvent.from_payload(event.payload) async for event in trigger.run()]

    events = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert len(events) == 1
    return events[0]


def trigger_for(store: ManifestStore, job_id: str, **risk: Any) -> CompletenessTrigger:
    return CompletenessTrigger(job_id=job_id, store_url=store.url, poll_interval_s=0.01, **risk)


def test_serialized_kwargs_carry_the_watch_only_when_it_is_on():
    plain = CompletenessTrigger(job_id="j", store_url="sqlite://")
    assert "risk_armed" not in plain.serialize()[1]
    watching = CompletenessTrigger(job_id="j", store_url="sqlite://", risk_threshold_s=600, risk_armed=False)
    classpath, kwargs = watching.serialize()
    assert kwargs == {
        "job_id": "j",
        "store_url": "sqlite://",
        "store_conn_id": None,
        "poll_interval_s": 30.0,
        "timeout_at": None,
        "dag_id": None,
        "aws_conn_id": None,
        "first_poll_delay_s": 0.0,
        "risk_threshold_s": 600.0,
        "risk_armed": False,
    }
    assert CompletenessTrigger(**kwargs).serialize() == (classpath, kwargs)


def test_trigger_fires_a_risk_event_once_and_resumes_disarmed(store):
    job_id = make_job(store, work_s=7000)  # 2 h to the deadline, ~1.9 h of work: slack under 600 s
    event = first_event(trigger_for(store, job_id, risk_threshold_s=THRESHOLD))
    assert event.status is CompletenessStatus.RISK
    assert event.risk is not None and event.risk["job_id"] == job_id and event.risk["slack_s"] < THRESHOLD
    assert event.resume is not None and event.resume["risk_armed"] is False
    # the sensor re-defers with the kwargs of the event: that trigger (or a restarted one) is silent
    assert watch(CompletenessTrigger(**event.resume), store) is None


def test_a_disarmed_trigger_re_arms_once_slack_is_back(store):
    job_id = make_job(store, work_s=60)  # plenty of slack
    event = first_event(trigger_for(store, job_id, risk_threshold_s=THRESHOLD, risk_armed=False))
    assert event.status is CompletenessStatus.RISK
    assert event.risk is None and event.resume is not None and event.resume["risk_armed"] is True
    assert watch(CompletenessTrigger(**event.resume), store) is None


class Recording(BaseNotifier):
    """Stands in for Slack/PagerDuty: records the rendered text it would send."""

    template_fields = ("text",)

    def __init__(self, text: str, sent: list[str]) -> None:
        super().__init__()
        self.text = text
        self.sent = sent

    def notify(self, context: Any) -> None:
        self.sent.append(self.text)


def test_the_deferred_sensor_alerts_on_a_risk_event_and_waits_on_with_its_state(store):
    job_id = make_job(store, work_s=7000)
    event = first_event(trigger_for(store, job_id, risk_threshold_s=THRESHOLD))
    sent: list[str] = []
    notifier = DeadlineRiskNotifier(
        notifiers=[Recording("{{ deadline_risk.job_id }} {{ deadline_risk.page_url }}", sent)],
        threshold_s=THRESHOLD,
    )
    sensor = CompletenessSensor(task_id="verify", job_id=job_id, store_url=store.url, risk_notifier=notifier)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute_complete({}, event.to_payload())
    assert (
        len(sent) == 1
        and sent[0].startswith(f"{job_id} ")
        and sent[0].endswith(f"/deadline-batch/jobs/{job_id}")
    )
    assert deferred.value.trigger.serialize()[1] == event.resume
    assert deferred.value.method_name == "execute_complete"
    # a re-arm event alerts nobody and waits on armed
    rearm = CompletenessEvent(
        CompletenessStatus.RISK,
        job_id,
        {},
        "re-armed",
        risk=None,
        resume={**(event.resume or {}), "risk_armed": True},
    )
    with pytest.raises(TaskDeferred) as again:
        sensor.execute_complete({}, rearm.to_payload())
    assert len(sent) == 1 and again.value.trigger.serialize()[1]["risk_armed"] is True


def watch(trigger: CompletenessTrigger, store) -> object:
    """One poll of the trigger, then its risk watch over what the poll read."""
    return trigger._watch_risk(trigger._poll(store))


def test_a_failing_watch_never_ends_the_wait(store):
    job_id = make_job(store, work_s=7000)
    trigger = trigger_for(store, job_id, risk_threshold_s=THRESHOLD)
    # the job view could not be read this poll: no risk event, the trigger polls on
    assert trigger._watch_risk(_Poll({}, None, ())) is None
    assert watch(trigger, store) is not None


def test_a_crash_on_spot_is_a_failure_not_spot_gone():
    """A crash loop on Spot (``abandoned`` tries the launcher classed ``deterministic``) names
    failures as the cause, not Spot gone; the launcher's own kill stays a preemption."""
    pools = [SPOT.to_dict(), OD.to_dict()]
    crashes = [
        Attempt(
            f"c{i}",
            i,
            "spot",
            NOW - dt.timedelta(minutes=10 - i),
            NOW - dt.timedelta(minutes=9 - i),
            AttemptOutcome.ABANDONED,
            "deterministic",
        )
        for i in range(3)
    ]
    view = build_job_view(Job(config={"pools": pools}), [Shard(5000)], [], now=NOW, attempts=crashes)
    assert risk_causes(view, crashes) == ("failures: 3 failed tries on 3 shard(s)",)
    killed = dataclasses.replace(crashes[0], failure_class="preempted")
    assert risk_causes(view, [killed]) == ()
