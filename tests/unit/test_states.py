"""State machines of jobs, shards and attempts (docs/design.md §4.4)."""

from __future__ import annotations

import pytest

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.states import (
    ATTEMPT_TRANSITIONS,
    CRASH_FAILURE_CLASSES,
    JOB_TRANSITIONS,
    PREEMPTION_OUTCOMES,
    SHARD_TRANSITIONS,
    TERMINAL_ATTEMPT_OUTCOMES,
    TERMINAL_JOB_STATES,
    TERMINAL_SHARD_STATES,
    UNRUN_ATTEMPT_OUTCOMES,
    AttemptOutcome,
    JobState,
    ShardState,
    check_attempt_transition,
    check_job_transition,
    check_shard_transition,
    is_preemption,
    shard_state_after,
)
from airflow_deadline_batch.exceptions import InvalidTransition, StoreError

J, S, A = JobState, ShardState, AttemptOutcome


def test_values_match_the_design() -> None:
    assert [s.value for s in J] == [
        "submitted",
        "admitted",
        "running",
        "finalizing",
        "completed",
        "partial",
        "failed",
        "cancelled",
        "rejected",
    ]
    assert [s.value for s in S] == ["pending", "leased", "succeeded", "retryable_failure", "terminal_failure"]
    assert {J.COMPLETED, J.PARTIAL, J.FAILED, J.CANCELLED, J.REJECTED} == TERMINAL_JOB_STATES
    assert {S.SUCCEEDED, S.TERMINAL_FAILURE} == TERMINAL_SHARD_STATES
    assert set(A) - {A.RUNNING} == TERMINAL_ATTEMPT_OUTCOMES


def test_tables_are_total_and_terminal_states_have_no_exit() -> None:
    assert set(JOB_TRANSITIONS) == set(J)
    assert set(SHARD_TRANSITIONS) == set(S)
    assert set(ATTEMPT_TRANSITIONS) == set(A)
    for state in TERMINAL_JOB_STATES:
        assert JOB_TRANSITIONS[state] == frozenset()
    for shard_state in TERMINAL_SHARD_STATES:
        assert SHARD_TRANSITIONS[shard_state] == frozenset()


JOB_ALLOWED = [
    (J.SUBMITTED, J.ADMITTED),
    (J.SUBMITTED, J.REJECTED),
    (J.ADMITTED, J.RUNNING),
    (J.RUNNING, J.FINALIZING),
    (J.FINALIZING, J.COMPLETED),
    (J.FINALIZING, J.PARTIAL),
    (J.RUNNING, J.CANCELLED),
    (J.RUNNING, J.FAILED),
    (J.ADMITTED, J.FINALIZING),
]
JOB_FORBIDDEN = [
    (J.COMPLETED, J.RUNNING),
    (J.REJECTED, J.ADMITTED),
    (J.SUBMITTED, J.RUNNING),
    (J.RUNNING, J.ADMITTED),
    (J.RUNNING, J.COMPLETED),
    (J.CANCELLED, J.CANCELLED),
    (J.ADMITTED, J.REJECTED),
    (J.PARTIAL, J.COMPLETED),
]


@pytest.mark.parametrize(("src", "dst"), JOB_ALLOWED)
def test_job_allowed(src: JobState, dst: JobState) -> None:
    check_job_transition(src, dst)
    check_job_transition(src.value, dst.value)


@pytest.mark.parametrize(("src", "dst"), JOB_FORBIDDEN)
def test_job_forbidden(src: JobState, dst: JobState) -> None:
    with pytest.raises(InvalidTransition):
        check_job_transition(src, dst)


def test_job_error_message_names_states_and_job() -> None:
    with pytest.raises(InvalidTransition) as info:
        check_job_transition("completed", "running", job_id="j-abc")
    assert str(info.value) == (
        "job j-abc cannot go from completed to running (allowed from completed: none, it is terminal)"
    )
    assert isinstance(info.value, StoreError)
    assert info.value.source == "completed" and info.value.target == "running"  # type: ignore[attr-defined]


SHARD_ALLOWED = [
    (S.PENDING, S.LEASED),
    (S.LEASED, S.SUCCEEDED),
    (S.LEASED, S.RETRYABLE_FAILURE),
    (S.RETRYABLE_FAILURE, S.LEASED),
    (S.LEASED, S.TERMINAL_FAILURE),
    (S.LEASED, S.LEASED),
    (S.RETRYABLE_FAILURE, S.TERMINAL_FAILURE),
    (S.PENDING, S.TERMINAL_FAILURE),
]
SHARD_FORBIDDEN = [
    (S.SUCCEEDED, S.LEASED),
    (S.PENDING, S.SUCCEEDED),
    (S.TERMINAL_FAILURE, S.LEASED),
    (S.RETRYABLE_FAILURE, S.SUCCEEDED),
    (S.SUCCEEDED, S.SUCCEEDED),
]


@pytest.mark.parametrize(("src", "dst"), SHARD_ALLOWED)
def test_shard_allowed(src: ShardState, dst: ShardState) -> None:
    check_shard_transition(src, dst)


@pytest.mark.parametrize(("src", "dst"), SHARD_FORBIDDEN)
def test_shard_forbidden(src: ShardState, dst: ShardState) -> None:
    with pytest.raises(InvalidTransition, match=f"shard 00003 cannot go from {src.value} to {dst.value}"):
        check_shard_transition(src, dst, shard_id="00003")


def test_unknown_state_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        check_job_transition("running", "exploded")


def test_attempts_only_end_once() -> None:
    for outcome in TERMINAL_ATTEMPT_OUTCOMES:
        check_attempt_transition(A.RUNNING, outcome)
        with pytest.raises(InvalidTransition):
            check_attempt_transition(outcome, A.RUNNING)


def test_only_a_lost_lease_changes_once_ended_and_only_to_stalled() -> None:
    check_attempt_transition(A.LOST_LEASE, A.STALLED)  # its worker reported back alive
    for src in TERMINAL_ATTEMPT_OUTCOMES:
        for dst in set(A) - ({A.STALLED} if src is A.LOST_LEASE else set()):
            with pytest.raises(InvalidTransition):
                check_attempt_transition(src, dst)
    with pytest.raises(InvalidTransition, match="from stalled to lost_lease"):
        check_attempt_transition(A.STALLED, A.LOST_LEASE)


def test_a_preemption_is_capacity_taken_away_and_a_stall_is_not() -> None:
    assert {A.PREEMPTED, A.ABANDONED, A.LOST_LEASE} == PREEMPTION_OUTCOMES
    assert A.STALLED not in PREEMPTION_OUTCOMES and A.LOST_RACE not in PREEMPTION_OUTCOMES
    assert PREEMPTION_OUTCOMES <= TERMINAL_ATTEMPT_OUTCOMES - UNRUN_ATTEMPT_OUTCOMES


@pytest.mark.parametrize("cls", [None, *FailureClass])
@pytest.mark.parametrize("outcome", list(A))
def test_a_preemption_is_a_preemption_outcome_whose_class_is_no_crash(
    outcome: AttemptOutcome, cls: FailureClass | None
) -> None:
    crashed = cls in (FailureClass.DETERMINISTIC, FailureClass.CONFIGURATION)
    expected = outcome in (A.PREEMPTED, A.ABANDONED, A.LOST_LEASE) and not crashed
    value = None if cls is None else cls.value
    assert is_preemption(outcome, value) is expected
    assert is_preemption(outcome.value, value) is expected  # as a SQL row gives it


def test_a_crash_the_launcher_saw_is_no_preemption_and_its_kill_is_one() -> None:
    assert not is_preemption(A.ABANDONED, "deterministic")  # a segfault, the OOM killer
    assert is_preemption(A.ABANDONED, "preempted")  # the launcher sent the kill
    assert is_preemption(A.ABANDONED, None)  # no class recorded: as before, a preemption
    assert is_preemption(A.LOST_LEASE, None) and not is_preemption(A.STALLED, "preempted")
    assert {FailureClass(c) for c in CRASH_FAILURE_CLASSES} == {
        FailureClass.DETERMINISTIC,
        FailureClass.CONFIGURATION,
    }


def test_shard_state_after_attempt() -> None:
    assert shard_state_after(A.SUCCEEDED) is S.SUCCEEDED
    assert shard_state_after("preempted") is S.RETRYABLE_FAILURE
    assert shard_state_after(A.LOST_LEASE) is S.RETRYABLE_FAILURE
    assert shard_state_after("stalled") is S.RETRYABLE_FAILURE  # retryable for the job's progress
    assert shard_state_after(A.FAILED_TERMINAL) is S.TERMINAL_FAILURE
    # the loser of a tail race leaves the shard leased by the winner
    assert shard_state_after("lost_race") is S.LEASED
    for outcome in TERMINAL_ATTEMPT_OUTCOMES:
        check_shard_transition(S.LEASED, shard_state_after(outcome))
    with pytest.raises(ValueError, match="not terminal"):
        shard_state_after(A.RUNNING)
