"""``ManifestStoreHook``: the manifest store's SQLAlchemy URL from an Airflow connection.

Resolution order (first match wins): the ``store_url`` argument, the connection ``store_conn_id``,
the embedded default ``sqlite:///<AIRFLOW_HOME>/deadline_batch.db``. A connection is either a
PostgreSQL connection (``conn_type`` ``postgres``/``postgresql``, turned into
``postgresql+psycopg://``) or a ``deadline_batch_store`` connection whose host (or extra ``url``)
holds a SQLAlchemy URL; its password field, when set, is inserted into that URL so the secret never
has to live in the host field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_deadline_batch.exceptions import ConfigurationError, JobNotFound, StoreError
from airflow_deadline_batch.store.engine import DEFAULT_BUDGET, StoreBudget

if TYPE_CHECKING:
    from airflow_deadline_batch.store import ManifestStore

CONN_TYPE = "deadline_batch_store"
POSTGRES_CONN_TYPES = frozenset({"postgres", "postgresql"})
SQLITE_FILE_NAME = "deadline_batch.db"


def airflow_home() -> Path:
    """``$AIRFLOW_HOME`` or Airflow's own default, ``~/airflow``."""
    return Path(os.environ.get("AIRFLOW_HOME") or Path.home() / "airflow").expanduser()


def default_store_url() -> str:
    """The embedded default: a SQLite file next to Airflow's own metadata."""
    return f"sqlite:///{airflow_home() / SQLITE_FILE_NAME}"


def url_from_connection(
    *,
    conn_id: str,
    conn_type: str | None,
    host: str | None,
    login: str | None,
    password: str | None,
    port: int | None,
    schema: str | None,
    extra: Mapping[str, Any],
) -> str:
    """Build a SQLAlchemy URL from a connection's fields (pure, so it is tested without a database)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.engine.url import URL

    kind = (conn_type or "").lower()
    if kind in POSTGRES_CONN_TYPES:
        if not host:
            raise ConfigurationError(
                f"connection {conn_id!r} (postgres) has no host; set the database host on the connection"
            )
        query = {
            k: str(v)
            for k, v in extra.items()
            if k
            in {
                "sslmode",
                "sslrootcert",
                "sslcert",
                "sslkey",
                "connect_timeout",
                "application_name",
                "options",
            }
        }
        url = URL.create(
            "postgresql+psycopg",
            username=login or None,
            password=password or None,
            host=host,
            port=port or None,
            database=schema or None,
            query=query,
        )
        return url.render_as_string(hide_password=False)
    if kind == CONN_TYPE or not kind:
        raw = (extra.get("url") or host or "").strip()
        if not raw:
            raise ConfigurationError(
                f"connection {conn_id!r} holds no store URL; put a SQLAlchemy URL "
                '(sqlite:///... or postgresql+psycopg://...) in its host or in extra {"url": ...}'
            )
        try:
            parsed = make_url(raw)
        except Exception as exc:  # sqlalchemy raises ArgumentError; show the user which field to fix
            raise ConfigurationError(
                f"connection {conn_id!r}: {raw.split('@')[-1]!r} is not a SQLAlchemy URL; "
                "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
            ) from exc
        if parsed.drivername in {"postgres", "postgresql"}:
            parsed = parsed.set(drivername="postgresql+psycopg")
        if password and not parsed.password and parsed.host:
            parsed = parsed.set(password=password)
        if login and not parsed.username and parsed.host:
            parsed = parsed.set(username=login)
        return parsed.render_as_string(hide_password=False)
    raise ConfigurationError(
        f"connection {conn_id!r} has type {conn_type!r}; use a {CONN_TYPE!r} or 'postgres' connection"
    )


class ManifestStoreHook(BaseHook):
    """Opens the :class:`~airflow_deadline_batch.store.ManifestStore` named by an argument or connection."""

    conn_name_attr = "store_conn_id"
    default_conn_name = "deadline_batch_store_default"
    conn_type = CONN_TYPE
    hook_name = "Deadline Batch manifest store"

    def __init__(self, store_conn_id: str | None = None, store_url: str | None = None) -> None:
        super().__init__()
        self.store_conn_id = store_conn_id
        self.store_url = store_url

    def get_store_url(self) -> str:
        """The SQLAlchemy URL (argument, then connection, then the SQLite default)."""
        if self.store_url:
            return self.store_url
        if self.store_conn_id:
            conn = self.get_connection(self.store_conn_id)
            return url_from_connection(
                conn_id=self.store_conn_id,
                conn_type=conn.conn_type,
                host=conn.host,
                login=conn.login,
                password=conn.password,
                port=conn.port,
                schema=conn.schema,
                extra=conn.extra_dejson or {},
            )
        return default_store_url()

    def get_store(self, *, migrate: bool = False, budget: StoreBudget = DEFAULT_BUDGET) -> ManifestStore:
        """Open the store; ``migrate=True`` creates or upgrades its tables first (idempotent).
        ``budget``: how long its calls wait for the database (the default is the workers')."""
        from airflow_deadline_batch.store import ManifestStore

        url = self.get_store_url()
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        store = ManifestStore(url, budget=budget)
        if migrate:
            store.migrate()
        return store

    def describe(self) -> str:
        """Which store this hook opens, in words a DAG author recognises (never the URL: secrets)."""
        if self.store_url:
            return "the store_url given to this task"
        if self.store_conn_id:
            return f"connection {self.store_conn_id!r}"
        return f"the default store {default_store_url()}"

    def get_job_store(self, job_id: str, *, plan_store_conn_id: str | None = None) -> ManifestStore:
        """Open the store and check that it holds ``job_id``; a store without it is a wrong store.

        A task pointed at another store than the plan's would otherwise fail on its first query
        with "no such table" or "job not found"; this says what is wrong instead
        (``ConfigurationError``). A store that is merely unreachable raises its own ``StoreError``.
        """
        store = self.get_store()
        try:
            store.get_job(job_id)
        except JobNotFound:
            found = "it holds no such job"
        except StoreError:
            if store.schema_revision() is not None:
                raise  # a real store failure (unreachable, transient): not a mismatch
            found = "it has no deadline-batch tables at all"
        else:
            return store
        planned = (
            f"the plan task created it in connection {plan_store_conn_id!r}"
            if plan_store_conn_id
            else "the plan task that created it used another store"
        )
        raise ConfigurationError(
            f"job {job_id} is not in the manifest store this task reads ({self.describe()}): {found}; "
            f"{planned}. This task and the plan task must use the same store: name it once, on the "
            "plan task (shard tasks and the sensor inherit its store_conn_id), or give this task the "
            "plan's store_conn_id/store_url"
        )

    def test_connection(self) -> tuple[bool, str]:
        """Used by the UI's "Test" button: open the store and read one job list page."""
        try:
            store = self.get_store()
            store.list_jobs()
        except Exception as exc:  # surfaced to the UI verbatim; nothing to recover
            return False, str(exc)
        return True, "manifest store reachable"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Connection form behaviour for Airflow < 3.2 (3.2+ reads it from the provider info)."""
        return {
            "hidden_fields": ["schema", "login", "port"],
            "relabeling": {"host": "SQLAlchemy URL", "password": "Password (inserted into the URL)"},
            "placeholders": {
                "host": "postgresql+psycopg://user@db.example.com:5432/deadline_batch",
                "extra": '{"url": "sqlite:////opt/airflow/deadline_batch.db"}',
            },
        }
