"""Engines for the manifest store, per dialect, and the retry policy for transient database errors."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection
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
#: SQLSTATE query_canceled: the server cancelled the statement (``statement_timeout`` among others)
_QUERY_CANCELED = "57014"


@dataclass(frozen=True)
class StoreBudget:
    """How long one call on a store may wait for its database, and how many times it is tried.

    The default is the workers' and operators': they ride out a restart or a fail-over, so a
    connect waits :data:`CONNECT_TIMEOUT_S` and a transient failure is tried again, up to
    :data:`RETRY_ATTEMPTS` times in all, and no statement is cut short. A caller with a person
    waiting on it (a page of the jobs view) gives a shorter connect timeout, fewer attempts and a
    PostgreSQL ``statement_timeout`` instead, so that a store that is slow or gone fails in seconds.
    """

    #: seconds a new PostgreSQL connection may take (libpq's ``connect_timeout``: whole seconds)
    connect_timeout_s: int = CONNECT_TIMEOUT_S
    #: tries in all of a transaction that fails transiently (1: never tried again)
    attempts: int = RETRY_ATTEMPTS
    #: seconds a call waits for a free pooled connection
    pool_timeout_s: float = 30.0
    #: PostgreSQL's ``statement_timeout`` on the store's connections, in seconds (None: none)
    statement_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.connect_timeout_s < 1 or self.pool_timeout_s <= 0:
            raise ValueError(f"a store budget needs attempts >= 1 and positive timeouts, got {self}")
        if self.statement_timeout_s is not None and not self.statement_timeout_s > 0:
            raise ValueError(f"statement_timeout_s must be > 0 or None, got {self.statement_timeout_s}")


#: the workers' and operators' budget (every store's unless it is given another)
DEFAULT_BUDGET = StoreBudget()


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


def _install_statement_timeout(engine: Engine, timeout_s: float) -> None:
    """Every new PostgreSQL connection of ``engine`` cancels a statement that runs (or waits for a
    lock) longer than ``timeout_s``: a session setting, so it holds for every transaction on it.

    Set on connect rather than in the URL's ``options``, which may already carry the user's own
    (a ``search_path``, say) and would be replaced.
    """
    milliseconds = max(1, int(timeout_s * 1000))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True  # a session setting, outside any transaction
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"SET statement_timeout = {milliseconds}")
        finally:
            cursor.close()
            dbapi_connection.autocommit = autocommit


def create_store_engine(url: str, budget: StoreBudget = DEFAULT_BUDGET) -> Engine:
    """An engine with explicit connect timeouts; SQLite in WAL mode with serialized writers.

    ``budget`` gives the PostgreSQL engine its connect, pool and statement timeouts (SQLite opens
    a local file: it has none of these to wait on).
    """
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
        _install_sqlite_hooks(engine)
        return engine
    engine = sa.create_engine(
        url,
        # connect_timeout: without it a half-open network path hangs the worker for minutes.
        connect_args={"connect_timeout": budget.connect_timeout_s},
        pool_size=2,
        max_overflow=4,
        pool_timeout=budget.pool_timeout_s,
        pool_recycle=1800,
    )
    _install_idle_ping(engine)
    if budget.statement_timeout_s is not None:
        _install_statement_timeout(engine, budget.statement_timeout_s)
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


def is_statement_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or the error it was raised from) is PostgreSQL cancelling a statement that
    ran past its ``statement_timeout`` (:attr:`StoreBudget.statement_timeout_s`)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, sa.exc.DBAPIError):
            orig = seen.orig
            return getattr(orig, "sqlstate", None) == _QUERY_CANCELED and "statement timeout" in str(orig)
        seen = seen.__cause__
    return False


def run_with_retry(
    fn: Callable[[], T],
    *,
    passthrough: tuple[type[BaseException], ...] = (),
    url: str = "the manifest store",
    attempts: int = RETRY_ATTEMPTS,
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
    ``attempts`` is the tries in all (:attr:`StoreBudget.attempts`; 1: no retry).
    """
    try:
        try:
            return fn()
        except sa.exc.DBAPIError as exc:
            if attempts < 2 or not is_transient(exc):
                raise
        # The same schedule as one Retrying over all attempts: sleep U(0, 0.05 s) after the first
        # failure, then U(0, 0.1 s), U(0, 0.2 s), ... capped at 2 s; at most ``attempts`` in all.
        time.sleep(random.uniform(0.0, RETRY_WAIT_S))
        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_attempt(attempts - 1) | stop_after_delay(RETRY_WINDOW_S),
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
        # the class of the failure travels with the error (docs/design.md §6.6): a store that stayed
        # unreachable through the retries is transient for the try that called it, not a poison shard
        failure = "transient" if is_transient(exc) else None
        raise StoreError(f"{url}: {detail}; {hint}", **({"failure": failure} if failure else {})) from exc


def fork_safe(engine: Engine, owner_pid: int) -> int:
    """After ``fork()`` drop the parent's pooled connections without closing them (they are shared)."""
    pid = os.getpid()
    if pid != owner_pid:
        engine.dispose(close=False)
    return pid


@dataclass(frozen=True)
class DriverStatement:
    """A Core statement compiled once for a dialect, to run on the DBAPI connection directly.

    The SQL is SQLAlchemy's own rendering of the statement; what this skips is the per-execution
    work of a ``Connection`` (cache-key lookup, execution context, result wrapping), which costs
    more client CPU than the statement does round trip on PostgreSQL.
    """

    sql: str
    #: the statement's constants that could not be rendered into ``sql``, processed for the driver
    constants: Mapping[str, Any]
    #: the caller's parameters by name, with the bind processor its type needs (JSONB: a wrapper)
    processors: Mapping[str, Callable[[Any], Any] | None]
    #: the names of the returned columns
    keys: tuple[str, ...]

    @classmethod
    def of(cls, statement: sa.Select[Any], dialect: sa.Dialect) -> DriverStatement:
        """``statement`` compiled for ``dialect``, once per process (a forked child inherits it)."""
        key = (statement, dialect.name, dialect.driver)
        compiled = _DRIVER_STATEMENTS.get(key)
        if compiled is None:
            compiled = _DRIVER_STATEMENTS[key] = cls.compile(statement, dialect)
        return compiled

    @classmethod
    def compile(cls, statement: sa.Select[Any], dialect: sa.Dialect) -> DriverStatement:
        compiled = statement.compile(dialect=dialect)
        if "POSTCOMPILE" in compiled.string:  # an expanding IN would need SQLAlchemy at each execution
            raise ValueError(f"statement needs per-execution rendering: {compiled.string[:200]}")
        sql = compiled.string
        constants: dict[str, Any] = {}
        processors: dict[str, Callable[[Any], Any] | None] = {}
        for bind, name in compiled.bind_names.items():
            impl = bind.type.dialect_impl(dialect)
            if bind.required:
                processors[name] = impl.bind_processor(dialect)
                continue
            # A constant of the statement (a state, an increment; the module's own values, never
            # input) is rendered into the SQL, so that it is not sent as a parameter every time.
            value = bind.effective_value
            literal = impl.literal_processor(dialect)
            if value is None:
                rendered = "NULL"
            elif literal is not None:
                rendered = literal(value).replace("%", "%%")  # the driver's paramstyle is pyformat
            else:
                process = impl.bind_processor(dialect)
                constants[name] = process(value) if process is not None else value
                continue
            sql = sql.replace(f"%({name})s", rendered)
        keys = tuple(str(column.key) for column in statement.selected_columns)
        return cls(sql, constants, processors, keys)

    def parameters(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The driver's parameters: the constants and the caller's ``params``, processed."""
        values = dict(self.constants)
        for name, process in self.processors.items():
            value = params[name]
            values[name] = process(value) if process is not None else value
        return values


_DRIVER_STATEMENTS: dict[tuple[sa.Select[Any], str, str], DriverStatement] = {}


def _as_dbapi_error(
    engine: Engine, exc: BaseException, sql: str | None, params: Any, driver: Any
) -> BaseException:
    """A driver error as SQLAlchemy's ``DBAPIError`` (``connection_invalidated`` for a lost connection).

    So that :func:`run_with_retry` classifies it as it does every other statement's error; anything
    else comes back unchanged.
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


def _first(driver: Any, statement: DriverStatement, params: Mapping[str, Any]) -> dict[str, Any] | None:
    row = driver.execute(statement.sql, statement.parameters(params)).fetchone()
    return None if row is None else dict(zip(statement.keys, row, strict=True))


#: connections a forked child inherited: kept referenced so that it never closes the parent's sockets
_INHERITED: list[PoolProxiedConnection] = []


class AutocommitConnection:
    """One pooled connection a store keeps checked out, in autocommit mode, for its one-statement operations.

    On PostgreSQL each lease operation is one statement, atomic on its own, so it runs without
    BEGIN/COMMIT: one round trip. Keeping the connection saves the pool's checkout/check-in and
    the autocommit switch on every call. One thread at a time uses it; a thread that finds it busy
    (the heartbeat thread, say) takes a pooled connection for that call instead. Idle for longer
    than ``idle_s`` it goes back to the pool and is checked out again, so the pool's idle ping still
    runs before it is trusted; a connection that fails is discarded, never pooled. Not shared
    across ``fork()``: call :meth:`forget` in the child.
    """

    def __init__(self, engine: Engine, idle_s: float, statements: Iterable[sa.Select[Any]]) -> None:
        self._engine = engine
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._raw: PoolProxiedConnection | None = None
        self._used_at = 0.0
        # compiled now, not at first use: the first compile also imports the dialect's type support
        # (~0.1 s), which then never lands on a lease operation
        self._compiled = {s: DriverStatement.of(s, engine.dialect) for s in statements}

    def first(self, statement: sa.Select[Any], params: Mapping[str, Any]) -> dict[str, Any] | None:
        """Run ``statement`` (one given at construction) as its own transaction; its first row, or None."""
        compiled = self._compiled[statement]
        if not self._lock.acquire(blocking=False):
            return self._first_alone(compiled, params)
        try:
            raw = self._take()
            driver: Any = raw.driver_connection
            try:
                row = _first(driver, compiled, params)
            except BaseException as exc:
                self._raw = None
                raw.invalidate(exc)
                raw.close()
                _reraise(self._engine, exc, compiled.sql, params, driver)
            self._used_at = time.monotonic()
            return row
        finally:
            self._lock.release()

    def _first_alone(self, compiled: DriverStatement, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """On a pooled connection of its own, handed back in transaction mode (discarded after an error)."""
        raw = _checkout(self._engine)
        driver: Any = raw.driver_connection
        try:
            driver.autocommit = True
            row = _first(driver, compiled, params)
            driver.autocommit = False
            return row
        except BaseException as exc:
            raw.invalidate(exc)
            _reraise(self._engine, exc, compiled.sql, params, driver)
        finally:
            raw.close()

    def _take(self) -> PoolProxiedConnection:
        raw = self._raw
        if raw is not None and time.monotonic() - self._used_at <= self._idle_s:
            return raw
        self._give_back()
        raw = _checkout(self._engine)
        driver: Any = raw.driver_connection
        try:
            driver.autocommit = True
        except BaseException as exc:
            raw.invalidate(exc)
            raw.close()
            _reraise(self._engine, exc, None, None, driver)
        self._raw = raw
        return raw

    def _give_back(self) -> None:
        raw, self._raw = self._raw, None
        if raw is None:
            return
        driver: Any = raw.driver_connection
        try:
            driver.autocommit = False
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
