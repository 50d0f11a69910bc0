"""Job, shard and attempt states and the transitions allowed between them (docs/design.md §4.4).

The store checks every state change against these tables, so an impossible transition (a
completed job running again, a succeeded shard leased again) fails loudly instead of corrupting
the manifest.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.exceptions import InvalidTransition

__all__ = [
    "ATTEMPT_TRANSITIONS",
    "CRASH_FAILURE_CLASSES",
    "JOB_TRANSITIONS",
    "PREEMPTION_OUTCOMES",
    "REDONE_WORK_OUTCOMES",
    "SHARD_TRANSITIONS",
    "TERMINAL_ATTEMPT_OUTCOMES",
    "TERMINAL_JOB_STATES",
    "TERMINAL_SHARD_STATES",
    "UNRUN_ATTEMPT_OUTCOMES",
    "AttemptOutcome",
    "JobState",
    "ShardState",
    "check_attempt_transition",
    "check_job_transition",
    "check_shard_transition",
    "is_preemption",
    "shard_state_after",
]


class JobState(str, enum.Enum):
    """Lifecycle of a job: submitted → admitted → running → finalizing → a terminal state."""

    SUBMITTED = "submitted"
    ADMITTED = "admitted"
    RUNNING = "running"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


class ShardState(str, enum.Enum):
    """Lifecycle of a shard; ``retryable_failure`` shards are leased again by a later attempt."""

    PENDING = "pending"
    LEASED = "leased"
    SUCCEEDED = "succeeded"
    RETRYABLE_FAILURE = "retryable_failure"
    TERMINAL_FAILURE = "terminal_failure"


class AttemptOutcome(str, enum.Enum):
    """How one attempt at a shard ended (``running`` while it holds the lease)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"
    LOST_LEASE = "lost_lease"
    FAILED_RETRYABLE = "failed_retryable"
    FAILED_TERMINAL = "failed_terminal"
    ABANDONED = "abandoned"
    #: one of two racing attempts (the tail race) whose commit the other beat; the winner goes on
    LOST_RACE = "lost_race"
    #: its worker was alive when it found its lease gone, and said so: it stalled past its TTL
    #: (SIGSTOP, a GC pause, a network partition, an overloaded node) while another claim took the
    #: shard, or its job was stopped under it. A retryable end, but not a preemption: the pool did
    #: not take the capacity away. Written by the worker itself, over ``lost_lease`` when the store
    #: had already ended the attempt (the one change of an ended attempt, :data:`ATTEMPT_TRANSITIONS`)
    STALLED = "stalled"
    #: the time a Spot try's pod waited unschedulable for capacity, from its creation (``started_at``)
    #: until the try gave up at its startup timeout (a failed try, failure class ``transient``) or
    #: until the pod was scheduled at last (no failure class; the worker's own attempt follows).
    #: No lease, no worker, no GPU time: the pool's availability evidence
    #: (``store.pool_stats.record_unschedulable``)
    UNSCHEDULABLE = "unschedulable"


TERMINAL_JOB_STATES: frozenset[JobState] = frozenset(
    {JobState.COMPLETED, JobState.PARTIAL, JobState.FAILED, JobState.CANCELLED, JobState.REJECTED}
)
TERMINAL_SHARD_STATES: frozenset[ShardState] = frozenset({ShardState.SUCCEEDED, ShardState.TERMINAL_FAILURE})
TERMINAL_ATTEMPT_OUTCOMES: frozenset[AttemptOutcome] = frozenset(
    set(AttemptOutcome) - {AttemptOutcome.RUNNING}
)
#: attempts no worker ran: their time is no GPU time, no cost and no Spot exposure
UNRUN_ATTEMPT_OUTCOMES: frozenset[AttemptOutcome] = frozenset({AttemptOutcome.UNSCHEDULABLE})
#: The outcomes of a try that may have been preempted: its capacity was taken away, or its worker
#: died with it. :func:`is_preemption` is the one definition of a preemption (docs/design.md §4.4):
#: one of these outcomes, unless the try's recorded class says it crashed. ``lost_lease`` is
#: ambiguous (the lease expired and another claim took the shard; the worker may be dead or merely
#: stalled): it counts until its worker reports back alive, which turns it into ``stalled``, not
#: counted. ``lost_race``, ``unschedulable`` and the failures are not preemptions.
PREEMPTION_OUTCOMES: frozenset[AttemptOutcome] = frozenset(
    {AttemptOutcome.PREEMPTED, AttemptOutcome.ABANDONED, AttemptOutcome.LOST_LEASE}
)
#: failure classes (``adb_attempts.failure_class`` values) of a try that died by itself: a crash
#: (a segfault, the OOM killer, a bad model: ``deterministic``) or a configuration error. The
#: launcher records one on an ``abandoned`` try whose death it did not cause; the pool kept the
#: capacity, so such a try is no preemption
CRASH_FAILURE_CLASSES: frozenset[str] = frozenset(
    {FailureClass.DETERMINISTIC.value, FailureClass.CONFIGURATION.value}
)
#: tries whose uncommitted work another try does again, by outcome alone: the preemption outcomes,
#: crashes included (a crashed try's uncommitted microbatch is lost as a preempted one's is), and
#: the stalls (a stalled worker's lease went to another claim, which redoes what it had not committed)
REDONE_WORK_OUTCOMES: frozenset[AttemptOutcome] = PREEMPTION_OUTCOMES | {AttemptOutcome.STALLED}


def is_preemption(outcome: AttemptOutcome | str, failure_class: str | None) -> bool:
    """Whether a finished try was a preemption: an outcome of :data:`PREEMPTION_OUTCOMES` whose
    recorded class is no crash (:data:`CRASH_FAILURE_CLASSES`; none recorded counts as a preemption).

    The one rule of the job view (learned Spot rate, storms), ``store.pool_stats`` (what later jobs
    learn of a pool), the progress report, the UI and the metrics: a crash loop on Spot is not a
    Spot storm. A crashed Spot try is still Spot time (the pool was there) and redone work.
    """
    return AttemptOutcome(outcome) in PREEMPTION_OUTCOMES and failure_class not in CRASH_FAILURE_CLASSES


_J = JobState
JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    _J.SUBMITTED: frozenset({_J.ADMITTED, _J.REJECTED, _J.CANCELLED, _J.FAILED}),
    # admitted → finalizing: a job with no shards to run (every line invalid, under the limit)
    _J.ADMITTED: frozenset({_J.RUNNING, _J.FINALIZING, _J.CANCELLED, _J.FAILED}),
    _J.RUNNING: frozenset({_J.FINALIZING, _J.CANCELLED, _J.FAILED}),
    # finalizing → running: verification found missing outcomes and shards are retried
    _J.FINALIZING: frozenset({_J.COMPLETED, _J.PARTIAL, _J.FAILED, _J.CANCELLED, _J.RUNNING}),
    **{state: frozenset() for state in TERMINAL_JOB_STATES},
}

_S = ShardState
SHARD_TRANSITIONS: Mapping[ShardState, frozenset[ShardState]] = {
    # pending → terminal_failure: the job was cancelled or ran out of time before any attempt
    _S.PENDING: frozenset({_S.LEASED, _S.TERMINAL_FAILURE}),
    # leased → leased: a new attempt takes over an expired lease (the epoch is bumped);
    # leased → pending: an attempt released its lease without failing (for example, abandoned)
    _S.LEASED: frozenset({_S.LEASED, _S.PENDING, _S.SUCCEEDED, _S.RETRYABLE_FAILURE, _S.TERMINAL_FAILURE}),
    _S.RETRYABLE_FAILURE: frozenset({_S.LEASED, _S.TERMINAL_FAILURE}),
    _S.SUCCEEDED: frozenset(),
    _S.TERMINAL_FAILURE: frozenset(),
}

_A = AttemptOutcome
ATTEMPT_TRANSITIONS: Mapping[AttemptOutcome, frozenset[AttemptOutcome]] = {
    _A.RUNNING: TERMINAL_ATTEMPT_OUTCOMES,
    **{outcome: frozenset() for outcome in TERMINAL_ATTEMPT_OUTCOMES},
    # the worker of an attempt the store ended as lost_lease reports back alive: it stalled, its
    # capacity was not taken (the attempt row only; the lease and the shard are not touched)
    _A.LOST_LEASE: frozenset({_A.STALLED}),
}

_SHARD_AFTER: Mapping[AttemptOutcome, ShardState] = {
    _A.SUCCEEDED: _S.SUCCEEDED,
    _A.PREEMPTED: _S.RETRYABLE_FAILURE,
    _A.LOST_LEASE: _S.RETRYABLE_FAILURE,
    _A.STALLED: _S.RETRYABLE_FAILURE,
    _A.FAILED_RETRYABLE: _S.RETRYABLE_FAILURE,
    _A.ABANDONED: _S.RETRYABLE_FAILURE,
    _A.UNSCHEDULABLE: _S.RETRYABLE_FAILURE,
    _A.FAILED_TERMINAL: _S.TERMINAL_FAILURE,
    # the shard stays with the winner of the race
    _A.LOST_RACE: _S.LEASED,
}


def _check(kind: str, table: Mapping[Any, frozenset[Any]], src: enum.Enum, dst: enum.Enum) -> None:
    if dst in table[src]:
        return
    allowed = ", ".join(sorted(s.value for s in table[src])) or "none, it is terminal"
    raise InvalidTransition(
        f"{kind} cannot go from {src.value} to {dst.value} (allowed from {src.value}: {allowed})",
        source=src.value,
        target=dst.value,
    )


def check_job_transition(src: JobState | str, dst: JobState | str, *, job_id: str | None = None) -> None:
    """Raise :class:`InvalidTransition` unless a job may move from ``src`` to ``dst``."""
    _check(f"job {job_id}" if job_id else "job", JOB_TRANSITIONS, JobState(src), JobState(dst))


def check_shard_transition(
    src: ShardState | str, dst: ShardState | str, *, shard_id: str | None = None
) -> None:
    """Raise :class:`InvalidTransition` unless a shard may move from ``src`` to ``dst``."""
    _check(f"shard {shard_id}" if shard_id else "shard", SHARD_TRANSITIONS, ShardState(src), ShardState(dst))


def check_attempt_transition(src: AttemptOutcome | str, dst: AttemptOutcome | str) -> None:
    """Raise :class:`InvalidTransition` unless an attempt may go from ``src`` to ``dst``.

    Only ``running`` ends; of the ended outcomes only ``lost_lease`` changes, to ``stalled``.
    """
    _check("attempt", ATTEMPT_TRANSITIONS, AttemptOutcome(src), AttemptOutcome(dst))


def shard_state_after(outcome: AttemptOutcome | str) -> ShardState:
    """The shard state an attempt's terminal outcome leads to (preempted → retryable_failure, ...)."""
    outcome = AttemptOutcome(outcome)
    if outcome is AttemptOutcome.RUNNING:
        raise ValueError("attempt outcome 'running' is not terminal; it leads to no shard state")
    return _SHARD_AFTER[outcome]
