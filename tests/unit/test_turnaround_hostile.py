"""A hostile review of Airflow's turnaround in the safety rule (session 23).

Each test states a way the turnaround a Spot try's risk counts (``JobSnapshot.turnaround_s``,
``_ShardTryMixin.turnaround_s``) or the try ledger that learns Airflow's latency was wrong, and
fails on the code before its fix (a guard says what held).
Real operators on a real SQLite store; Airflow's task state store is the same dict stand-in
``tests/unit/test_turnaround.py`` uses.
"""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

import pytest

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.failures import (
    BACKOFF_CAP_S,
    MIN_RESUME_DELAY_S,
    SCHEDULER_LATENCY_S,
    FailureClass,
    TryFailure,
    TryLedger,
)
from airflow_deadline_batch.local.runner import LocalRun, RunOptions
from airflow_deadline_batch.operators.placement import read_job_view
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from airflow_deadline_batch.store import ManifestStore
from tests.unit.test_pod_spec import SPOT, T0, make_operator
from tests.unit.test_pod_spec import job_id as job_id  # noqa: F401 - a fixture (4 shards, SQLite)
from tests.unit.test_pod_spec import store_url as store_url  # noqa: F401 - a fixture
from tests.unit.test_turnaround import LATENCY_ENV, RESUME_ENV, _context, _operator

#: the deployment e2e's shard tasks: a retry delay shorter than the resume delay
RETRY_DELAY = dt.timedelta(seconds=1)


@pytest.fixture()
def defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume delay (5 s) and the scheduler latency (60 s) at their defaults."""
    monkeypatch.delenv(LATENCY_ENV, raising=False)
    monkeypatch.delenv(RESUME_ENV, raising=False)


def _fail_transiently(store: ManifestStore, job_id: str, shard_index: int, times: int) -> None:
    for _ in range(times):
        lease = store.claim_shard(job_id, shard_index, ttl_s=60, worker="w", pool=SPOT.name)
        store.fail_attempt(lease, FailureClass.TRANSIENT, "S3 unreachable")


def _backoff_bounds(op: Any) -> tuple[float, float]:
    """The backoff of one transient failure settled by ``op``, in seconds, as bounds: the operator
    reschedules from the wall clock at an instant between ``before`` and ``after``, so the backoff
    is at least ``reschedule − after`` and at most ``reschedule − before`` (however long a loaded
    machine takes between the two)."""
    before = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(Exception) as rescheduled:
        op.settle_failure(FailureClass.TRANSIENT, "S3 unreachable")
    after = dt.datetime.now(dt.timezone.utc)
    reschedule = rescheduled.value.reschedule_date  # type: ignore[attr-defined]
    return (reschedule - after).total_seconds(), (reschedule - before).total_seconds()


@pytest.mark.usefixtures("defaults")
def test_a_transient_backoff_leaves_airflow_its_latency_before_the_next_decision(
    store_url: str, job_id: str
) -> None:
    """A Spot try decided with a turnaround of 5 s (the resume delay) + 60 s (latency) fails
    transiently at its worst moment, 70 s of slack left. Its backoff (up to 30 s after six such
    failures) reschedules it, and Airflow starts it up to 60 s after that: the next decision must
    still find slack >= 0, so the backoff may take only 70 − 60 s. Before the fix it took up to
    min(30 s, the whole slack): the next decision came up to 20 s past on-demand's last chance."""
    store = ManifestStore(store_url)
    _fail_transiently(store, job_id, 1, 6)
    slack_at_t0 = read_job_view(store, job_id, now=T0).slack_s
    left = 70.0
    clock = ManualClock(T0 + dt.timedelta(seconds=slack_at_t0 - left))
    op = make_operator(store_url, job_id, clock, retry_delay=RETRY_DELAY)
    assert op.slack_s() == pytest.approx(left)
    turnaround = op.turnaround_s(None)
    assert turnaround == MIN_RESUME_DELAY_S + SCHEDULER_LATENCY_S <= left  # what the decision allowed

    random.seed(23)  # the backoff's jitter (full jitter over [0, min(30 s, its bound)])
    for _ in range(30):
        shortest, longest = _backoff_bounds(op)
        assert left - shortest - SCHEDULER_LATENCY_S >= -0.5, shortest  # the next decision: slack >= 0
        assert longest >= MIN_RESUME_DELAY_S


@pytest.mark.usefixtures("defaults")
def test_a_transient_backoff_keeps_its_length_where_the_slack_allows(store_url: str, job_id: str) -> None:
    """The bound takes only what the slack cannot spare: with an hour of slack the backoff after
    six transient failures still reaches well past the resume delay."""
    store = ManifestStore(store_url)
    _fail_transiently(store, job_id, 1, 6)
    slack_at_t0 = read_job_view(store, job_id, now=T0).slack_s
    op = make_operator(
        store_url, job_id, ManualClock(T0 + dt.timedelta(seconds=slack_at_t0 - 3600)), retry_delay=RETRY_DELAY
    )
    random.seed(5)
    delays = [_backoff_bounds(op)[0] for _ in range(30)]
    assert max(delays) > 20.0 and max(delays) <= BACKOFF_CAP_S + 0.5


@pytest.mark.usefixtures("defaults")
def test_a_deferred_try_counts_its_triggers_poll_and_its_resume(store_url: str, job_id: str) -> None:
    """A deferred Spot try whose pod is preempted is told so by its trigger (polling every 30 s,
    as the example DAG's), then Airflow resumes the task (a latency), which reschedules it (the
    resume delay) and starts it again (a latency); a racing one may be resumed for a race check
    just as its pod ends (one latency more). Before the fix it counted one resume and one latency."""
    sync = make_operator(store_url, job_id, retry_delay=RETRY_DELAY)
    assert sync.turnaround_s(None) == MIN_RESUME_DELAY_S + SCHEDULER_LATENCY_S
    calm = make_operator(
        store_url, job_id, retry_delay=RETRY_DELAY, deferrable=True, poll_interval=30, race=False
    )
    assert calm.turnaround_s(None) == 30 + SCHEDULER_LATENCY_S + MIN_RESUME_DELAY_S + SCHEDULER_LATENCY_S
    racing = make_operator(store_url, job_id, retry_delay=RETRY_DELAY, deferrable=True, poll_interval=2)
    # the event is held to the resume delay after the deferral, so a fast poll waits that long
    assert racing.turnaround_s(None) == MIN_RESUME_DELAY_S + 3 * SCHEDULER_LATENCY_S + MIN_RESUME_DELAY_S


def test_a_crash_airflow_retries_leaves_its_retry_due() -> None:
    """Airflow retries any exception but those that end the task for good; a try that crashed
    (an ``ApiException``, a ``KeyError``) is retried after the retry delay like one that raised
    ``AirflowException``, so the ledger must time its retry too. Before the fix it left none."""
    context = _context(1, 5, {})

    def crashes() -> None:
        raise KeyError("pod")

    with pytest.raises(KeyError):
        _operator().run_try(context, crashes)
    ledger = TryLedger.from_dict(context["task_state_store"][TRY_LEDGER_KEY])
    assert ledger.ended == {1} and ledger.due_at is not None


def test_a_ledger_with_an_int_too_large_for_a_float_reads_as_nothing() -> None:
    """A task state store value may be anything a person wrote; an integer beyond a float's range
    raised ``OverflowError`` out of ``from_dict``: the ledger went unread, and so unwritten, for
    every later try of the task."""
    huge = 10**400
    assert TryLedger.from_dict({"due_at": huge, "late_s": huge, "started": [1]}) == TryLedger(
        started=frozenset({1})
    )
    context: dict[str, Any] = _context(2, 5, {TRY_LEDGER_KEY: {"due_at": huge, "started": [1], "ended": [1]}})
    _operator().run_try(context, lambda: None)
    assert TryLedger.from_dict(context["task_state_store"][TRY_LEDGER_KEY]).ended == {1, 2}


def test_the_local_runners_backoff_leaves_its_poll_before_the_relaunch(store_url: str, job_id: str) -> None:
    """The local runner relaunches a failed shard at its next poll, the turnaround its decisions
    allow: with less slack than one poll left, a transient failure's backoff must take none of it.
    Before, it took up to min(its bound, the whole slack)."""
    store = ManifestStore(store_url)
    left = 3.0
    slack_at_t0 = read_job_view(store, job_id, now=T0, parallelism=2).slack_s
    clock = ManualClock(T0 + dt.timedelta(seconds=slack_at_t0 - left))
    run = LocalRun(store, job_id, RunOptions(workers=2, poll_interval_s=5.0), clock)
    assert run.slack_s() == pytest.approx(left)
    random.seed(11)
    for _ in range(10):
        run.failures_in_a_row[1] = 3  # a bound of min(30 s, 4 s, the slack) before the poll is taken
        run.settle(1, TryFailure(FailureClass.TRANSIENT, "S3 unreachable", claimed=True), now=100.0)
        assert run.not_before[1] == 100.0  # relaunched at the next poll, no backoff beyond it
