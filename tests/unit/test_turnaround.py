"""Airflow's turnaround between shard tries in the safety rule (issue 13, the production path).

An operator decides once per try. When a Spot try fails at its worst moment (preempted just before
its commit, or its pod still unscheduled at the last safe Spot start), the next try decides only
after Airflow has started the task again: the resume or retry delay, then the scheduler's and
executor's latency. Nothing commits meanwhile, so that time burns slack like the try itself; a
rule that left it out could let the last safe Spot try end where on-demand no longer meets the
deadline. ``JobSnapshot.turnaround_s`` carries it into :func:`core.placement.spot_risk_s`; the
shard operators compute it (:meth:`_ShardTryMixin.turnaround_s`) and learn Airflow's real latency
from their try ledger.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_deadline_batch.core.clock import ManualClock
from airflow_deadline_batch.core.failures import (
    MAX_LATE_S,
    MIN_RESUME_DELAY_S,
    SCHEDULER_LATENCY_S,
    TryLedger,
    retry_delay_bound_s,
)
from airflow_deadline_batch.core.placement import (
    JobSnapshot,
    PolicyParams,
    choose_pool,
    od_need_s,
    spot_risk_s,
)
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.operators.placement import decide_for_try, read_job_view
from airflow_deadline_batch.operators.shard import TRY_LEDGER_KEY, LocalShardOperator
from airflow_deadline_batch.store import ManifestStore
from tests.unit.test_pod_spec import T0, make_operator
from tests.unit.test_pod_spec import job_id as job_id  # noqa: F401 - a fixture (4 shards, SQLite)
from tests.unit.test_pod_spec import store_url as store_url  # noqa: F401 - a fixture

LATENCY_ENV = "AIRFLOW__DEADLINE_BATCH__SCHEDULER_LATENCY_S"
RESUME_ENV = "AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S"


def snapshot(**kw: Any) -> JobSnapshot:
    base: dict[str, Any] = {
        "now": T0,
        "deadline": T0 + dt.timedelta(hours=4),
        "remaining_work_s": 6 * 3600.0,
        "shard_work_s": 1800.0,
        "parallelism": 2,
        "changeover_s": 300.0,
    }
    return JobSnapshot(**{**base, **kw})


def test_a_spot_tries_risk_includes_the_turnaround_only_when_decided_once_per_try() -> None:
    bare = spot_risk_s(snapshot())
    assert bare == 300.0 + 1800.0
    assert spot_risk_s(snapshot(turnaround_s=90.0)) == bare + 90.0
    ticked = PolicyParams(decision_interval_s=600.0)  # the simulator re-decides on its own clock
    assert spot_risk_s(snapshot(turnaround_s=90.0), ticked) == spot_risk_s(snapshot(), ticked)
    with pytest.raises(ValueError, match="turnaround_s"):
        snapshot(turnaround_s=math.inf)


def test_the_last_safe_spot_start_comes_a_turnaround_earlier() -> None:
    without = choose_pool(snapshot())
    with_turnaround = choose_pool(snapshot(turnaround_s=240.0))
    assert without.pool is with_turnaround.pool is PoolKind.SPOT
    assert without.last_safe_spot_start is not None and with_turnaround.last_safe_spot_start is not None
    assert without.last_safe_spot_start - with_turnaround.last_safe_spot_start == dt.timedelta(seconds=240)


@st.composite
def one_decision_snapshots(draw: st.DrawFn) -> JobSnapshot:
    changeover = draw(st.floats(0, 1800))
    shard = draw(st.floats(1, 7200))
    parallelism = draw(st.integers(1, 8))
    remaining = shard * draw(st.integers(1, 40))
    running = draw(st.booleans())
    previous = draw(st.sampled_from([None, PoolKind.SPOT, PoolKind.ON_DEMAND]))
    deadline_s = draw(st.floats(0, 48 * 3600))
    return snapshot(
        deadline=T0 + dt.timedelta(seconds=deadline_s),
        remaining_work_s=remaining,
        shard_work_s=shard,
        parallelism=parallelism,
        changeover_s=changeover,
        notice_s=draw(st.floats(0, 300)),
        running=running and previous is not None,
        previous_pool=previous,
        changeover_left_s=draw(st.none() | st.floats(0, changeover)),
        spot_available=draw(st.booleans()),
        turnaround_s=draw(st.floats(0, 1800)),
    )


@settings(max_examples=400, deadline=None)
@given(snap=one_decision_snapshots())
def test_a_spot_decision_leaves_on_demand_on_time_after_its_worst_end_and_the_turnaround(
    snap: JobSnapshot,
) -> None:
    """Whatever else it weighs, a Spot decision taken once per try leaves room for its worst case:
    its pod waits to its startup timeout, then runs its changeover and its shard and is preempted
    just before committing, then Airflow takes the turnaround to start the next try, which goes
    on-demand with the same work left and still meets the deadline."""
    decision = choose_pool(snap)
    if decision.pool is not PoolKind.SPOT:
        return
    continuing = snap.running and snap.previous_pool is PoolKind.SPOT
    changeover = snap.changeover_s
    if continuing and snap.changeover_left_s is not None:
        changeover = snap.changeover_left_s
    worst_try = changeover + max(0.0, snap.shard_work_s - snap.notice_s)
    wait = 0.0 if continuing else decision.startup_timeout_s
    finish = snap.now + dt.timedelta(seconds=wait + worst_try + snap.turnaround_s + od_need_s(snap))
    assert finish <= snap.deadline + dt.timedelta(milliseconds=1), decision.reason


def test_retry_delay_bound_is_airflows_longest_wait() -> None:
    """Against Airflow's own scheduler code (``TaskInstance.next_retry_datetime``, run unbound on
    a stand-in of its task instance): never shorter, and reached for some task instance."""
    from airflow.models.taskinstance import TaskInstance

    end = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc)
    for delay_s, multiplier, longest, try_number in [
        (300, 0, None, 1),
        (30, 2.0, None, 3),
        (30, 2.0, dt.timedelta(seconds=100), 4),
        (0, 2.0, None, 1),
        (45, 1.5, None, 6),
    ]:
        task = SimpleNamespace(
            retry_delay=dt.timedelta(seconds=delay_s),
            retry_exponential_backoff=multiplier,
            max_retry_delay=longest,
        )
        bound = retry_delay_bound_s(
            delay_s,
            try_number,
            exponential_backoff=multiplier,
            max_retry_delay_s=longest.total_seconds() if longest else None,
        )
        waits = set()
        for run in range(200):
            ti = SimpleNamespace(
                retry_delay_override=None,
                end_date=end,
                task=task,
                try_number=try_number,
                dag_id="d",
                task_id=f"t{run}",
                logical_date=end,
            )
            waits.add((TaskInstance.next_retry_datetime(ti) - end).total_seconds())
        assert max(waits) <= bound, (delay_s, multiplier, try_number)
        assert max(waits) >= bound - 2, (sorted(waits)[-3:], bound)  # reached, to the hash's luck


def _context(try_number: int, max_tries: int, state: dict[str, Any]) -> dict[str, Any]:
    class TaskStateStore(dict[str, Any]):
        def set(self, key: str, value: Any, **_: Any) -> None:
            self[key] = value

    store = TaskStateStore(state)
    ti = SimpleNamespace(dag_id="d", try_number=try_number, max_tries=max_tries, xcom_push=lambda **_: None)
    return {"ti": ti, "task_state_store": store}


def _operator(**kw: Any) -> LocalShardOperator:
    return LocalShardOperator(
        task_id="shard",
        job_id="j-x",
        shard_index=0,
        store_url="sqlite://",
        retry_delay=dt.timedelta(seconds=30),
        **kw,
    )


def test_the_turnaround_is_the_longer_delay_plus_the_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LATENCY_ENV, raising=False)
    monkeypatch.delenv(RESUME_ENV, raising=False)
    assert _operator().turnaround_s(_context(1, 5, {})) == 30.0 + SCHEDULER_LATENCY_S
    backoff = _operator(retry_exponential_backoff=2.0)
    assert backoff.turnaround_s(_context(3, 5, {})) == (2 * 120 - 1) + SCHEDULER_LATENCY_S
    monkeypatch.setenv(LATENCY_ENV, "10")
    monkeypatch.setenv(RESUME_ENV, "45")
    assert _operator().turnaround_s(_context(1, 5, {})) == 45.0 + 10.0
    monkeypatch.setenv(LATENCY_ENV, "soon")
    with pytest.raises(AirflowFailException, match=r"\[deadline_batch\] scheduler_latency_s must be"):
        _operator().turnaround_s(_context(1, 5, {}))
    monkeypatch.setenv(LATENCY_ENV, "1e12")
    with pytest.raises(AirflowFailException, match="AIRFLOW__DEADLINE_BATCH__SCHEDULER_LATENCY_S"):
        _operator().turnaround_s(_context(1, 5, {}))


def test_airflows_last_try_turns_around_in_its_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESUME_ENV, raising=False)
    op = _operator()
    seen: list[float] = []
    op.run_try(_context(6, 5, {}), lambda: seen.append(op.turnaround_s(None)))
    assert seen == [MIN_RESUME_DELAY_S]  # waits the resume delay in its slot: no retry, no scheduler


def test_the_ledger_learns_how_late_airflow_started_a_rescheduled_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LATENCY_ENV, "10")
    context = _context(2, 5, {})
    op = _operator()
    asked = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=400)  # due long ago: 400 s late

    def rescheduled() -> None:
        raise AirflowRescheduleException(asked)

    with pytest.raises(AirflowRescheduleException):
        op.run_try(context, rescheduled)
    ledger = TryLedger.from_dict(context["task_state_store"][TRY_LEDGER_KEY])
    assert ledger.due_at == asked.timestamp() and ledger.late_s == 0.0
    before = time.time()
    op.run_try(context, lambda: None)  # Airflow resumes the try: it started ~400 s after it was due
    ledger = TryLedger.from_dict(context["task_state_store"][TRY_LEDGER_KEY])
    assert ledger.due_at is None  # a success: no run follows
    assert before - asked.timestamp() <= ledger.late_s <= time.time() - asked.timestamp()
    assert op.turnaround_s(context) == 30.0 + ledger.late_s  # learned beyond the configured 10 s


def test_a_failed_try_leaves_its_retry_due_and_a_lost_one_is_not_counted_late() -> None:
    context = _context(1, 5, {})
    op = _operator()

    def fails() -> None:
        from airflow.sdk.exceptions import AirflowException

        raise AirflowException("deterministic")

    before = time.time()
    with pytest.raises(Exception, match="deterministic"):
        op.run_try(context, fails)
    ledger = TryLedger.from_dict(context["task_state_store"][TRY_LEDGER_KEY])
    assert ledger.due_at is not None and before + 30.0 <= ledger.due_at <= time.time() + 30.0
    # try 2 was rescheduled, then lost (the resume race): try 3 starts an hour after try 2 was due,
    # which is the retry's delay, not Airflow's latency
    lost = dataclasses.replace(ledger.with_(started=[2], handed_back=[2]), due_at=time.time() - 3600)
    third = _context(3, 5, {TRY_LEDGER_KEY: lost.to_dict()})
    op.run_try(third, lambda: None)
    ledger = TryLedger.from_dict(third["task_state_store"][TRY_LEDGER_KEY])
    assert ledger.lost == {2} and ledger.ended == {1, 3}
    assert ledger.late_s == 0.0


def test_the_pod_operator_decides_with_its_turnaround(store_url: str, job_id: str) -> None:
    """4 shards of 600 s on 2 workers, 120 s changeovers, a 120 s Spot notice: a Spot try risks
    600 s, and the operator adds 300 s of retry delay and 60 s of latency. With 800 s of slack a
    Spot try would still be safe without the turnaround and is not with it."""
    store = ManifestStore(store_url)
    clock = ManualClock(T0 + dt.timedelta(seconds=7200 - 1620 - 800))
    op = make_operator(store_url, job_id, clock, retry_delay=dt.timedelta(seconds=300))
    view = read_job_view(store, job_id, now=clock.now(), pools=op.pools)
    assert view.slack_s == pytest.approx(800.0)
    bare = decide_for_try(view, store.get_shard(job_id, 1))
    assert bare.pool is not None and bare.pool.kind is PoolKind.SPOT
    decision = op.decide(None)
    assert op._turnaround_s == 300.0 + SCHEDULER_LATENCY_S
    assert decision.pool is not None and decision.pool.kind is PoolKind.ON_DEMAND, decision.reason


def test_the_ledger_learns_no_more_than_an_hour_and_reads_garbage_as_nothing() -> None:
    """The due time and the start may come from two machines' clocks; a task state store value may
    be anything an earlier version or a person wrote."""
    assert TryLedger(due_at=0.0).arrived(1e9).late_s == MAX_LATE_S  # a clock years off
    assert TryLedger(due_at=100.0, late=(40.0,)).arrived(90.0).late == (40.0, 0.0)  # early: on time
    assert TryLedger(due_at=100.0, late=(40.0,)).arrived(190.0) == TryLedger(late=(40.0, 90.0))
    assert TryLedger.from_dict({"due_at": "soon", "late_s": float("nan")}) == TryLedger()
    assert TryLedger.from_dict({"due_at": True, "late_s": -5}) == TryLedger()
    assert TryLedger.from_dict({"late_s": 1e12}).late_s == MAX_LATE_S
    assert TryLedger.from_dict({"started": [1], "ended": [1]}) == TryLedger(
        started=frozenset({1}), ended=frozenset({1})
    )
