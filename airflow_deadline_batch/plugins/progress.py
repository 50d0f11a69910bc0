"""The provider's plugin: the jobs view in Airflow's UI, its FastAPI app, the progress link, and
the shard tasks' priority weight strategy (:mod:`airflow_deadline_batch.plugins.priority`).

Airflow 3's api-server mounts :func:`create_app` under ``/deadline-batch`` (``fastapi_apps``) and
shows its pages inside the UI through ``external_views`` (docs/airflow.md, *Jobs view*):

* ``Deadline Batch`` in the navigation → ``/deadline-batch/jobs`` (the jobs the user may read);
* a ``Deadline Batch`` tab on DAG run and task instance pages →
  ``/deadline-batch/runs/{DAG_ID}/{RUN_ID}`` (the job of that run, or its jobs).

Every route needs an Airflow login (``get_user``: JWT bearer or the UI's cookie) and read access to
the job's DAG (:mod:`airflow_deadline_batch.ui.access`). The store is the one named by
``ADB_STORE_URL``, else the connection in ``ADB_STORE_CONN_ID`` / ``[deadline_batch]
store_conn_id``, else the SQLite default. The api-server keeps one open store for the URL these
resolve to: the environment is read at every call and a connection every :data:`STORE_URL_TTL_S`,
so an edited URL or connection takes effect without a restart. The jobs view reads it within
:data:`PAGE_BUDGET` (a person, and one of the api-server's workers, wait on each page); the OpenAI
routes, which also write, with the workers' budget.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import get_user
from airflow.exceptions import AirflowNotFoundException
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from sqlalchemy.exc import TimeoutError as PoolTimeout  # every pooled connection busy past the budget

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.links.progress import PLUGIN_URL_PREFIX, DeadlineBatchProgressLink
from airflow_deadline_batch.plugins.priority import DeadlineWeightStrategy
from airflow_deadline_batch.store.engine import DEFAULT_BUDGET, StoreBudget, is_statement_timeout

if TYPE_CHECKING:
    from airflow_deadline_batch.store import JobRow, ManifestStore

UTC = dt.timezone.utc
T = TypeVar("T")
log = logging.getLogger(__name__)
#: jobs the list shows at most, newest first (their rows are read together: a page view stays bounded)
LIST_LIMIT = 50
#: input lines whose jobs' rows the jobs list reads together at most (the commits grow with the
#: records: 50 jobs of a 10M-record night read at once would be millions of rows in the api-server)
ROWS_BATCH_LINES = 2_000_000
#: jobs a run's tab looks through for that run's (one read)
RUN_SCAN_LIMIT = 500
#: bytes of the manifest read and sent at a time
MANIFEST_CHUNK_BYTES = 1024 * 1024


#: seconds a store URL resolved from an Airflow connection is used before the connection is read
#: again (a page refreshes every few seconds; a secrets backend need not be asked each time)
STORE_URL_TTL_S = 30.0
_monotonic = time.monotonic

#: how long a page of the jobs view waits for the store: a PostgreSQL host that drops packets (or
#: is down) fails the one connect after 2 s, a query that hangs (a lock another session holds) is
#: cancelled after 5 s, and neither is tried again (the page is reloaded, or a person reloads it).
#: The workers' and operators' budget rides out a fail-over instead: about a minute of retries.
PAGE_BUDGET = StoreBudget(connect_timeout_s=2, attempts=1, pool_timeout_s=5.0, statement_timeout_s=5.0)


@dataclass(frozen=True)
class _Resolved:
    conn_id: str | None
    url: str
    at: float


_lock = threading.Lock()
_resolved: _Resolved | None = None
#: per budget, the open store and the URL it was opened with (``ManifestStore.url`` is normalised,
#: its password hidden: comparing that with the configured URL would reopen the store at every call)
_open: dict[StoreBudget, tuple[str, ManifestStore]] = {}


def _store_conn_id() -> str | None:
    conn_id = os.environ.get("ADB_STORE_CONN_ID")
    if conn_id:
        return conn_id
    try:
        from airflow.configuration import conf

        return conf.get("deadline_batch", "store_conn_id", fallback=None)
    except Exception:  # no such section: fall back to the URL / default
        return None


def _store_url() -> str:
    """``ADB_STORE_URL`` (read at every call), else the connection's URL (read every TTL), else default."""
    global _resolved
    url = os.environ.get("ADB_STORE_URL")
    if url:
        return url
    from airflow_deadline_batch.hooks.store import ManifestStoreHook

    conn_id, now = _store_conn_id(), _monotonic()
    cached = _resolved
    if cached is None or cached.conn_id != conn_id or now - cached.at >= STORE_URL_TTL_S:
        cached = _resolved = _Resolved(conn_id, ManifestStoreHook(store_conn_id=conn_id).get_store_url(), now)
    return cached.url


class StoreUnavailable(ConfigurationError):
    """The configured store cannot be opened: its URL or connection is missing or malformed.

    A :class:`ConfigurationError`, as the errors it stands for were to the OpenAI routes, which
    open the same store; the jobs view tells it from a job's own configuration errors.
    """


class JobUnreadable(Exception):
    """A job's rows cannot be read as a job view (a config the view refuses, rows out of shape)."""

    def __init__(self, job_id: str, cause: Exception) -> None:
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"job {job_id} cannot be shown: {reason}")


def _store(budget: StoreBudget = DEFAULT_BUDGET) -> ManifestStore:
    """The store the configuration names now, opened once per URL and ``budget``; a store left
    behind is closed. The default budget is the workers' (the OpenAI routes)."""
    from airflow_deadline_batch.hooks.store import ManifestStoreHook

    try:
        url = _store_url()
    except (ConfigurationError, AirflowNotFoundException) as exc:
        raise StoreUnavailable(str(exc)) from exc
    with _lock:
        current = _open.get(budget)
        if current is not None and current[0] == url:
            return current[1]
        try:
            store = ManifestStoreHook(store_url=url).get_store(budget=budget)
        except ConfigurationError as exc:  # the URL's scheme: not a store we know
            raise StoreUnavailable(str(exc)) from exc
        _open[budget] = (url, store)
        if current is not None:
            current[1].close()  # its pooled connections; a request still using it reconnects
        return store


def _page_store() -> ManifestStore:
    """The store as the jobs view reads it: within :data:`PAGE_BUDGET`."""
    return _store(PAGE_BUDGET)


def reset_store() -> None:
    """Forget the resolved URL and close the open stores (tests; a later call opens them again)."""
    global _resolved
    with _lock:
        for _, store in _open.values():
            store.close()
        _resolved = None
        _open.clear()


def _batches(jobs: list[JobRow], max_lines: int) -> Iterator[list[JobRow]]:
    """``jobs`` in order, in consecutive batches of at most ``max_lines`` input lines (a job of
    more lines is a batch alone)."""
    batch: list[JobRow] = []
    lines = 0
    for job in jobs:
        if batch and lines + job.input_lines > max_lines:
            yield batch
            batch, lines = [], 0
        batch.append(job)
        lines += job.input_lines
    if batch:
        yield batch


def _now() -> dt.datetime:
    return dt.datetime.now(UTC)


#: what a page or API call answers when the store cannot be opened or read (never its URL: secrets)
STORE_UNAVAILABLE = (
    "The deadline-batch store cannot be read from the api-server: check ADB_STORE_URL or the store"
    " connection, and that its database is up (the api-server log has the reason)."
)


#: what a page or API call answers when every pooled connection stayed busy past the budget's wait
STORE_BUSY = (
    "Every connection of the api-server to the deadline-batch store is busy with other reads:"
    " reload the page in a few seconds."
)


def store_too_slow() -> str:
    """What a page or API call answers when PostgreSQL cancelled its read at the statement timeout."""
    return (
        "The deadline-batch store did not answer within the jobs view's statement timeout"
        f" ({PAGE_BUDGET.statement_timeout_s:g} s): a long query or a lock on its tables holds it"
        " up; reload the page (the api-server log has the statement)."
    )


#: the pages hold no script and load nothing (``ui.render``): a browser that honours this runs no
#: script there even if a value ever escaped its escaping, and only Airflow's own UI may frame them
PAGE_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'self'"
)


class _JobsViewRoute(APIRoute):
    """A route of the jobs view: its pages carry :data:`PAGE_CSP`; a store that is down,
    misconfigured or busy (no pooled connection free within the budget) answers 503 with one line
    (one naming the statement timeout when PostgreSQL cancelled a read that ran past it), a job
    whose rows cannot be shown 500 with one line.

    Without this the error would be an unhandled exception: a bare 500 in the UI's iframe and a
    traceback in the log with nothing said to the user. HTML routes answer a page, the JSON API
    ``{"detail": ...}`` like its other errors. A job that does not exist is the route's own 404.
    Every response says ``nosniff``: the manifest is served as stored.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        from airflow_deadline_batch.exceptions import JobNotFound, StoreError

        handler = super().get_route_handler()
        html = isinstance(self.response_class, type) and issubclass(self.response_class, HTMLResponse)

        def answer(request: Request, status: int, title: str, message: str) -> Response:
            if not html:
                return JSONResponse({"detail": message}, status_code=status)
            from airflow_deadline_batch.ui.render import render_message

            return HTMLResponse(render_message(title, message, prefix=_prefix(request)), status_code=status)

        async def guarded(request: Request) -> Response:
            try:
                response = await handler(request)
            except JobNotFound:
                raise
            except (StoreError, StoreUnavailable, PoolTimeout) as exc:
                log.warning("deadline-batch store unavailable for %s: %s", request.url.path, exc)
                if isinstance(exc, PoolTimeout):
                    response = answer(request, 503, "Store busy", STORE_BUSY)
                elif is_statement_timeout(exc):
                    response = answer(request, 503, "Store too slow", store_too_slow())
                else:
                    response = answer(request, 503, "Store unavailable", STORE_UNAVAILABLE)
            except JobUnreadable as exc:
                response = answer(request, 500, "Job cannot be shown", f"{exc} (the api-server log has more)")
            if html:
                response.headers["Content-Security-Policy"] = PAGE_CSP
            response.headers["X-Content-Type-Options"] = "nosniff"
            return response

        return guarded


def _prefix(request: Request) -> str:
    """Where the app is mounted (the pages' links start here)."""
    return str(request.scope.get("root_path") or PLUGIN_URL_PREFIX).rstrip("/")


def create_app() -> FastAPI:
    """The FastAPI sub-application mounted under ``/deadline-batch`` by Airflow's API server.

    FastAPI reads the routes' annotations at runtime, so the names they use (``Request``,
    ``BaseUser``) are module globals, not imports inside this function.
    """
    from airflow_deadline_batch.exceptions import DeadlineBatchError, JobNotFound, StoreError
    from airflow_deadline_batch.triggers.completeness import plain
    from airflow_deadline_batch.ui import model, render
    from airflow_deadline_batch.ui.access import may_read

    app = FastAPI(title="Deadline Batch", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = _JobsViewRoute  # the jobs view's routes; not the OpenAI router's
    user_dep = Depends(get_user)

    def readable_job(job_id: str, user: BaseUser) -> JobRow:
        try:
            job = _page_store().get_job(job_id)
        except JobNotFound as exc:
            raise HTTPException(status_code=404, detail=f"no deadline-batch job {job_id}") from exc
        if not may_read(user, model.planned_by(job.idempotency_key)):
            raise HTTPException(status_code=403, detail="Forbidden")
        return job

    def readable_jobs(user: BaseUser) -> tuple[list[JobRow], int]:
        jobs = _page_store().list_jobs(limit=LIST_LIMIT)
        allowed: dict[str | None, bool] = {}
        shown = []
        for job in jobs:
            owner = model.planned_by(job.idempotency_key)
            key = owner.dag_id if owner else None
            if key not in allowed:
                allowed[key] = may_read(user, owner)
            if allowed[key]:
                shown.append(job)
        return shown, len(jobs) - len(shown)

    def readable_view(job_id: str, read: Callable[[], T]) -> T:
        """``read()`` of one job's view; anything but the store failing is that job's rows (logged)."""
        try:
            return read()
        except (StoreError, StoreUnavailable, PoolTimeout):
            raise
        except Exception as exc:
            log.exception("deadline-batch job %s cannot be shown", job_id)
            raise JobUnreadable(job_id, exc) from exc

    def summary_of(job: JobRow, now: dt.datetime) -> model.JobSummary:
        return readable_view(job.job_id, lambda: model.read_job_summary(_page_store(), job, now=now))

    def page_of(job_id: str) -> model.JobPage:
        return readable_view(job_id, lambda: model.read_job_page(_page_store(), job_id, now=_now()))

    def summaries(jobs: list[JobRow]) -> tuple[list[model.JobSummary], int]:
        """The jobs' rows in the list, and how many could not be shown (each logged): one job's
        rows that the view refuses must not take every other job's off the list. The rows of all
        the jobs are read together (``rows_of_jobs``), not three reads per job, in batches of at
        most :data:`ROWS_BATCH_LINES` input lines (a job larger than that alone), so the rows held
        at once stay about one large job's."""
        now, shown = _now(), []
        for batch in _batches(jobs, ROWS_BATCH_LINES):
            rows = _page_store().rows_of_jobs([job.job_id for job in batch])
            for job in batch:
                try:
                    shown.append(
                        readable_view(
                            job.job_id, partial(model.summary_of_rows, job, rows[job.job_id], now=now)
                        )
                    )
                except JobUnreadable:
                    continue
        return shown, len(jobs) - len(shown)

    @app.get("/jobs", response_class=HTMLResponse)
    def jobs_page(request: Request, user: BaseUser = user_dep) -> str:
        jobs, hidden = readable_jobs(user)
        shown, unreadable = summaries(jobs)
        return render.render_jobs_page(shown, prefix=_prefix(request), hidden=hidden, unreadable=unreadable)

    @app.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(job_id: str, request: Request, user: BaseUser = user_dep) -> str:
        readable_job(job_id, user)
        return render.render_job_page(page_of(job_id), prefix=_prefix(request))

    @app.get("/runs/{dag_id}/{run_id:path}", response_class=HTMLResponse)
    def run_page(dag_id: str, run_id: str, request: Request, user: BaseUser = user_dep) -> str:
        """The tab on a DAG run / task instance page: that run's job, or the list of its jobs."""
        if not may_read(user, model.DagRunRef(dag_id=dag_id, run_id=run_id, task_id="")):
            raise HTTPException(status_code=403, detail="Forbidden")
        jobs = [
            job
            for job in _page_store().list_jobs(limit=RUN_SCAN_LIMIT)
            if (ref := model.planned_by(job.idempotency_key)) and (ref.dag_id, ref.run_id) == (dag_id, run_id)
        ]
        if len(jobs) == 1:
            return render.render_job_page(page_of(jobs[0].job_id), prefix=_prefix(request))
        if not jobs:
            return render.render_message(
                "No deadline-batch job",
                f"Run {run_id} of {dag_id} planned no deadline-batch job"
                f" (among the latest {RUN_SCAN_LIMIT}).",
                prefix=_prefix(request),
            )
        shown, unreadable = summaries(jobs[:LIST_LIMIT])  # bounded like the list: newest first
        return render.render_jobs_page(
            shown, prefix=_prefix(request), unreadable=unreadable, unlisted=len(jobs) - len(jobs[:LIST_LIMIT])
        )

    @app.get("/api/jobs")
    def jobs_json(user: BaseUser = user_dep) -> list[dict[str, Any]]:
        jobs, _ = readable_jobs(user)
        return [model.plain_summary(s) for s in summaries(jobs)[0]]

    @app.get("/api/jobs/{job_id}")
    def job_json(job_id: str, user: BaseUser = user_dep) -> dict[str, Any]:
        job = readable_job(job_id, user)
        summary = summary_of(job, _now())
        progress = readable_view(job_id, lambda: _page_store().progress(job_id))
        return {**plain(progress), **model.plain_summary(summary), "job_id": job_id}

    @app.get("/api/jobs/{job_id}/manifest")
    def manifest(job_id: str, user: BaseUser = user_dep) -> Response:
        """The published manifest's bytes as stored (JSON by construction), streamed: a job of many
        microbatches has a manifest of many megabytes, which is neither held whole nor re-parsed."""
        from airflow_deadline_batch.storage import open_uri

        job = readable_job(job_id, user)
        if not job.manifest_uri:
            raise HTTPException(status_code=404, detail=f"job {job_id} has no published manifest yet")

        def unreadable(exc: Exception) -> HTTPException:  # object storage unreachable from here
            return HTTPException(status_code=502, detail=f"cannot read {job.manifest_uri}: {exc}")

        try:
            storage, key = open_uri(job.manifest_uri)
            reader = storage.open_read(key)
        except DeadlineBatchError as exc:
            raise unreadable(exc) from exc
        try:
            first = reader.read(MANIFEST_CHUNK_BYTES)  # unreadable storage fails here, before the 200
        except DeadlineBatchError as exc:
            reader.close()
            raise unreadable(exc) from exc

        def chunks() -> Iterator[bytes]:
            try:
                chunk = first
                while chunk:
                    yield chunk
                    chunk = reader.read(MANIFEST_CHUNK_BYTES)
            finally:
                reader.close()

        return StreamingResponse(chunks(), media_type="application/json")

    from airflow_deadline_batch.api.openai_batches import create_router

    # the OpenAI Files and Batches API (docs/openai.md): OpenAI(base_url=".../deadline-batch/openai/v1")
    app.include_router(create_router(), prefix="/openai/v1")
    return app


#: where the views show up in Airflow's UI; ``{DAG_ID}``/``{RUN_ID}`` are filled in by the UI
EXTERNAL_VIEWS = [
    {
        "name": "Deadline Batch",
        "href": f"{PLUGIN_URL_PREFIX}/jobs",
        "url_route": "deadline-batch",
        "destination": "nav",
        "category": "browse",
    },
    {
        "name": "Deadline Batch",
        "href": f"{PLUGIN_URL_PREFIX}/runs/{{DAG_ID}}/{{RUN_ID}}",
        "url_route": "deadline-batch-run",
        "destination": "dag_run",
    },
    {
        "name": "Deadline Batch",
        "href": f"{PLUGIN_URL_PREFIX}/runs/{{DAG_ID}}/{{RUN_ID}}",
        "url_route": "deadline-batch-task",
        "destination": "task_instance",
    },
]


class DeadlineBatchPlugin(AirflowPlugin):
    """Registers the progress link, the FastAPI app and its views in Airflow's UI, and the weight rule."""

    name = "deadline_batch"
    operator_extra_links = [DeadlineBatchProgressLink()]
    priority_weight_strategies = [DeadlineWeightStrategy]
    fastapi_apps = [{"app": create_app(), "url_prefix": PLUGIN_URL_PREFIX, "name": "Deadline Batch"}]
    external_views = EXTERNAL_VIEWS
