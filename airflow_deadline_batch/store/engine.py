"""Engines for the manifest store, per dialect, and the retry policy for transient database errors."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from airflow_deadline_batch.exceptions import ConfigurationError, StoreError

T = TypeVar("T")

CONNECT_TIMEOUT_S = 10
SQLITE_BUSY_TIMEOUT_S = 30.0
#: a pooled connection idle for longer than this is pinged before use
PING_AFTER_IDLE_S = 5.0
#: execution option read by the SQLite ``begin`` hook: "IMMEDIATE" for writes
BEGIN_MODE = "adb_sqlite_begin"
#: transient failures: tries in all, the window they must fit in, first backoff bound, backoff cap
RETRY_ATTEMPTS = 8
RETRY_WINDOW_S = 60.0
RETRY_WAIT_S = 0.05
RETRY_MAX_WAIT_S = 2.0

# SQLSTATEs worth retrying: serialization failure, deadlock, connection failures, server shutdown.
_TRANSIENT_SQLSTATES = frozenset(
    {"40001", "40P01", "08000", "08001", "08003", "08004", "08006", "57P01", "57P03"}
)
_TRANSIENT_MESSAGES = (
    "database is locked",
    "connection refused",
    "could not connect",
    "server closed the connection",
    "connection timeout",
    "terminating connection",
)


def normalize_url(url: str) -> str:
    """Accept ``postgresql://`` and ``postgres://`` as psycopg 3 URLs; reject other dialects clearly."""
    if url.startswith(("postgres://", "postgresql://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    if url.startswith(("sqlite://", "postgresql+psycopg://")):
        return url
    if "://" not in url:
        raise ConfigurationError(
            f"store URL {url!r} has no scheme; use sqlite:///path/to/store.db or postgresql+psycopg://user@host/db"
        )
    raise ConfigurationError(
        f"unsupported store URL scheme in {url.split('://', 1)[0]!r}; use sqlite:///... or postgresql+psycopg://..."
    )


def _install_sqlite_hooks(engine: Engine) -> None:
    """SQLAlchemy's documented pysqlite recipe, so that writes start with ``BEGIN IMMEDIATE``.

    pysqlite's own transaction handling defers BEGIN and takes the write lock only at the first
    write; two processes that both read first then deadlock on the lock upgrade. Taking the write
    lock up front makes concurrent workers queue on ``busy_timeout`` instead.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, below
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(BEGIN_MODE, "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


def _install_idle_ping(engine: Engine) -> None:
    """``pool_pre_ping``, but only for connections that sat idle in the pool.

    A connection dies while idle (server restart, fail-over, a NAT or proxy timeout); one handed
    back milliseconds ago is alive. Pinging only after ``PING_AFTER_IDLE_S`` keeps the protection
    without a round trip in front of every transaction of a busy worker. A connection that dies
    mid-transaction anyway is invalidated and the transaction retried (``run_with_retry``).
    """

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["adb_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("adb_idle_since")
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_S:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:  # any failure means: throw this connection away
            raise sa.exc.DisconnectionError(f"stale pooled connection: {exc}") from exc
        if not alive:
            raise sa.exc.DisconnectionError("stale pooled connection")


def create_store_engine(url: str) -> Engine:
    """An engine with explicit connect timeouts; SQLite in WAL mode with serialized writers."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
        _install_sqlite_hooks(engine)
        return engine
    engine = sa.create_engine(
        url,
        # connect_timeout: without it a half-open network path hangs the worker for minutes.
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
        pool_size=2,
        max_overflow=4,
        pool_timeout=30,
        pool_recycle=1800,
    )
    _install_idle_ping(engine)
    return engine


def is_transient(exc: BaseException) -> bool:
    """Errors that a fresh transaction may not hit: lock contention, serialization, lost connection."""
    if not isinstance(exc, sa.exc.DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in _TRANSIENT_SQLSTATES:
        return True
    message = str(orig).lower()
    return isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError) and any(
        text in message for text in _TRANSIENT_MESSAGES
    )


def run_with_retry(
    fn: Callable[[], T], *, passthrough: tuple[type[BaseException], ...] = (), url: str = "the manifest store"
) -> T:
    """Run one whole transaction, retrying transient failures with bounded, jittered backoff.

    Workers on Spot nodes see database restarts, fail-overs and (on SQLite) lock contention; a
    fresh transaction usually succeeds, and jitter keeps many workers from retrying in lockstep.
    Bounded so a store that is really down surfaces as a StoreError within about a minute.
    Every operation is a single transaction that re-checks its preconditions, so re-running it
    after a failure is safe (a commit whose acknowledgement was lost is then refused as a
    duplicate, which callers handle like a lost lease: exit retryable). Driver errors other
    than ``passthrough`` are wrapped in :class:`StoreError`. The first try runs bare: the retry
    machinery is built only after a transient failure (it cost more than a fast statement).
    """
    try:
        try:
            return fn()
        except sa.exc.DBAPIError as exc:
            if not is_transient(exc):
                raise
        # The same schedule as one Retrying over all attempts: sleep U(0, 0.05 s) after the first
        # failure, then U(0, 0.1 s), U(0, 0.2 s), ... capped at 2 s; at most RETRY_ATTEMPTS in all.
        time.sleep(random.uniform(0.0, RETRY_WAIT_S))
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(RETRY_ATTEMPTS - 1) | stop_after_delay(RETRY_WINDOW_S),
            wait=wait_random_exponential(multiplier=2 * RETRY_WAIT_S, max=RETRY_MAX_WAIT_S),
            reraise=True,
        )
        return retrying(fn)
    except passthrough:
        raise
    except sa.exc.DBAPIError as exc:
        detail = (str(exc.orig) if exc.orig is not None else str(exc)).strip().splitlines()[0]
        lowered = detail.lower()
        if "no such table" in lowered or ("relation" in lowered and "does not exist" in lowered):
            hint = "the schema is missing: run ManifestStore(url).migrate() (or ManifestStore.open(url))"
        else:
            hint = "check the --store URL and that the database is reachable"
        raise StoreError(f"{url}: {detail}; {hint}") from exc


def fork_safe(engine: Engine, owner_pid: int) -> int:
    """After ``fork()`` drop the parent's pooled connections without closing them (they are shared)."""
    pid = os.getpid()
    if pid != owner_pid:
        engine.dispose(close=False)
    return pid
