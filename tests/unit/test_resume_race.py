"""The resume race (docs/airflow.md, *Resuming tasks*): the configurable resume delay, the try
ledger that finds tries Airflow ended without the shard operator, and the last try that keeps its
worker slot so that the store's budget, not Airflow's retries, decides."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowRescheduleException,
    TaskDeferralError,
)

from airflow_deadline_batch.core.failures import (
    MIN_RESUME_DELAY_S,
    FailureClass,
    TryLedger,
    parse_resume_delay,
)
from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.operators.shard import (
    TRY_LEDGER_KEY,
    DeadlineShardPodOperator,
    LocalShardOperator,
)
from airflow_deadline_batch.triggers.pod import ShardPodTrigger, min_resume_delay_s, resume_hold_s

ENV = "AIRFLOW__DEADLINE_BATCH__MIN_RESUME_DELAY_S"


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, MIN_RESUME_DELAY_S), ("", MIN_RESUME_DELAY_S), (" 30 ", 30.0), ("0", 0.0)]
)
def test_the_resume_delay_option_reads_seconds(value: str | None, seconds: float) -> None:
    assert parse_resume_delay(value) == seconds


@pytest.mark.parametrize("value", ["-1", "five", "nan", "inf", "5s"])
def test_a_bad_resume_delay_names_the_option_to_fix(value: str) -> None:
    with pytest.raises(ConfigurationError) as bad:
        parse_resume_delay(value)
    message = str(bad.value)
    assert "[deadline_batch] min_resume_delay_s" in message and ENV in message and repr(value) in message
    assert "\n" not in message


def test_the_resume_delay_comes_from_airflows_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert min_resume_delay_s() == MIN_RESUME_DELAY_S
    monkeypatch.setenv(ENV, "42")
    assert min_resume_delay_s() == 42.0


def _operator(**kw: Any) -> LocalShardOperator:
    op = LocalShardOperator(task_id="shard", job_id="j-x", shard_index=0, store_url="sqlite://", **kw)
    op.transient_in_a_row = lambda: 1  # type: ignore[method-assign]
    op.budget_spent = lambda: 1  # type: ignore[method-assign]
    op.slack_s = lambda: 0.0  # type: ignore[method-assign]  # no slack: no backoff beyond the delay
    return op


def test_a_reschedule_waits_the_configured_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "40")
    before = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(AirflowRescheduleException) as rescheduled:
        _operator().settle_failure(FailureClass.PREEMPTED, "SIGTERM")
    assert rescheduled.value.reschedule_date >= before + dt.timedelta(seconds=40)


def test_a_bad_resume_delay_fails_the_task_without_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "-3")
    with pytest.raises(AirflowFailException, match="min_resume_delay_s must be a number of seconds >= 0"):
        _operator().settle_failure(FailureClass.PREEMPTED, "SIGTERM")


def test_the_pod_triggers_hold_is_capped_at_the_delay_the_task_deferred_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = 1_800_000_000.0
    assert resume_hold_s(now + 86_400.0, now, cap_s=30.0) == 30.0
    pod: dict[str, Any] = {
        "pod_name": "p",
        "pod_namespace": "n",
        "trigger_start_time": dt.datetime.now(dt.timezone.utc),
    }
    trigger = ShardPodTrigger(**pod, base_container_name="base", resume_after=now, resume_delay_s=30.0)
    monkeypatch.setenv(ENV, "7")
    assert trigger.hold_cap_s() == 30.0  # the task's, not the triggerer's
    older = ShardPodTrigger(**pod, base_container_name="base", resume_after=now)  # serialized without it
    assert older.hold_cap_s() == 7.0
    monkeypatch.setenv(ENV, "soon")
    assert older.hold_cap_s() == MIN_RESUME_DELAY_S  # a trigger never raises: the default holds


def test_the_ledger_finds_tries_nobody_here_ended() -> None:
    ledger = TryLedger(started=frozenset({1, 2, 3}), ended=frozenset({1}), handed_back=frozenset({2}))
    assert ledger.newly_lost(4) == (2, 3)
    assert ledger.resume_races((2, 3)) == (2,)  # try 3 never handed its slot back: not the race
    assert ledger.with_(lost=[2, 3]).newly_lost(4) == ()  # each lost try is found once
    assert TryLedger.from_dict(ledger.to_dict()) == ledger
    assert ledger.to_dict() == {
        "started": [1, 2, 3],
        "ended": [1],
        "handed_back": [2],
        "lost": [],
        "due_at": None,
        "late_s": 0.0,
    }
    assert TryLedger.from_dict(None) == TryLedger() == TryLedger.from_dict({"ended": "x"})


class TaskStateStore(dict[str, Any]):
    """``context["task_state_store"]``'s get and set, over a dict (Airflow keeps it in its database)."""

    def set(self, key: str, value: Any, **_: Any) -> None:
        self[key] = value


def _context(try_number: int, max_tries: int, state: TaskStateStore) -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="d", try_number=try_number, max_tries=max_tries, xcom_push=lambda **_: None)
    return {"ti": ti, "task_state_store": state}


def test_a_try_logs_the_earlier_tries_airflow_ended(capsys: pytest.CaptureFixture[str]) -> None:
    state = TaskStateStore({TRY_LEDGER_KEY: {"started": [1, 2], "ended": [1], "handed_back": [2]}})
    assert _operator().run_try(_context(3, 5, state), lambda: "done") == "done"
    assert state[TRY_LEDGER_KEY] == {
        "started": [1, 2, 3],
        "ended": [1, 3],
        "handed_back": [2],
        "lost": [2],
        "due_at": None,  # a success: no run follows
        "late_s": 0.0,  # a lost try's due time is not this try's
    }
    assert (
        "try 2 was ended by Airflow, not by this operator (failed after it resumed" in capsys.readouterr().out
    )


def test_a_try_that_is_not_the_last_hands_its_slot_back() -> None:
    state, runs = TaskStateStore(), []

    def preempted() -> None:
        runs.append(1)
        _operator().settle_failure(FailureClass.PREEMPTED, "SIGTERM")

    with pytest.raises(AirflowRescheduleException):
        _operator().run_try(_context(1, 5, state), preempted)
    assert len(runs) == 1 and state[TRY_LEDGER_KEY]["handed_back"] == [1]
    assert state[TRY_LEDGER_KEY]["ended"] == []


def test_airflows_last_try_runs_again_in_its_slot_until_the_shard_is_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "0")
    op, state = _operator(), TaskStateStore()
    outcomes = iter([FailureClass.PREEMPTED, FailureClass.TRANSIENT, FailureClass.DETERMINISTIC, None])
    op.store_counted_run = lambda: True  # type: ignore[method-assign]  # each failure spent budget

    def run() -> str:
        failure = next(outcomes)
        if failure is not None:
            op.settle_failure(failure, "again")
        return "committed"

    assert op.run_try(_context(6, 5, state), run) == "committed"
    assert state[TRY_LEDGER_KEY]["handed_back"] == [] and state[TRY_LEDGER_KEY]["ended"] == [6]


def test_on_the_last_try_a_failure_the_store_never_saw_still_fails_the_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "0")
    op, state = _operator(), TaskStateStore()
    op.store_counted_run = lambda: False  # type: ignore[method-assign]  # no claim, no budget spent
    with pytest.raises(AirflowException) as failed:
        op.run_try(_context(6, 5, state), lambda: op.settle_failure(FailureClass.DETERMINISTIC, "no claim"))
    assert not isinstance(failed.value, AirflowRescheduleException)
    with pytest.raises(AirflowFailException):  # the store's budget is spent: no retry at all
        op.run_try(
            _context(6, 5, state),
            lambda: op.settle_failure(FailureClass.DETERMINISTIC, "x", shard_failed=True),
        )


def test_a_kill_ends_the_last_tries_wait_and_is_not_recorded_as_the_operators_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "3600")
    op, state = _operator(), TaskStateStore()

    def preempted_then_killed() -> None:
        op.on_kill()  # Airflow ends the try while it waits an hour in its slot
        op.settle_failure(FailureClass.PREEMPTED, "SIGTERM")

    with pytest.raises(AirflowException, match="killed while it waited"):
        op.run_try(_context(6, 5, state), preempted_then_killed)
    assert state[TRY_LEDGER_KEY]["ended"] == []  # the next try finds it lost


def test_without_a_task_state_store_the_try_runs_as_before() -> None:
    ti = SimpleNamespace(try_number=1, xcom_push=lambda **_: None)  # no max_tries: never holds its slot
    with pytest.raises(AirflowRescheduleException):
        _operator().run_try({"ti": ti}, lambda: _operator().settle_failure(FailureClass.PREEMPTED, "x"))


def test_a_resumed_deferred_try_keeps_the_ledger_too() -> None:
    # Airflow's task runner resumes a deferred try through resume_execution; a trigger failure ends it
    op = DeadlineShardPodOperator(task_id="shard", job_id="j-x", shard_index=0, image="w", deferrable=True)
    state = TaskStateStore({TRY_LEDGER_KEY: {"started": [1, 2], "ended": [1], "handed_back": [2]}})
    with pytest.raises(TaskDeferralError):
        op.resume_execution(TRIGGER_FAIL_REPR, {"error": "the triggerer lost the pod"}, _context(2, 5, state))
    assert state[TRY_LEDGER_KEY]["ended"] == [1, 2] and state[TRY_LEDGER_KEY]["lost"] == []
