"""The lease operations, each defined once: claim (or take over), race, exhaust, heartbeat, commit, complete.

Each operation is ONE conditional ``UPDATE ... RETURNING`` of the shard row. Its WHERE clause is
the whole precondition (the fencing token: epoch + attempt ID; a live lease on the DATABASE clock;
an active job; the cursor), so it either writes everything or nothing, and only the live lease's
attempt ever commits (docs/design.md §4.5, invariant 2). The same statement runs on SQLite and
PostgreSQL. The bookkeeping that must happen exactly when it matched (the attempt row, the commit
row, the job's first-claim transition, ending a superseded attempt) is written once too, as
statements that read the matched row from a table expression named ``fenced``:

* on PostgreSQL ``fenced`` is the UPDATE itself as a CTE and the bookkeeping are data-modifying
  CTEs of the same statement (:attr:`LeaseStatement.combined`), so one statement in autocommit
  mode does all of it: one round trip;
* on SQLite (no data-modifying CTEs) the UPDATE runs first and, when it returned a row, the
  bookkeeping runs in the same ``BEGIN IMMEDIATE`` transaction with ``fenced`` a one-row
  subquery of that row's values (:func:`run_steps`).

When the UPDATE matches nothing, nothing was written; the caller then reads the rows in a
read-only transaction (:func:`read_snapshot`) and the ``*_refusal`` functions name the precise
reason as the store's existing exceptions. Those functions mirror the WHERE clauses below: change
both together.

The tail race (docs/internals.md, "Racing leases"): beside its lease a LEASED shard may hold one
racing lease (``race_attempt_id``, ``race_epoch``, ``race_expires_at``), granted by
:data:`CLAIM_RACE` only while the primary lease is live. Heartbeat, commit and complete accept
either lease, each fenced by its own attempt ID and epoch (a racer's ``race_epoch`` is the
shard's epoch when it started, so any epoch bump fences it too): the primary's statement first
(unchanged, the hot path), then the racer's (``*_RACE``). COMMIT stays a compare-and-set on the
cursor, so whichever attempt commits a microbatch first wins it; no claim or take-over matches
while a live racer holds the shard; COMPLETE_RACED clears the race and ends the other attempt as
``lost_race``.

Lock order: every statement here locks the shard row first (the UPDATE), then attempt rows, then
the job row (the first claim of an admitted job). In the combined statement a bookkeeping CTE
locks a row only once it has read ``fenced`` (a join, or an uncorrelated ``EXISTS (SELECT 1 FROM
fenced)`` that PostgreSQL evaluates once, before it scans), that is, after the shard UPDATE ran.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.ids import shard_id
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState, check_shard_transition
from airflow_deadline_batch.exceptions import LeaseLost, ShardNotClaimable, StoreError
from airflow_deadline_batch.store.rows import Lease, ShardRow
from airflow_deadline_batch.store.schema import (
    JSONType,
    attempts,
    commits,
    db_epoch,
    db_timestamp,
    jobs,
    shards,
)

#: jobs in these states accept claims, heartbeats and commits
ACTIVE_JOB_STATES = frozenset({JobState.ADMITTED, JobState.RUNNING})
#: a shard in these states can be claimed (a LEASED one only once its lease has expired)
CLAIMABLE_SHARD_STATES = (ShardState.PENDING, ShardState.RETRYABLE_FAILURE, ShardState.LEASED)

Bookkeeping = Callable[[sa.FromClause], sa.Insert | sa.Update]


@dataclass(frozen=True)
class LeaseStatement:
    """One lease operation: the conditional UPDATE and its bookkeeping, in both executable forms."""

    name: str
    #: the conditional ``UPDATE ... RETURNING`` of the shard row (SQLite runs it alone first)
    fence: sa.Update
    #: the bookkeeping for SQLite, reading ``fenced`` from the bound ``r_<column>`` parameters
    steps: tuple[sa.Insert | sa.Update, ...]
    #: PostgreSQL: the UPDATE and its bookkeeping as one statement; returns what ``fence`` returns
    combined: sa.Select[Any]


def lease_statement(name: str, fence: sa.Update, *bookkeeping: Bookkeeping) -> LeaseStatement:
    """Both forms of one operation, from the one definition of its UPDATE and its bookkeeping."""
    as_cte = fence.cte("fenced")
    combined = sa.select(*as_cte.c).add_cte(
        *(make(as_cte).cte(f"{name}_{i}") for i, make in enumerate(bookkeeping, 1))
    )
    returned = sa.select(
        *(
            sa.bindparam(f"r_{column.key}", type_=column.type).label(column.key)
            for column in fence.exported_columns
        )
    ).subquery("fenced")
    return LeaseStatement(name, fence, tuple(make(returned) for make in bookkeeping), combined)


def run_steps(conn: Connection, op: LeaseStatement, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``op`` as separate statements in the caller's transaction: the UPDATE, then if it matched, the rest."""
    row = conn.execute(op.fence, params).first()
    if row is None:
        return None
    returned = dict(row._mapping)
    for step in op.steps:
        conn.execute(step, {**params, **{f"r_{key}": value for key, value in returned.items()}})
    return returned


# -- the statements ---------------------------------------------------------------------------------
# Bound parameters: b_job, b_index (the shard key); b_attempt, b_epoch (the lease); b_ttl, b_pool,
# b_worker (claim, heartbeat); b_seq and the commit's b_* values (commit).

_B = sa.bindparam
_TTL: sa.BindParameter[float] = _B("b_ttl", type_=sa.Double())
_SEQ: sa.BindParameter[int] = _B("b_seq", type_=sa.Integer())
_JOB: sa.BindParameter[str] = _B("b_job", type_=sa.String())
_INDEX: sa.BindParameter[int] = _B("b_index", type_=sa.Integer())
_ATTEMPT: sa.BindParameter[str] = _B("b_attempt", type_=sa.String())
_EPOCH: sa.BindParameter[int] = _B("b_epoch", type_=sa.Integer())
_POOL: sa.BindParameter[str] = _B("b_pool", type_=sa.String())
_ACTIVE = sorted(s.value for s in ACTIVE_JOB_STATES)


def _one_of(column: sa.ColumnElement[str], values: list[str]) -> sa.ColumnElement[bool]:
    """``column IN (values)`` as comparisons: SQLAlchemy renders an IN list anew at each execution."""
    return sa.or_(*(column == value for value in values))


_KEY = sa.and_(shards.c.job_id == _JOB, shards.c.shard_index == _INDEX)
_JOB_IS_ACTIVE = sa.exists().where(jobs.c.job_id == shards.c.job_id, _one_of(jobs.c.state, _ACTIVE))
#: this attempt holds the shard's (primary) lease, live
_PRIMARY_HOLDS = sa.and_(
    shards.c.epoch == _EPOCH,
    shards.c.lease_attempt_id == _ATTEMPT,
    shards.c.lease_expires_at > db_epoch(),
)
#: this attempt holds the shard's racing lease, live, started at the shard's current epoch
_RACER_HOLDS = sa.and_(
    shards.c.epoch == _EPOCH,
    shards.c.race_epoch == _EPOCH,
    shards.c.race_attempt_id == _ATTEMPT,
    shards.c.race_expires_at > db_epoch(),
)
#: no racer, or its racing lease expired
_NO_LIVE_RACER = sa.or_(shards.c.race_attempt_id.is_(None), shards.c.race_expires_at <= db_epoch())
#: the columns of the racing lease, cleared whenever the shard leaves a race
NO_RACE: dict[str, Any] = {
    "race_attempt_id": None,
    "race_epoch": None,
    "race_expires_at": None,
    "race_ttl_s": None,
}
#: claimable: never leased or released after a failure (held by no attempt), or its lease expired
#: and no live racer holds it (a third attempt never takes over from a running racer)
_NOT_HELD = _one_of(shards.c.state, [ShardState.PENDING.value, ShardState.RETRYABLE_FAILURE.value])
_LEASE_EXPIRED = sa.and_(
    shards.c.state == ShardState.LEASED.value, shards.c.lease_expires_at <= db_epoch(), _NO_LIVE_RACER
)
_CLAIMABLE = sa.and_(_KEY, sa.or_(_NOT_HELD, _LEASE_EXPIRED))
#: the shard's job's max_attempts (for EXHAUST's message), by the shard key's job ID
_MAX_ATTEMPTS = sa.select(jobs.c.max_attempts).where(jobs.c.job_id == _JOB).scalar_subquery()


def attempt_pool(attempt_id: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
    """An attempt's pool, from its attempt row: ``last_pool`` once a racer holds or wins the shard."""
    return sa.select(attempts.c.pool).where(attempts.c.attempt_id == attempt_id).scalar_subquery()


def _fenced_exists(fenced: sa.FromClause) -> sa.Exists:
    return sa.exists(sa.select(1).select_from(fenced))


def _end_superseded_attempts(
    error: Callable[[sa.FromClause], sa.ColumnElement[str]],
    outcome: AttemptOutcome = AttemptOutcome.LOST_LEASE,
    *,
    spare_holder: bool = False,
) -> Bookkeeping:
    """End as ``outcome`` the attempts ``fenced`` took the shard from (every other running one).

    ``spare_holder``: not the attempt that holds the primary lease (``fenced.lease_attempt_id``).
    """

    def make(fenced: sa.FromClause) -> sa.Update:
        spared = [attempts.c.attempt_id != fenced.c.lease_attempt_id] if spare_holder else []
        return (
            sa.update(attempts)
            .where(
                attempts.c.job_id == _JOB,
                attempts.c.shard_index == _INDEX,
                attempts.c.outcome == AttemptOutcome.RUNNING.value,
                attempts.c.epoch <= fenced.c.epoch,  # UPDATE ... FROM fenced: nothing if it matched nothing
                attempts.c.attempt_id != _ATTEMPT,
                *spared,
            )
            .values(outcome=outcome.value, ended_at=db_timestamp(), error=error(fenced))
        )

    return make


def _attempt_row(*, speculative: bool) -> Bookkeeping:
    """Record the new attempt, running, at the epoch ``fenced`` returned."""

    def make(fenced: sa.FromClause) -> sa.Insert:
        now = db_timestamp()
        return sa.insert(attempts).from_select(
            ["attempt_id", "job_id", "shard_index", "epoch", "worker", "pool", "started_at", "outcome"]
            + ["heartbeat_at", "speculative"],
            sa.select(
                _ATTEMPT,
                _JOB,
                _INDEX,
                fenced.c.epoch,
                _B("b_worker", type_=sa.String()),
                _POOL,
                now,
                sa.literal(AttemptOutcome.RUNNING.value),
                now,
                sa.literal(speculative, type_=sa.Boolean()),
            ),
        )

    return make


_insert_attempt = _attempt_row(speculative=False)


def _run_job(fenced: sa.FromClause) -> sa.Update:
    """The first claim moves an admitted job to running."""
    return (
        sa.update(jobs)
        .where(jobs.c.job_id == _JOB, jobs.c.state == JobState.ADMITTED.value, _fenced_exists(fenced))
        .values(state=JobState.RUNNING.value, updated_at=db_timestamp())
    )


def _stamp_heartbeat(fenced: sa.FromClause) -> sa.Update:
    return (
        sa.update(attempts)
        .where(attempts.c.attempt_id == _ATTEMPT, _fenced_exists(fenced))
        .values(heartbeat_at=db_timestamp())
    )


def _insert_commit(fenced: sa.FromClause) -> sa.Insert:
    return sa.insert(commits).from_select(
        ["job_id", "shard_index", "seq", "attempt_id", "epoch", "uri", "sha256", "records", "counts"]
        + ["prompt_tokens", "completion_tokens", "elapsed_s", "model_digest", "pool", "committed_at"],
        sa.select(
            _JOB,
            _INDEX,
            _SEQ,
            _ATTEMPT,
            _EPOCH,
            _B("b_uri", type_=sa.String()),
            _B("b_sha256", type_=sa.String()),
            _B("b_records", type_=sa.Integer()),
            _B("b_counts", type_=JSONType),
            _B("b_prompt_tokens", type_=sa.BigInteger()),
            _B("b_completion_tokens", type_=sa.BigInteger()),
            _B("b_elapsed_s", type_=sa.Double()),
            _B("b_model_digest", type_=sa.String()),
            _POOL,
            db_timestamp(),
        ).select_from(fenced),
    )


def _attempt_succeeded(fenced: sa.FromClause) -> sa.Update:
    return (
        sa.update(attempts)
        .where(
            attempts.c.attempt_id == _ATTEMPT,
            attempts.c.outcome == AttemptOutcome.RUNNING.value,
            _fenced_exists(fenced),
        )
        .values(outcome=AttemptOutcome.SUCCEEDED.value, ended_at=db_timestamp(), error=None)
    )


def _as_text(value: sa.ColumnElement[Any]) -> sa.ColumnElement[str]:
    return sa.cast(value, sa.String())


def _claim(name: str, shard_state: sa.ColumnElement[bool], *bookkeeping: Bookkeeping) -> LeaseStatement:
    """Take the lease with a fresh attempt and a bumped epoch (the fencing token); returns the new lease."""
    return lease_statement(
        name,
        sa.update(shards)
        .where(
            _KEY,
            shard_state,
            sa.exists().where(
                jobs.c.job_id == shards.c.job_id,
                _one_of(jobs.c.state, _ACTIVE),
                # only tries that spent the budget count (docs/design.md §6.6), not every claim
                shards.c.failures < jobs.c.max_attempts,
            ),
        )
        .values(
            state=ShardState.LEASED.value,
            epoch=shards.c.epoch + 1,
            lease_attempt_id=_ATTEMPT,
            lease_expires_at=db_epoch() + _TTL,
            lease_ttl_s=_TTL,
            attempts=shards.c.attempts + 1,
            last_pool=_POOL,
            updated_at=db_timestamp(),
            **NO_RACE,
        )
        .returning(shards.c.epoch, shards.c.lease_expires_at, shards.c.cursor, shards.c.num_microbatches),
        _insert_attempt,
        *bookkeeping,
        _run_job,
    )


#: claim a shard that no attempt holds (never leased, or released after a failure)
CLAIM = _claim("claim", _NOT_HELD)
#: claim a shard whose lease has expired, ending the attempt that held it as ``lost_lease`` (a
#: preemption until its worker, if alive, reports back and makes it ``stalled``:
#: ``ManifestStore._report_stalled``); a statement of its own so that the common claim does not
#: pay for looking for that attempt
TAKE_OVER = _claim(
    "take_over",
    _LEASE_EXPIRED,
    _end_superseded_attempts(lambda f: "lease expired; taken over at epoch " + _as_text(f.c.epoch)),
)

#: a claimable shard of an active job whose budget is spent fails terminally; returns last_error
EXHAUST = lease_statement(
    "exhaust",
    sa.update(shards)
    .where(
        _CLAIMABLE,
        sa.exists().where(
            jobs.c.job_id == shards.c.job_id,
            _one_of(jobs.c.state, _ACTIVE),
            shards.c.failures >= jobs.c.max_attempts,
        ),
    )
    .values(
        state=ShardState.TERMINAL_FAILURE.value,
        lease_attempt_id=None,
        lease_expires_at=None,
        # the real cause stays in the message (the last try's error), after the budget's numbers
        last_error="failed "
        + _as_text(shards.c.failures)
        + " times without progress (max_attempts="
        + _as_text(_MAX_ATTEMPTS)
        + "); last error: "
        + sa.func.coalesce(shards.c.last_error, "unknown"),
        updated_at=db_timestamp(),
        **NO_RACE,
    )
    .returning(shards.c.epoch, shards.c.last_error),
    _end_superseded_attempts(lambda f: "lease expired; shard " + f.c.last_error),
)

#: a racing lease for a LEASED shard whose primary lease is live and that no live racer holds,
#: with microbatches left to run; the epoch is not bumped (the primary keeps its lease). A dead
#: racer it replaces ends as ``lost_lease``. Returns the racer's lease.
CLAIM_RACE = lease_statement(
    "claim_race",
    sa.update(shards)
    .where(
        _KEY,
        shards.c.state == ShardState.LEASED.value,
        shards.c.lease_expires_at > db_epoch(),
        _NO_LIVE_RACER,
        shards.c.cursor < shards.c.num_microbatches,
        _JOB_IS_ACTIVE,
    )
    .values(
        race_attempt_id=_ATTEMPT,
        race_epoch=shards.c.epoch,
        race_expires_at=db_epoch() + _TTL,
        race_ttl_s=_TTL,
        attempts=shards.c.attempts + 1,
        updated_at=db_timestamp(),
    )
    .returning(
        shards.c.epoch,
        shards.c.race_expires_at.label("lease_expires_at"),
        shards.c.cursor,
        shards.c.num_microbatches,
        shards.c.lease_attempt_id,
    ),
    _attempt_row(speculative=True),
    _end_superseded_attempts(
        lambda f: sa.literal("racing lease expired; replaced by another racer"), spare_holder=True
    ),
)


def _held(lease: sa.ColumnElement[bool]) -> sa.ColumnElement[bool]:
    """The precondition of heartbeat, commit and complete: ``lease`` (primary or racing) is held, live."""
    return sa.and_(_KEY, shards.c.state == ShardState.LEASED.value, lease, _JOB_IS_ACTIVE)


# Each of heartbeat, commit and complete is two statements: the primary lease's (as before the
# race existed, the hot path) and the racing lease's, tried second (ManifestStore._fenced tries
# them in order), so a job that never races pays nothing for it.

#: extend the live lease to db_now + ttl; returns the new expiry and the cursor
HEARTBEAT = lease_statement(
    "heartbeat",
    sa.update(shards)
    .where(_held(_PRIMARY_HOLDS))
    .values(lease_expires_at=db_epoch() + _TTL, lease_ttl_s=_TTL, updated_at=db_timestamp())
    .returning(shards.c.lease_expires_at, shards.c.cursor),
    _stamp_heartbeat,
)
#: the same for the racing lease
HEARTBEAT_RACE = lease_statement(
    "heartbeat_race",
    sa.update(shards)
    .where(_held(_RACER_HOLDS))
    .values(race_expires_at=db_epoch() + _TTL, race_ttl_s=_TTL, updated_at=db_timestamp())
    .returning(shards.c.race_expires_at.label("lease_expires_at"), shards.c.cursor),
    _stamp_heartbeat,
)


def _extended(expires: sa.ColumnElement[Any], ttl: sa.ColumnElement[Any]) -> sa.ColumnElement[float]:
    """A commit extends a lease to db_now + its TTL, never shortens it."""
    from_now = db_epoch() + sa.func.coalesce(ttl, 0.0)
    return sa.case((expires > from_now, expires), else_=from_now)


#: the cursor is the compare-and-set: of two racing attempts, the first to commit a seq wins it
_NEXT_SEQ = sa.and_(shards.c.cursor == _SEQ, shards.c.cursor < shards.c.num_microbatches)
#: record microbatch b_seq (the cursor) and extend the lease by its TTL; returns the new expiry
COMMIT = lease_statement(
    "commit",
    sa.update(shards)
    .where(_held(_PRIMARY_HOLDS), _NEXT_SEQ)
    .values(
        cursor=shards.c.cursor + 1,
        lease_expires_at=_extended(shards.c.lease_expires_at, shards.c.lease_ttl_s),
        updated_at=db_timestamp(),
    )
    .returning(shards.c.lease_expires_at),
    _insert_commit,
)
#: the same under the racing lease
COMMIT_RACE = lease_statement(
    "commit_race",
    sa.update(shards)
    .where(_held(_RACER_HOLDS), _NEXT_SEQ)
    .values(
        cursor=shards.c.cursor + 1,
        race_expires_at=_extended(shards.c.race_expires_at, shards.c.race_ttl_s),
        updated_at=db_timestamp(),
    )
    .returning(shards.c.race_expires_at.label("lease_expires_at")),
    _insert_commit,
)

_ALL_COMMITTED = shards.c.cursor == shards.c.num_microbatches
_DONE: dict[str, Any] = {
    "state": ShardState.SUCCEEDED.value,
    "lease_expires_at": None,
    "last_error": None,
    "updated_at": db_timestamp(),
}
#: mark the shard succeeded once every microbatch is committed; ends the attempt as succeeded
COMPLETE = lease_statement(
    "complete",
    sa.update(shards)
    .where(_held(_PRIMARY_HOLDS), _ALL_COMMITTED, shards.c.race_attempt_id.is_(None))
    .values(**_DONE)
    .returning(shards.c.epoch),
    _attempt_succeeded,
)
#: the same for a shard in a race, by either attempt: clears the race, ends the other attempt as
#: ``lost_race`` and names the winner's pool as the shard's ``last_pool`` (a racer's is its own)
COMPLETE_RACED = lease_statement(
    "complete_raced",
    sa.update(shards)
    .where(_held(sa.or_(_PRIMARY_HOLDS, _RACER_HOLDS)), _ALL_COMMITTED, shards.c.race_attempt_id.is_not(None))
    .values(**_DONE, **NO_RACE, last_pool=attempt_pool(_ATTEMPT))
    .returning(shards.c.epoch),
    _attempt_succeeded,
    _end_superseded_attempts(
        lambda f: sa.literal("the other attempt of the race completed the shard"), AttemptOutcome.LOST_RACE
    ),
)

#: every lease operation (a PostgreSQL store compiles their combined statements when it is created)
OPERATIONS = (
    CLAIM,
    TAKE_OVER,
    CLAIM_RACE,
    EXHAUST,
    HEARTBEAT,
    HEARTBEAT_RACE,
    COMMIT,
    COMMIT_RACE,
    COMPLETE,
    COMPLETE_RACED,
)

# The transitions the statements above make must be allowed by core.states (the one definition of
# them); checked once, at import.
for _src in CLAIMABLE_SHARD_STATES:
    check_shard_transition(_src, ShardState.LEASED)
    check_shard_transition(_src, ShardState.TERMINAL_FAILURE)
check_shard_transition(ShardState.LEASED, ShardState.SUCCEEDED)


# -- refusals: read-only ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ShardSnapshot:
    """A shard, its job's state and the database clock, read together after a statement matched nothing."""

    shard: ShardRow
    job_state: JobState
    db_now: float


def read_snapshot(conn: Connection, job_id: str, shard_index: int) -> ShardSnapshot | None:
    """The shard with its job's state and the database clock; None if there is no such shard."""
    row = conn.execute(
        sa.select(shards, jobs.c.state.label("job_state"), db_epoch().label("db_now"))
        .join_from(shards, jobs, jobs.c.job_id == shards.c.job_id)
        .where(shards.c.job_id == job_id, shards.c.shard_index == shard_index)
    ).first()
    if row is None:
        return None
    return ShardSnapshot(
        shard=ShardRow.from_row(row), job_state=JobState(row.job_state), db_now=float(row.db_now)
    )


def claim_refusal(snap: ShardSnapshot) -> ShardNotClaimable | None:
    """Why CLAIM, TAKE_OVER and EXHAUST matched nothing, or None if the shard is claimable now."""
    shard = snap.shard
    where = f"shard {shard.shard_id} of job {shard.job_id}"
    key = {"job_id": shard.job_id, "shard_index": shard.shard_index}
    if shard.state is ShardState.SUCCEEDED:  # first: for the caller it is a no-op success
        return ShardNotClaimable(f"{where} is already committed; nothing to do", reason="succeeded", **key)
    if snap.job_state not in ACTIVE_JOB_STATES:
        return ShardNotClaimable(
            f"job {shard.job_id} is {snap.job_state.value}; its shards take no new attempts",
            reason="job_inactive",
            **key,
        )
    if shard.state is ShardState.TERMINAL_FAILURE:
        return ShardNotClaimable(
            f"{where} failed terminally ({shard.last_error}); it is not retried", reason="exhausted", **key
        )
    left = (shard.lease_expires_at or 0.0) - snap.db_now
    race_left = (shard.race_expires_at or 0.0) - snap.db_now if shard.race_attempt_id else 0.0
    if shard.state is ShardState.LEASED and max(left, race_left) > 0:
        holder = shard.lease_attempt_id if left > 0 else f"racer {shard.race_attempt_id}"
        return ShardNotClaimable(
            f"{where} is leased by {holder} for {max(left, race_left):.1f}s more",
            reason="leased",
            seconds_left=max(left, race_left),
            **key,
        )
    return None


def race_refusal(snap: ShardSnapshot) -> ShardNotClaimable | None:
    """Why CLAIM_RACE matched nothing, or None if a racer may start now.

    Reasons: ``succeeded``, ``job_inactive``, ``exhausted`` (as a claim's), ``not_running`` (no
    live primary lease to race: claim the shard instead), ``racing`` (a live racer holds it) and
    ``committed`` (every microbatch is committed; only completing is left).
    """
    shard = snap.shard
    refused = claim_refusal(snap)
    if refused is not None and refused.fields.get("reason") != "leased":
        return refused
    where = f"shard {shard.shard_id} of job {shard.job_id}"
    key = {"job_id": shard.job_id, "shard_index": shard.shard_index}
    if shard.state is not ShardState.LEASED or (shard.lease_expires_at or 0.0) <= snap.db_now:
        return ShardNotClaimable(
            f"{where} has no live lease to race ({shard.state.value}); claim it instead",
            reason="not_running",
            **key,
        )
    if shard.race_attempt_id is not None and (shard.race_expires_at or 0.0) > snap.db_now:
        return ShardNotClaimable(
            f"{where} is already raced by {shard.race_attempt_id}; one racer at most",
            reason="racing",
            **key,
        )
    if shard.cursor >= shard.num_microbatches:
        return ShardNotClaimable(
            f"{where} has every microbatch committed; nothing left to race", reason="committed", **key
        )
    return None


def exhausted(job_id: str, shard_index: int, last_error: str) -> ShardNotClaimable:
    """The refusal of a claim that EXHAUST answered (it recorded the terminal failure)."""
    return ShardNotClaimable(
        f"shard {shard_id(shard_index)} of job {job_id} is {last_error}",
        reason="exhausted",
        job_id=job_id,
        shard_index=shard_index,
    )


def lease_refusal(snap: ShardSnapshot, lease: Lease) -> LeaseLost | None:
    """:class:`LeaseLost` unless ``lease`` is the shard's current, live lease of an active job."""
    shard = snap.shard
    racer = shard.race_attempt_id == lease.attempt_id
    expires = (shard.race_expires_at if racer else shard.lease_expires_at) or 0.0
    if snap.job_state not in ACTIVE_JOB_STATES:
        reason = f"job is {snap.job_state.value}"  # checked first: it is the reason a user can act on
    elif (
        shard.epoch != lease.epoch
        or (racer and shard.race_epoch != lease.epoch)
        or not (racer or shard.lease_attempt_id == lease.attempt_id)
    ):
        reason = f"fenced by epoch {shard.epoch} ({shard.lease_attempt_id})"
    elif shard.state is not ShardState.LEASED:
        reason = f"shard is {shard.state.value}"
    elif expires <= snap.db_now:
        reason = f"lease expired {snap.db_now - expires:.2f}s ago"
    else:
        return None
    return LeaseLost(
        f"shard {lease.shard_id} of job {lease.job_id}: attempt {lease.attempt_id} (epoch {lease.epoch}) "
        f"lost its lease: {reason}; stop and exit retryable",
        job_id=lease.job_id,
        shard_index=lease.shard_index,
        attempt_id=lease.attempt_id,
        epoch=lease.epoch,
    )


def commit_refusal(snap: ShardSnapshot, lease: Lease, seq: int) -> StoreError | None:
    """Why COMMIT matched nothing: the lease (:class:`LeaseLost`), or a duplicate or out-of-order ``seq``."""
    lost = lease_refusal(snap, lease)
    if lost is not None:
        return lost
    shard = snap.shard
    if seq != shard.cursor or seq >= shard.num_microbatches:
        return StoreError(
            f"shard {lease.shard_id} of job {lease.job_id}: microbatch {seq} refused; "
            f"the next to commit is {shard.cursor} of {shard.num_microbatches} "
            "(duplicate or out-of-order commit)",
            job_id=lease.job_id,
            shard_index=lease.shard_index,
            seq=seq,
            expected_seq=shard.cursor,
        )
    return None


def live_rival(snap: ShardSnapshot, lease: Lease) -> str | None:
    """The other attempt of a race that ``lease`` (live) is in, if that one's lease is live too."""
    shard = snap.shard
    if shard.race_attempt_id is None:
        return None
    if shard.race_attempt_id == lease.attempt_id:
        rival, expires = shard.lease_attempt_id, shard.lease_expires_at
    else:
        rival, expires = shard.race_attempt_id, shard.race_expires_at
    return rival if (expires or 0.0) > snap.db_now else None


def lost_race(snap: ShardSnapshot, lease: Lease, seq: int) -> bool:
    """Whether ``lease``'s commit of ``seq`` was refused because its live rival committed it first."""
    return (
        lease_refusal(snap, lease) is None and seq < snap.shard.cursor and live_rival(snap, lease) is not None
    )


def complete_refusal(snap: ShardSnapshot, lease: Lease) -> StoreError | None:
    """Why COMPLETE matched nothing: the lease (:class:`LeaseLost`), or microbatches not yet committed."""
    lost = lease_refusal(snap, lease)
    if lost is not None:
        return lost
    shard = snap.shard
    if shard.cursor != shard.num_microbatches:
        return StoreError(
            f"shard {lease.shard_id} of job {lease.job_id} has {shard.cursor} of "
            f"{shard.num_microbatches} microbatches committed; commit the rest before completing it",
            job_id=lease.job_id,
            shard_index=lease.shard_index,
        )
    return None
