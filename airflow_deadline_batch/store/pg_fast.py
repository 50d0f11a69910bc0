"""PostgreSQL hot paths: claim, heartbeat, commit and complete, each as ONE statement in its own transaction.

Each statement is the store's conditional ``UPDATE ... RETURNING`` on the shard row (its WHERE clause
is the whole precondition: fencing token, live lease on the database clock, active job) with the
attempt/commit bookkeeping folded in as data-modifying CTEs that run only for the row it returned.
One statement is atomic on its own, so it runs in autocommit mode: one round trip instead of
``BEGIN``, two statements and ``COMMIT``. When it matches nothing, nothing was written and the
caller's slow path locks the row in a normal transaction and works out why.

Lock order stays shard → attempt → job: the later CTEs wait on ``EXISTS (SELECT 1 FROM <shard CTE>)``,
an uncorrelated sub-plan PostgreSQL evaluates before it scans their table. The statements are plain
SQL strings for psycopg (built once, prepared by the server after a few uses), so the hot path pays
neither SQLAlchemy's per-execution work nor its transaction bookkeeping.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.pool import PoolProxiedConnection

from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState

_NOW = "CAST(extract(epoch from clock_timestamp()) AS double precision)"
_ACTIVE = ", ".join(f"'{s.value}'" for s in sorted((JobState.ADMITTED, JobState.RUNNING)))
_LEASED = f"'{ShardState.LEASED.value}'"
_RUNNING = f"'{AttemptOutcome.RUNNING.value}'"
_KEY = "s.job_id = %(job)s AND s.shard_index = %(index)s::integer"
_HOLDS_LIVE_LEASE = f"""{_KEY} AND s.state = {_LEASED} AND s.epoch = %(epoch)s::integer
   AND s.lease_attempt_id = %(attempt)s AND s.lease_expires_at > {_NOW}
   AND EXISTS (SELECT 1 FROM adb_jobs j WHERE j.job_id = s.job_id AND j.state IN ({_ACTIVE}))"""

#: params: job, index, attempt, ttl, pool, worker → (epoch, lease_expires_at, cursor, num_microbatches)
CLAIM = f"""
WITH claimed AS (
  UPDATE adb_shards AS s
     SET state = {_LEASED}, epoch = s.epoch + 1, lease_attempt_id = %(attempt)s,
         lease_expires_at = {_NOW} + %(ttl)s::double precision, lease_ttl_s = %(ttl)s::double precision,
         attempts = s.attempts + 1, last_pool = %(pool)s, updated_at = clock_timestamp()
    FROM adb_jobs AS j
   WHERE {_KEY}
     AND s.state IN ('{ShardState.PENDING.value}', '{ShardState.RETRYABLE_FAILURE.value}')
     AND j.job_id = s.job_id AND j.state IN ({_ACTIVE}) AND s.attempts < j.max_attempts
  RETURNING s.epoch, s.lease_expires_at, s.cursor, s.num_microbatches, j.state AS job_state
), attempt AS (
  INSERT INTO adb_attempts (attempt_id, job_id, shard_index, epoch, worker, pool, started_at, outcome,
                            heartbeat_at)
  SELECT %(attempt)s::text, %(job)s::text, %(index)s::integer, epoch, %(worker)s::text, %(pool)s::text,
         clock_timestamp(), {_RUNNING}, clock_timestamp()
    FROM claimed
), run_job AS (
  UPDATE adb_jobs SET state = '{JobState.RUNNING.value}', updated_at = clock_timestamp()
   WHERE job_id = %(job)s AND state = '{JobState.ADMITTED.value}'
     AND EXISTS (SELECT 1 FROM claimed WHERE job_state = '{JobState.ADMITTED.value}')
)
SELECT epoch, lease_expires_at, cursor, num_microbatches FROM claimed
"""

#: params: job, index, epoch, attempt, ttl → (lease_expires_at, cursor)
HEARTBEAT = f"""
WITH beat AS (
  UPDATE adb_shards AS s
     SET lease_expires_at = {_NOW} + %(ttl)s::double precision, lease_ttl_s = %(ttl)s::double precision,
         updated_at = clock_timestamp()
   WHERE {_HOLDS_LIVE_LEASE}
  RETURNING s.lease_expires_at, s.cursor
), attempt AS (
  UPDATE adb_attempts SET heartbeat_at = clock_timestamp()
   WHERE attempt_id = %(attempt)s AND EXISTS (SELECT 1 FROM beat)
)
SELECT lease_expires_at, cursor FROM beat
"""

#: params: job, index, epoch, attempt, seq, uri, sha256, records, counts (Jsonb), prompt_tokens,
#: completion_tokens, elapsed_s, model_digest, pool → (lease_expires_at,)
COMMIT = f"""
WITH fenced AS (
  UPDATE adb_shards AS s
     SET cursor = s.cursor + 1,
         lease_expires_at = GREATEST(s.lease_expires_at, {_NOW} + COALESCE(s.lease_ttl_s, 0.0)),
         updated_at = clock_timestamp()
   WHERE {_HOLDS_LIVE_LEASE} AND s.cursor = %(seq)s::integer AND s.cursor < s.num_microbatches
  RETURNING s.lease_expires_at
), committed AS (
  INSERT INTO adb_commits (job_id, shard_index, seq, attempt_id, epoch, uri, sha256, records, counts,
                           prompt_tokens, completion_tokens, elapsed_s, model_digest, pool, committed_at)
  SELECT %(job)s::text, %(index)s::integer, %(seq)s::integer, %(attempt)s::text, %(epoch)s::integer,
         %(uri)s::text, %(sha256)s::text, %(records)s::integer, %(counts)s::jsonb, %(prompt_tokens)s::bigint,
         %(completion_tokens)s::bigint, %(elapsed_s)s::double precision, %(model_digest)s::text,
         %(pool)s::text, clock_timestamp()
    FROM fenced
)
SELECT lease_expires_at FROM fenced
"""

#: params: job, index, epoch, attempt → (epoch,)
COMPLETE = f"""
WITH done AS (
  UPDATE adb_shards AS s
     SET state = '{ShardState.SUCCEEDED.value}', lease_expires_at = NULL, last_error = NULL,
         updated_at = clock_timestamp()
   WHERE {_HOLDS_LIVE_LEASE} AND s.cursor = s.num_microbatches
  RETURNING s.epoch
), ended AS (
  UPDATE adb_attempts
     SET outcome = '{AttemptOutcome.SUCCEEDED.value}', ended_at = clock_timestamp(), error = NULL
   WHERE attempt_id = %(attempt)s AND outcome = {_RUNNING} AND EXISTS (SELECT 1 FROM done)
)
SELECT epoch FROM done
"""


def jsonb(value: Any) -> Any:
    """``value`` wrapped for a ``jsonb`` parameter of psycopg."""
    from psycopg.types.json import Jsonb

    return Jsonb(value)


def _as_dbapi_error(
    engine: Engine, exc: BaseException, sql: str | None, params: Any, driver: Any
) -> BaseException:
    """A driver error as SQLAlchemy's ``DBAPIError`` (``connection_invalidated`` for a lost connection).

    So that :func:`~airflow_deadline_batch.store.engine.run_with_retry` classifies it as it does
    every other statement's error; anything else comes back unchanged.
    """
    dialect = engine.dialect
    if not isinstance(exc, dialect.loaded_dbapi.Error):
        return exc
    lost = driver is None or dialect.is_disconnect(exc, driver, None)
    return sa.exc.DBAPIError.instance(
        sql, params, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost, dialect=dialect
    )


def _reraise(engine: Engine, exc: BaseException, sql: str | None, params: Any, driver: Any) -> NoReturn:
    converted = _as_dbapi_error(engine, exc, sql, params, driver)
    if converted is exc:
        raise exc
    raise converted from exc


def _checkout(engine: Engine) -> PoolProxiedConnection:
    """A pooled connection (the pool's checkout events, such as the idle ping, run), errors wrapped."""
    try:
        return engine.raw_connection()
    except BaseException as exc:
        _reraise(engine, exc, None, None, None)


def run_alone(engine: Engine, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """Run one statement as its own transaction on a pooled connection; its first row, or None.

    After any error the connection is discarded rather than returned to the pool half-reset.
    """
    raw = _checkout(engine)
    driver: Any = raw.driver_connection  # a psycopg.Connection
    try:
        driver.autocommit = True
        row = driver.execute(sql, params).fetchone()
        driver.autocommit = False
        return row
    except BaseException as exc:
        raw.invalidate(exc)
        _reraise(engine, exc, sql, params, driver)
    finally:
        raw.close()


#: connections a forked child inherited: kept referenced so that it never closes the parent's sockets
_INHERITED: list[PoolProxiedConnection] = []


class HotConnection:
    """One pooled connection a store keeps checked out, in autocommit mode, for its single statements.

    Saves the pool's checkout/check-in and the autocommit switch on every hot call. One thread at
    a time uses it; a thread that finds it busy (the heartbeat thread, say) takes a pooled
    connection for that call instead. Idle for longer than ``idle_s`` it goes back to the pool
    and is checked out again, so the pool's idle ping still runs before it is trusted; a
    connection that fails is discarded. Not shared across ``fork()``: call :meth:`forget` in the
    child.
    """

    def __init__(self, engine: Engine, idle_s: float) -> None:
        self._engine = engine
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._raw: PoolProxiedConnection | None = None
        self._used_at = 0.0

    def run(self, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        """Run one statement as its own transaction; its first row, or None."""
        if not self._lock.acquire(blocking=False):
            return run_alone(self._engine, sql, params)
        try:
            raw = self._take()
            driver: Any = raw.driver_connection
            try:
                row = driver.execute(sql, params).fetchone()
            except BaseException as exc:
                self._raw = None
                raw.invalidate(exc)
                raw.close()
                _reraise(self._engine, exc, sql, params, driver)
            self._used_at = time.monotonic()
            return row
        finally:
            self._lock.release()

    def _take(self) -> PoolProxiedConnection:
        raw = self._raw
        if raw is not None and time.monotonic() - self._used_at <= self._idle_s:
            return raw
        self._give_back()
        raw = _checkout(self._engine)
        try:
            raw.driver_connection.autocommit = True  # type: ignore[union-attr]
        except BaseException as exc:
            raw.invalidate(exc)
            raw.close()
            _reraise(self._engine, exc, None, None, raw.driver_connection)
        self._raw = raw
        return raw

    def _give_back(self) -> None:
        raw, self._raw = self._raw, None
        if raw is None:
            return
        try:
            raw.driver_connection.autocommit = False  # type: ignore[union-attr]
        except BaseException as exc:  # a broken connection: never pool it
            raw.invalidate(exc)
        raw.close()

    def release(self) -> None:
        """Hand the connection back to the pool (before the pool is disposed)."""
        with self._lock:
            self._give_back()

    def forget(self) -> None:
        """In a forked child: drop the parent's connection without touching it, and any lock it held."""
        if self._raw is not None:
            _INHERITED.append(self._raw)
        self._raw = None
        self._lock = threading.Lock()
