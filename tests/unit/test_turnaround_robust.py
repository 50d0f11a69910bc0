"""Airflow's latency, learned robustly by the try ledger (session 24).

The ledger used to keep the worst lateness it ever saw: one start that came late for a reason that
was not the scheduler's (a paused DAG, a task marked failed and cleared an hour later, a one-off
stall) taught up to an hour of turnaround to every later try of the task instance, and so took Spot
from every later decision of its shard. It now keeps the last ``LATE_SAMPLES`` latenesses and
counts the larger of the latest and the second largest (``TryLedger.late_s``), and does not count
a start that followed a clear of the task instance (its ``max_tries`` changed: Airflow's clear is
the only thing that changes it).

Each test fails on the ledger that kept the worst so far. Real operators; Airflow's task state
store is the dict stand-in ``tests/unit/test_turnaround.py`` uses.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowRescheduleException
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.failures import LATE_SAMPLES, MAX_LATE_S, TryLedger
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY
from tests.unit.test_turnaround import LATENCY_ENV, RESUME_ENV, _context, _operator

#: latenesses as two clocks may make them: early (negative), late, far beyond the cap (quarters of a
#: second, which the due time plus the lateness keeps exactly)
LATENESS = st.integers(min_value=-4_000_000, max_value=40_000_000).map(lambda n: n / 4)


def _learn(latenesses: list[float], ledger: TryLedger | None = None) -> TryLedger:
    """The ledger after runs that each started ``lateness`` seconds after the time it was due."""
    ledger = ledger or TryLedger()
    for n, late in enumerate(latenesses):
        due = 1_800_000_000.0 + 10_000.0 * n
        ledger = ledger.due(due).arrived(due + late)
    return ledger


def _capped(late: float) -> float:
    return min(max(late, 0.0), MAX_LATE_S)


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(LATENESS, max_size=12),
    outlier=LATENESS,
    after=st.lists(LATENESS, min_size=1, max_size=12),
)
def test_one_outlier_counts_only_until_the_next_start(
    before: list[float], outlier: float, after: list[float]
) -> None:
    """Whatever one start's lateness (a paused DAG, a stall), once another start followed it the
    estimate is no more than the other starts' worst: before, it stayed the worst for ever."""
    ledger = _learn([*before, outlier, *after])
    assert ledger.late_s <= max(_capped(late) for late in [*before, *after])


@settings(max_examples=300, deadline=None)
@given(latenesses=st.lists(LATENESS, min_size=1, max_size=30), slow=st.floats(0, MAX_LATE_S))
def test_a_scheduler_slow_now_or_twice_lately_is_counted(latenesses: list[float], slow: float) -> None:
    """Safety kept against a scheduler that really is slow: the latest start always counts (a
    scheduler slow now is likely slow at the next start), and a lateness seen at two of the last
    ``LATE_SAMPLES`` starts counts however fast the others were. Never outside [0, an hour]."""
    ledger = _learn(latenesses)
    assert 0.0 <= ledger.late_s <= MAX_LATE_S
    assert ledger.late_s >= _capped(latenesses[-1])
    window = [_capped(late) for late in latenesses[-LATE_SAMPLES:]]
    if sum(late >= slow for late in window) >= 2:
        assert ledger.late_s >= slow
    assert TryLedger.from_dict(ledger.to_dict()) == ledger


def test_a_slow_scheduler_is_not_forgotten_after_one_fast_start() -> None:
    slow = _learn([400.0, 5.0, 420.0])
    assert slow.late_s == 420.0
    assert _learn([0.0], slow).late_s == 400.0  # two slow starts in the window: still counted
    assert _learn([0.0] * (LATE_SAMPLES - 2), slow).late_s == 5.0  # 400 left: 420 alone is an outlier
    assert _learn([3600.0, 2.0]).late_s == 2.0  # one hour-long outlier: gone after the next start


def test_an_earlier_versions_ledger_reads_as_one_sample_and_is_written_readable_by_it() -> None:
    """An earlier version stored its worst lateness in ``late_s`` and reads only that back: its
    worst is one sample here, and ``late_s`` is written as the estimate, which it reads as its worst."""
    older = {"started": [1], "ended": [], "handed_back": [1], "lost": [], "due_at": None, "late_s": 900.0}
    ledger = TryLedger.from_dict(older)
    assert ledger.late == (900.0,) and ledger.late_s == 900.0
    once_more = _learn([1.0], ledger)
    assert once_more.late_s == 1.0  # the old worst is an outlier like any other
    stored = once_more.to_dict()
    assert stored["late_s"] == 1.0 and stored["late"] == [900.0, 1.0]
    assert TryLedger.from_dict({**stored, "late": ["x", float("nan"), -3, 10**400, 7200]}).late == (
        0.0,
        MAX_LATE_S,
    )
    assert TryLedger.from_dict({"late": list(range(1, 20))}).late == tuple(
        float(n) for n in range(19 - LATE_SAMPLES + 1, 20)
    )


def test_a_paused_dags_late_start_costs_the_run_that_saw_it_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard task rescheduled while its DAG was paused starts an hour after it was due: that run
    decides with an hour of latency (the scheduler might be that slow now), and after the next
    start, on time, the configured latency is back. Before, the hour stayed for every later try."""
    monkeypatch.setenv(LATENCY_ENV, "10")
    monkeypatch.setenv(RESUME_ENV, "5")
    context = _context(2, 5, {})
    op = _operator()

    seen: list[float] = []

    def decides_and_reschedules(ago: dt.timedelta) -> None:
        seen.append(op.latency_s())
        raise AirflowRescheduleException(dt.datetime.now(dt.timezone.utc) - ago)

    with pytest.raises(AirflowRescheduleException):  # due two hours ago, while the DAG was paused
        op.run_try(context, lambda: decides_and_reschedules(dt.timedelta(hours=2)))
    with pytest.raises(AirflowRescheduleException):  # unpaused: this run decides, then reschedules
        op.run_try(context, lambda: decides_and_reschedules(dt.timedelta(0)))
    assert seen == [10.0, MAX_LATE_S]
    seen.clear()
    op.run_try(context, lambda: seen.append(op.latency_s()))  # started at once, as due
    assert seen == [10.0]
    assert op.turnaround_s(context) == 30.0 + 10.0  # its retry delay and the configured latency


def _failed_try(context: dict[str, Any]) -> TryLedger:
    def fails() -> None:
        raise AirflowException("deterministic")

    with pytest.raises(AirflowException):
        _operator().run_try(context, fails)
    return TryLedger.from_dict(context["task_state_store"][TRY_LEDGER_KEY])


def test_a_start_after_a_clear_is_not_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """Try 1 fails and its retry is due in 30 s; someone marks the task failed and clears it an hour
    later. Airflow's clear sets ``max_tries`` to the try number plus the retries (1 + 5), and try 2
    starts an hour after try 1's retry was due: the clear's doing, not the scheduler's. The same
    start without the clear (``max_tries`` still 5) is an hour late and counts for its run."""
    first = _failed_try(_context(1, 5, {}))
    assert first.due_at is not None
    an_hour_ago = TryLedger.from_dict({**first.to_dict(), "due_at": first.due_at - 3600.0})

    cleared = _context(2, 1 + 5, {TRY_LEDGER_KEY: an_hour_ago.to_dict()})
    op = _operator()
    op.run_try(cleared, lambda: None)
    ledger = TryLedger.from_dict(cleared["task_state_store"][TRY_LEDGER_KEY])
    assert ledger.late_s == 0.0 and ledger.ended == {1, 2} and first.due_max_tries == 5
    assert "try 2 started after the task was cleared" in capsys.readouterr().out

    retried = _context(2, 5, {TRY_LEDGER_KEY: an_hour_ago.to_dict()})
    op.run_try(retried, lambda: None)
    assert TryLedger.from_dict(retried["task_state_store"][TRY_LEDGER_KEY]).late_s >= 3600.0 - 30.0


def test_a_ledger_without_max_tries_still_learns() -> None:
    """A due time written by an earlier version (no ``due_max_tries``), or a context without
    ``max_tries``, cannot tell a clear: the start counts as it did."""
    due = time.time() - 100.0
    assert TryLedger(due_at=due).arrived(due + 100.0, max_tries=7).late == (100.0,)
    assert TryLedger(due_at=due, due_max_tries=5).arrived(due + 100.0).late == (100.0,)
    assert TryLedger(due_at=due, due_max_tries=5).arrived(due + 100.0, max_tries=5).late == (100.0,)
    assert TryLedger(due_at=due, due_max_tries=5).arrived(due + 100.0, max_tries=8).late == ()
    assert TryLedger.from_dict({"due_at": due, "due_max_tries": True}).due_max_tries is None
    assert TryLedger.from_dict({"due_at": None, "due_max_tries": 5}).due_max_tries is None
