"""OpenAI's Files and Batches API on top of DAG runs: ``/deadline-batch/openai/v1`` (docs/openai.md).

The official SDK works unchanged::

    OpenAI(base_url="https://airflow.example/deadline-batch/openai/v1", api_key=<Airflow JWT>)

* Files live in the files store (``ADB_FILES_URI`` / ``[deadline_batch] files_uri``: a folder or
  ``s3://bucket/prefix``), never in the metadata database: ``files/<id>/content`` (the upload,
  streamed from the request's spool file) and ``files/<id>/meta.json`` (id, bytes, created_at,
  filename, purpose; an exported file's meta points at the export's object instead).
* A batch is one run of the batch DAG (``ADB_BATCH_DAG_ID`` / ``[deadline_batch] batch_dag_id``,
  default ``example_deadline_batch_local``) whose ``run_id`` is the batch id; its sidecar
  ``batches/<id>.json`` in the files store records the request, the run and, once exported, the
  output files. The run is triggered through Airflow's own REST API with the caller's token, so
  Airflow's authorization (``POST`` on the DAG's runs) decides; reads check ``GET`` on the DAG's
  runs (:func:`ui.access.may_read`) and read the run's state from the metadata database.
* ``batches-index/<inverted created_at>-<id>``, an empty pointer per batch, sorts newest first, so
  ``GET /batches`` lists the index only as far as its page and reads only the sidecars it returns
  (:func:`list_page`).
* The job is the one whose idempotency key is ``{dag_id}/{run_id}/{plan_task_id}``
  (``DeadlineBatchOperator``'s default); once its manifest is published, the first read exports
  it (``service.export.export_job``) under ``runs/<id>/export`` and names ``output.jsonl`` /
  ``errors.jsonl`` as files.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import orjson
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import get_user
from fastapi import APIRouter, Body, Depends, File, Form, HTTPException, Request, Response, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_deadline_batch.api.status import (
    PUBLISHED_JOB_STATES,
    TERMINAL_STATUSES,
    UNFINISHED_JOB_STATES,
    batch_status,
)
from airflow_deadline_batch.config import DEFAULT_BATCH_DAG_ID, DEFAULT_PLAN_TASK_ID

if TYPE_CHECKING:
    from airflow_deadline_batch.storage.base import ObjectStorage
    from airflow_deadline_batch.store import JobRow, ManifestStore

log = logging.getLogger(__name__)
UTC = dt.timezone.utc

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
#: OpenAI's limits on a batch's ``metadata``: pairs, key and value lengths (strings only)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
#: ``completion_window``: a number of hours or minutes (OpenAI accepts only ``24h``)
_WINDOW = re.compile(r"^([1-9][0-9]*)([hm])$")
#: more digits than this in a ``completion_window`` are past the year 9999 without parsing them
#: (Python refuses to parse a number of over 4,300 digits)
WINDOW_DIGITS = 18
#: how much of a refused value an error message repeats
SHOWN_CHARS = 100
_ID = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
LIST_MAX = 100
COPY_CHUNK = 1024 * 1024
SIDECARS = "batches/"
INDEX = "batches-index/"
#: ``created_at`` (epoch seconds) is stored as ``INDEX_CEILING - created_at``, zero-padded to 12
#: digits, so that lexicographic key order (what ``list_keys`` yields) is newest first
INDEX_CEILING = 10**12 - 1
#: written once every sidecar has a pointer (those from before the index got theirs, once per files
#: store); from then on a listing reads the index alone
INDEXED = "batches-index.done"
#: the ``INDEXED`` markers this process has seen (it checks a files store's marker once)
_indexed: set[str] = set()
#: how often a sidecar change is tried against concurrent writers before the request gives up
SIDECAR_TRIES = 20


# -- configuration ----------------------------------------------------------------------------------
def _setting(env: str, key: str, default: str | None) -> str | None:
    value = os.environ.get(env)
    if value:
        return value
    try:
        from airflow.configuration import conf

        return conf.get("deadline_batch", key, fallback=default)
    except Exception:  # no such section
        return default


def files_uri() -> str:
    uri = _setting("ADB_FILES_URI", "files_uri", None)
    if not uri:
        raise HTTPException(
            status_code=503,
            detail="no files store configured: set [deadline_batch] files_uri or ADB_FILES_URI",
        )
    return uri


def batch_dag_id() -> str:
    return _setting("ADB_BATCH_DAG_ID", "batch_dag_id", DEFAULT_BATCH_DAG_ID) or DEFAULT_BATCH_DAG_ID


def plan_task_id() -> str:
    return (
        _setting("ADB_BATCH_PLAN_TASK_ID", "batch_plan_task_id", DEFAULT_PLAN_TASK_ID) or DEFAULT_PLAN_TASK_ID
    )


@functools.lru_cache(maxsize=4)
def _open_files(uri: str) -> ObjectStorage:
    from airflow_deadline_batch.storage import open_storage

    return open_storage(uri)


def _files() -> ObjectStorage:
    return _open_files(files_uri())


def _now() -> dt.datetime:
    return dt.datetime.now(UTC)


def _ts(value: dt.datetime | None) -> int | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return int(value.timestamp())


# -- the files store ----------------------------------------------------------------------------------
def _read_json(storage: ObjectStorage, key: str) -> dict[str, Any] | None:
    from airflow_deadline_batch.exceptions import ObjectNotFound

    try:
        return dict(orjson.loads(storage.get_bytes(key)))
    except ObjectNotFound:
        return None


def _json_bytes(value: dict[str, Any]) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE)


def _write_json(storage: ObjectStorage, key: str, value: dict[str, Any]) -> None:
    storage.put_bytes(key, _json_bytes(value))


def _file_meta_key(file_id: str) -> str:
    return f"files/{file_id}/meta.json"


def _file_object(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": meta["id"],
        "object": "file",
        "bytes": meta["bytes"],
        "created_at": meta["created_at"],
        "filename": meta["filename"],
        "purpose": meta["purpose"],
        "status": "processed",
        "status_details": None,
    }


def _filename(given: str | None) -> str:
    """The upload's name as a file object shows it: its last path segment (``/`` or ``\\``) without
    control characters; ``input.jsonl`` when nothing is left (``../``, ``..``). It names no key."""
    name = "".join(c for c in re.split(r"[/\\]", given or "")[-1] if c.isprintable())
    return name if name not in ("", ".", "..") else "input.jsonl"


def _shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to :data:`SHOWN_CHARS`: a 5 MB field refused is
    not sent back whole."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _checked_id(value: str, what: str) -> str:
    if not _ID.match(value):
        raise HTTPException(status_code=404, detail=f"no such {what}: {_shown(value)}")
    return value


def _file_meta(file_id: str) -> dict[str, Any]:
    meta = _read_json(_files(), _file_meta_key(_checked_id(file_id, "file")))
    if meta is None:
        raise HTTPException(status_code=404, detail=f"no such file: {file_id}")
    return meta


def _open_content(meta: dict[str, Any]) -> BinaryIO:
    """The file's bytes; a 404 ``file_not_found`` naming the file when its object is gone (an
    export's deleted from ``runs/<batch>/export``, an upload's from ``files/<id>``), not a 500."""
    from airflow_deadline_batch.exceptions import ObjectNotFound
    from airflow_deadline_batch.storage import open_uri

    try:
        if meta.get("uri"):
            storage, key = open_uri(str(meta["uri"]))
            return storage.open_read(key)
        return _files().open_read(f"files/{meta['id']}/content")
    except ObjectNotFound as exc:
        raise Refused(
            404,
            f"file {meta['id']} has no content any more: its object was deleted ({exc})",
            code="file_not_found",
        ) from exc


# -- batch sidecars and their index ------------------------------------------------------------------
def _sidecar_key(batch_id: str) -> str:
    return f"{SIDECARS}{batch_id}.json"


def index_key(batch_id: str, created_at: int) -> str:
    """The batch's pointer: keys sort newest first, then by id."""
    return f"{INDEX}{INDEX_CEILING - created_at:012d}-{batch_id}"


def _indexed_id(key: str) -> str:
    return key.removeprefix(INDEX).partition("-")[2]


def record_batch(storage: ObjectStorage, batch: dict[str, Any]) -> None:
    """Write a new batch's index pointer, then its sidecar: every sidecar has a pointer, so a listing
    need not look for sidecars without one; a pointer whose sidecar is missing (not written yet, or
    its process died between the two writes) is skipped by listings."""
    storage.put_bytes(index_key(batch["id"], int(batch["created_at"])), b"")
    _write_json(storage, _sidecar_key(batch["id"]), batch)


def forget_batch(storage: ObjectStorage, batch: dict[str, Any]) -> None:
    """Remove a batch whose run was never created (Airflow refused it, or was unreachable): its
    sidecar, then its pointer (a pointer without a sidecar is skipped meanwhile), so that a create
    the client saw fail is not listed, ``validating`` for ever."""
    storage.delete(_sidecar_key(batch["id"]))
    storage.delete(index_key(batch["id"], int(batch["created_at"])))


def update_sidecar(
    storage: ObjectStorage, batch_id: str, change: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any] | None:
    """Apply ``change`` to the batch's sidecar as it is now; the sidecar written, or ``None`` when
    there is none (the batch was forgotten).

    A compare-and-swap (``storage.put_if_version``: ``If-Match`` on S3, a directory lock on local
    files): several api-server processes, or requests of one, change a sidecar (the cancel request,
    the export record, the job found for a failed run), and a plain read-modify-write let the last
    writer drop the others' changes (a cancel lost, an export recorded and then erased, so done
    again). On a conflict the sidecar is read again and ``change`` applied to what is there, so
    ``change`` must decide from its argument alone; one that returns its argument unchanged writes
    nothing. After :data:`SIDECAR_TRIES` conflicts in a row the request fails with a 503.
    """
    from airflow_deadline_batch.exceptions import ObjectChanged, ObjectNotFound
    from airflow_deadline_batch.storage.base import put_if_version, read_versioned

    key = _sidecar_key(batch_id)
    for attempt in range(SIDECAR_TRIES):
        try:
            data, version = read_versioned(storage, key)
        except ObjectNotFound:
            return None
        current = dict(orjson.loads(data))
        changed = change(current)
        if changed == current:
            return current
        try:
            put_if_version(storage, key, _json_bytes(changed), version)
        except ObjectChanged:
            # jittered, growing: writers that collided do not collide again in step
            time.sleep(random.uniform(0, min(0.02 * 2**attempt, 1.0)))
            continue
        return changed
    raise HTTPException(
        status_code=503,
        detail=f"batch {batch_id}: its sidecar {storage.uri(key)} changed under this request"
        f" {SIDECAR_TRIES} times in a row (as many concurrent writers); retry the request",
    )


def _index_once(storage: ObjectStorage) -> None:
    """Give sidecars written before the index existed their pointers, once per files store.

    Then the :data:`INDEXED` marker is written; a process checks for it once, so a listing after
    the first lists the index alone.
    """
    marker = storage.uri(INDEXED)
    if marker in _indexed:
        return
    if not storage.exists(INDEXED):
        _repair_index(storage)
        storage.put_bytes(INDEXED, b"")
    _indexed.add(marker)


def _repair_index(storage: ObjectStorage) -> None:
    """Pointers for sidecars that have none: two listings, and one read per missing pointer."""
    have = {_indexed_id(key) for key in storage.list_keys(INDEX)}
    for key in storage.list_keys(SIDECARS):
        batch_id = key.removeprefix(SIDECARS).removesuffix(".json")
        if not key.endswith(".json") or "/" in batch_id or batch_id in have:
            continue
        batch = _read_json(storage, key)
        if batch is None:  # deleted since the listing
            continue
        pointer = index_key(batch_id, int(batch["created_at"]))
        storage.put_bytes(pointer, b"")  # the same empty object whoever repairs it first
        log.info("indexed batch %s (its sidecar had no pointer)", batch_id)


@dataclass(frozen=True)
class Page:
    batches: list[dict[str, Any]]
    has_more: bool


def list_page(
    storage: ObjectStorage, after: str | None, limit: int, readable: Callable[[dict[str, Any]], bool]
) -> Page:
    """The sidecars of up to ``limit`` readable batches, newest first, after the batch ``after``.

    One listing of the index, consumed only up to the page's last pointer and one more (S3 lists
    1,000 keys a request), and one read per sidecar looked at: the returned ones, the unreadable
    ones skipped, and one more for ``has_more``.
    """
    _index_once(storage)
    keys = iter(storage.list_keys(INDEX))
    if after and not any(_indexed_id(key) == after for key in keys):
        return Page([], has_more=False)  # not a batch: nothing after it
    shown: list[dict[str, Any]] = []
    for key in keys:
        batch = _read_json(storage, _sidecar_key(_indexed_id(key)))
        if batch is None or not readable(batch):
            continue
        if len(shown) == limit:
            return Page(shown, has_more=True)
        shown.append(batch)
    return Page(shown, has_more=False)


# -- the batch's DAG run and job ----------------------------------------------------------------------
@dataclass(frozen=True)
class RunInfo:
    state: str | None
    start_date: dt.datetime | None = None
    end_date: dt.datetime | None = None


def _dag_run(dag_id: str, run_id: str) -> RunInfo:
    """The run's state from the metadata database (the api-server's own session)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.execute(
            select(DagRun.state, DagRun.start_date, DagRun.end_date).where(
                DagRun.dag_id == dag_id, DagRun.run_id == run_id
            )
        ).first()
    if row is None:
        return RunInfo(None)
    state = row[0]
    return RunInfo(str(getattr(state, "value", state)) if state is not None else None, row[1], row[2])


def _store() -> ManifestStore:
    from airflow_deadline_batch.plugins.progress import _store as plugin_store

    return plugin_store()


#: jobs, newest first, a failed run's batch looks through for the job its plan rejected (as the jobs
#: view's run tab does)
REJECTED_SCAN_LIMIT = 500


def _job(batch: dict[str, Any], run: RunInfo) -> JobRow | None:
    """The batch's job: the recorded one, else the one holding the plan's idempotency key, else (a
    failed run) the one its plan rejected, looked for once per end of the run."""
    from airflow_deadline_batch.core.ids import submitted_key
    from airflow_deadline_batch.exceptions import JobNotFound

    store = _store()
    if batch.get("job_id"):
        try:
            return store.get_job(str(batch["job_id"]))
        except JobNotFound:
            return None
    key = f"{batch['dag_id']}/{batch['run_id']}/{batch['plan_task_id']}"
    job = store.get_job_by_idempotency_key(key)
    if job is not None or run.state != "failed":
        return job
    ended = run.end_date.isoformat() if run.end_date is not None else None
    if ended is not None and batch.get("rejected_job_missed") == ended:
        return None  # looked for when the run ended this time, and not found
    # a job rejected at admission gives its key up: found among the latest jobs, and recorded,
    # so the batch's error is the rejection's reason rather than "DAG run ... ended failed"
    job = next(
        (
            row
            for row in store.list_jobs(limit=REJECTED_SCAN_LIMIT)
            if row.state.value == "rejected" and submitted_key(row.idempotency_key or "") == key
        ),
        None,
    )
    if job is not None:
        found = job.job_id
        update_sidecar(_files(), batch["id"], lambda now: {**now, "job_id": now.get("job_id") or found})
    elif ended is not None:
        # Not found: recorded with the run's end, so later reads do not scan 500 jobs again. The
        # plan writes its rejected job before the plan task fails, so the job cannot appear later
        # for this end of the run; a run cleared and failed again has another end and is searched
        # again. (A run marked failed by hand while its plan still runs may have its rejection
        # recorded afterwards: the batch then says only that the run failed.)
        update_sidecar(_files(), batch["id"], lambda now: {**now, "rejected_job_missed": ended})
    return job


_export_lock = threading.Lock()


class ExportLost(Exception):
    """The published job cannot be exported: its manifest or result objects are gone or changed."""


def _export_once(batch: dict[str, Any], job: JobRow) -> dict[str, Any]:
    """Export a published job into the files store once; the batch sidecar as it is then.

    ``ExportLost`` when the job's outputs do not verify (deleted, changed): nothing is recorded,
    so restoring them lets a later read export.
    """
    from airflow_deadline_batch.exceptions import (
        ChecksumMismatch,
        DeadlineBatchError,
        ObjectNotFound,
        VerificationError,
    )
    from airflow_deadline_batch.service.export import export_job

    storage = _files()
    with _export_lock:  # one export at a time in this process; another process's writes the same bytes
        current = _read_json(storage, _sidecar_key(batch["id"])) or batch
        if current.get("exported"):
            return current
        try:
            result = export_job(_store(), job.job_id, storage.uri(f"runs/{batch['id']}/export"))
        except (VerificationError, ObjectNotFound, ChecksumMismatch) as exc:
            raise ExportLost(f"cannot export job {job.job_id}: {exc}") from exc
        except DeadlineBatchError as exc:  # storage unreachable
            detail = f"cannot export job {job.job_id} of batch {batch['id']}: {exc}"
            raise HTTPException(status_code=500, detail=detail) from exc
        created = _ts(_now())
        file_ids: dict[str, str | None] = {}
        for exported in result.files:
            if exported.name not in ("output.jsonl", "errors.jsonl"):
                continue
            kind = "output" if exported.name == "output.jsonl" else "errors"
            file_id = f"file-{batch['id'].removeprefix('batch_')}-{kind}"
            _write_json(
                storage,
                _file_meta_key(file_id),
                {
                    "id": file_id,
                    "bytes": exported.bytes,
                    "created_at": created,
                    "filename": exported.name,
                    "purpose": "batch_output",
                    "uri": exported.uri,
                    "batch_id": batch["id"],
                },
            )
            file_ids[kind] = file_id if exported.lines else None
        record = {
            "job_id": job.job_id,
            "exported": {"outcomes": dict(result.outcomes), "at": created},
            "output_file_id": file_ids.get("output"),
            "error_file_id": file_ids.get("errors"),
        }
        # what else changed meanwhile (a cancel request) is kept; an export recorded meanwhile
        # (another process's, of the same bytes) stays as it is
        written = update_sidecar(
            storage, batch["id"], lambda now: now if now.get("exported") else {**now, **record}
        )
        return written if written is not None else {**current, **record}


def _cancel_job(job_id: str) -> None:
    """What ``deadline-batch cancel`` does: fence the job, then publish its ``cancelled`` manifest."""
    from airflow_deadline_batch.exceptions import InvalidTransition
    from airflow_deadline_batch.service.finalize import finalize_job

    store = _store()
    try:
        store.cancel_job(job_id)
    except InvalidTransition:  # published or failed first: nothing left to cancel
        return
    finalize_job(store, job_id)


def _request_counts(job: JobRow | None, batch: dict[str, Any]) -> dict[str, int]:
    exported = batch.get("exported")
    if exported:
        outcomes = {str(k): int(v) for k, v in exported["outcomes"].items()}
        total = sum(outcomes.values())
        return {
            "total": total,
            "completed": outcomes.get("succeeded", 0),
            "failed": total - outcomes.get("succeeded", 0),
        }
    if job is None:
        return {"total": 0, "completed": 0, "failed": 0}
    progress = _store().progress(job.job_id)
    return {"total": progress.total_records, "completed": progress.succeeded, "failed": progress.errored}


def _failure(job: JobRow | None) -> str | None:
    """Why the job failed: its error, or for a job rejected at admission the admission's reasons."""
    if job is None:
        return None
    if job.error:
        return job.error
    if job.state.value == "rejected" and job.admission:
        reasons = "; ".join(str(r) for r in job.admission.get("reasons") or ()) or "no reason recorded"
        return (
            f"job {job.job_id} rejected at admission ({job.admission.get('verdict', 'rejected')}): {reasons}"
        )
    return None


def _batch_object(batch: dict[str, Any]) -> dict[str, Any]:
    """Refresh the batch from its run and job (export, deferred cancel) and shape it as OpenAI does."""
    run = _dag_run(batch["dag_id"], batch["run_id"])
    job = _job(batch, run)
    if job is not None and batch.get("cancel_requested_at") and job.state.value in UNFINISHED_JOB_STATES:
        _cancel_job(job.job_id)  # asked before the job existed, or a cancel cut short
        job = _store().get_job(job.job_id)
    lost = None
    if (
        job is not None
        and job.manifest_uri
        and job.state.value in PUBLISHED_JOB_STATES
        and not batch.get("exported")
    ):
        try:
            batch = _export_once(batch, job)
        except ExportLost as exc:  # its results are gone: the batch failed (a 500 on every read hid it)
            lost = str(exc)
    outcomes = (batch.get("exported") or {}).get("outcomes") or {}
    status = batch_status(
        run.state,
        job.state.value if job is not None else None,
        exported=bool(batch.get("exported")),
        cancel_requested=bool(batch.get("cancel_requested_at")),
        expired_records=int(outcomes.get("expired", 0)),
    )
    if lost:
        status = "failed"
    done_at = (batch.get("exported") or {}).get("at")
    errors = None
    if status == "failed":
        message = lost or _failure(job) or f"DAG run {batch['run_id']} ended {run.state}"
        errors = {
            "object": "list",
            "data": [{"code": "batch_failed", "message": message, "line": None, "param": None}],
        }
    return {
        "id": batch["id"],
        "object": "batch",
        "endpoint": batch["endpoint"],
        "errors": errors,
        "input_file_id": batch["input_file_id"],
        "completion_window": batch["completion_window"],
        "status": status,
        "output_file_id": batch.get("output_file_id"),
        "error_file_id": batch.get("error_file_id"),
        "created_at": batch["created_at"],
        "in_progress_at": _ts(job.created_at) if job is not None else None,
        "expires_at": batch["expires_at"],
        "finalizing_at": _ts(job.completed_at) if job is not None and job.completed_at else None,
        "completed_at": done_at if status in ("completed", "expired") else None,
        "failed_at": _ts(run.end_date or _now()) if status == "failed" else None,
        "expired_at": done_at if status == "expired" else None,
        "cancelling_at": batch.get("cancel_requested_at"),
        "cancelled_at": done_at if status == "cancelled" else None,
        "request_counts": _request_counts(job, batch),
        "metadata": batch.get("metadata") or None,
        # not OpenAI's: where the batch runs
        "dag_id": batch["dag_id"],
        "dag_run_id": batch["run_id"],
        "job_id": job.job_id if job is not None else None,
        "terminal": status in TERMINAL_STATUSES,
    }


def _may_edit_runs(user: BaseUser, dag_id: str) -> bool:
    """``PUT`` on the DAG's runs: what Airflow asks of whoever changes a run's state."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    from airflow_deadline_batch.ui.access import _team_name

    details = DagDetails(id=dag_id, team_name=_team_name(dag_id))
    return bool(
        get_auth_manager().is_authorized_dag(
            method="PUT", access_entity=DagAccessEntity.RUN, details=details, user=user
        )
    )


# -- deadline and triggering --------------------------------------------------------------------------
def _metadata(value: Any) -> dict[str, str]:
    """The request's ``metadata`` within OpenAI's limits: up to 16 pairs of strings, keys up to 64
    characters, values up to 512 (a nested object or a number is refused, not stringified)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Refused(400, "metadata must be an object of strings", param="metadata")
    if len(value) > METADATA_PAIRS:
        raise Refused(
            400, f"metadata has {len(value)} pairs: at most {METADATA_PAIRS} are allowed", param="metadata"
        )
    for key, item in value.items():
        if len(key) > METADATA_KEY_CHARS:
            raise Refused(
                400,
                f"metadata key {key[:20]!r}... is longer than {METADATA_KEY_CHARS} characters",
                param="metadata",
            )
        if not isinstance(item, str):
            raise Refused(
                400, f"metadata.{key} must be a string, got {type(item).__name__}", param=f"metadata.{key}"
            )
        if len(item) > METADATA_VALUE_CHARS:
            raise Refused(
                400,
                f"metadata.{key} is {len(item)} characters long: at most {METADATA_VALUE_CHARS} are allowed",
                param=f"metadata.{key}",
            )
    return dict(value)


def _deadline(completion_window: str, metadata: dict[str, Any]) -> tuple[str, int]:
    """The DAG's ``deadline`` param and ``expires_at``: ``metadata.deadline`` if given, else the window."""
    from airflow_deadline_batch.core.deadlines import parse_deadline

    match = _WINDOW.match(completion_window or "")
    if not match:
        raise Refused(
            400,
            f"completion_window must look like '24h' or '90m', got {_shown(completion_window)}",
            param="completion_window",
        )
    given = metadata.get("deadline")
    if len(match[1]) > WINDOW_DIGITS and not given:
        raise Refused(
            400,
            f"completion_window {_shown(completion_window)} is past the year 9999: give a nearer one",
            param="completion_window",
        )
    amount, unit = int(match[1][:WINDOW_DIGITS]), match[2]  # the window is unused when a deadline is given
    try:
        at = parse_deadline(str(given or f"+{amount}{unit}"), now=_now())
    except ValueError as exc:
        raise Refused(400, f"metadata.deadline: {exc}", param="metadata.deadline") from exc
    except OverflowError:  # a duration past what a datetime holds (year 9999)
        param = "metadata.deadline" if given else "completion_window"
        raise Refused(
            400,
            f"{param} {_shown(given or completion_window)} is past the year 9999: give a nearer one",
            param=param,
        ) from None
    if at <= _now():  # the plan would reject it, and the batch would read only "DAG run ... ended failed"
        raise Refused(
            400, f"metadata.deadline {given!r} has passed: give a later one", param="metadata.deadline"
        )
    # an instant, not ``+24h``: the window runs from the request, not from when the plan task starts
    return at.astimezone(UTC).isoformat(), _ts(at) or 0


def _caller_token(request: Request) -> str:
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN

    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.cookies.get(COOKIE_NAME_JWT_TOKEN, "")


def _airflow_api_base(request: Request) -> str:
    base = _setting("ADB_AIRFLOW_API_URL", "airflow_api_url", None)
    if not base:
        try:
            from airflow.configuration import conf

            base = conf.get("api", "base_url", fallback=None)
        except Exception:
            base = None
    if not base:
        base = f"{request.url.scheme}://{request.url.netloc}"
    return base.rstrip("/")


def _trigger(request: Request, dag_id: str, run_id: str, conf: dict[str, Any]) -> None:
    """``POST /api/v2/dags/{dag_id}/dagRuns`` with the caller's token: Airflow's authorization applies."""
    import httpx

    url = f"{_airflow_api_base(request)}/api/v2/dags/{dag_id}/dagRuns"
    try:
        response = httpx.post(
            url,
            json={"dag_run_id": run_id, "logical_date": None, "conf": conf},
            headers={"Authorization": f"Bearer {_caller_token(request)}"},
            timeout=60.0,
        )
    except httpx.HTTPError as exc:
        raise HTTPException(
            status_code=502, detail=f"cannot reach Airflow's REST API at {url}: {exc}"
        ) from exc
    if response.status_code >= 300:
        try:
            detail: Any = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise HTTPException(status_code=response.status_code, detail=f"triggering {dag_id}: {detail}")


# -- errors -------------------------------------------------------------------------------------------
class Refused(HTTPException):
    """An HTTP error that names the request field at fault (OpenAI's ``error.param``) or its kind
    (``error.code``, such as ``file_not_found``)."""

    def __init__(
        self, status_code: int, detail: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(status_code=status_code, detail=detail)
        self.param = param
        self.code = code


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: the SDK's exceptions carry ``message`` (in their text), ``type``,
    ``param`` and ``code``; FastAPI's ``{"detail": ...}`` left them with only the status code."""
    kind = "server_error" if status_code >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _invalid_request(exc: RequestValidationError) -> tuple[str, str | None]:
    """FastAPI's validation errors (a missing form field, a query parameter that is not a number,
    a body that is not a JSON object) as one message, and the first field at fault."""
    problems, param = [], None
    for error in exc.errors():
        where = [str(part) for part in error.get("loc", ()) if part not in ("body", "query", "path")]
        param = param or (".".join(where) or None)
        problems.append(f"{'.'.join(where) or 'body'}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(problems), param


class OpenAIErrorRoute(APIRoute):
    """A route whose errors have OpenAI's shape: ``HTTPException`` (including Airflow's 401/403 from
    ``get_user``) keeps its status and headers, a request FastAPI cannot validate is a 400 (OpenAI's
    status for it, not 422), and an unexpected exception is a 500 naming it (and logged)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                response: Response = await handler(request)
                return response
            except StarletteHTTPException as exc:  # FastAPI's, and Starlette's for a body it cannot parse
                body = error_body(
                    exc.status_code, str(exc.detail), getattr(exc, "param", None), getattr(exc, "code", None)
                )
                return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
            except RequestValidationError as exc:
                message, param = _invalid_request(exc)
                return JSONResponse(error_body(400, message, param), status_code=400)
            except Exception as exc:
                log.exception("%s %s failed", request.method, request.url.path)
                message = (
                    f"the front door failed: {type(exc).__name__}: {exc} (the api-server's log has more)"
                )
                return JSONResponse(error_body(500, message), status_code=500)

        return route


# -- the routes ---------------------------------------------------------------------------------------
def create_router() -> APIRouter:
    """The ``/openai/v1`` routes; every one needs an Airflow login (``get_user``)."""
    from airflow_deadline_batch.ui.access import may_read
    from airflow_deadline_batch.ui.model import DagRunRef

    router = APIRouter(route_class=OpenAIErrorRoute)
    user_dep = Depends(get_user)

    def readable_batch(batch_id: str, user: BaseUser) -> dict[str, Any]:
        batch = _read_json(_files(), _sidecar_key(_checked_id(batch_id, "batch")))
        if batch is None:
            raise HTTPException(status_code=404, detail=f"no such batch: {batch_id}")
        if not may_read(user, DagRunRef(dag_id=batch["dag_id"], run_id=batch["run_id"], task_id="")):
            raise HTTPException(status_code=403, detail="Forbidden")
        return batch

    @router.post("/files")
    def upload_file(
        file: UploadFile = File(...),  # noqa: B008 - FastAPI's declaration
        purpose: str = Form(...),
        user: BaseUser = user_dep,
    ) -> dict[str, Any]:
        if purpose != "batch":
            raise Refused(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
        file_id = f"file-{uuid.uuid4().hex}"
        storage = _files()
        file.file.seek(0, os.SEEK_END)
        size = file.file.tell()
        file.file.seek(0)
        from airflow_deadline_batch.storage import put_stream

        put_stream(storage, f"files/{file_id}/content", file.file)  # chunked, atomic
        meta = {
            "id": file_id,
            "bytes": size,
            "created_at": _ts(_now()),
            "filename": _filename(file.filename),
            "purpose": purpose,
            "owner": user.get_name(),
        }
        _write_json(storage, _file_meta_key(file_id), meta)
        return _file_object(meta)

    @router.get("/files/{file_id}")
    def get_file(file_id: str, user: BaseUser = user_dep) -> dict[str, Any]:
        meta = _file_meta(file_id)
        if meta.get("batch_id"):  # an exported file: as its content, only for readers of its batch
            readable_batch(str(meta["batch_id"]), user)
        return _file_object(meta)

    @router.get("/files/{file_id}/content")
    def file_content(file_id: str, user: BaseUser = user_dep) -> StreamingResponse:
        meta = _file_meta(file_id)
        if meta.get("batch_id"):
            readable_batch(str(meta["batch_id"]), user)
        stream = _open_content(meta)

        def chunks() -> Iterator[bytes]:
            with stream:
                while chunk := stream.read(COPY_CHUNK):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    @router.post("/batches")
    def create_batch(
        request: Request,
        body: dict[str, Any] = Body(...),  # noqa: B008 - FastAPI's declaration
        user: BaseUser = user_dep,
    ) -> dict[str, Any]:
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise Refused(
                400,
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {_shown(endpoint)}",
                param="endpoint",
            )
        metadata = _metadata(body.get("metadata"))
        window = str(body.get("completion_window") or "")
        deadline, expires_at = _deadline(window, metadata)
        if not body.get("input_file_id"):
            raise Refused(
                400, "input_file_id is required: upload the requests with POST /files", param="input_file_id"
            )
        input_meta = _file_meta(str(body["input_file_id"]))
        if input_meta.get("purpose") != "batch":
            raise Refused(400, f"file {input_meta['id']} was not uploaded for batch", param="input_file_id")
        storage = _files()
        batch_id = f"batch_{uuid.uuid4().hex}"
        dag_id = batch_dag_id()
        conf = {
            "input_uri": storage.uri(f"files/{input_meta['id']}/content"),
            "output_uri": storage.uri(f"runs/{batch_id}/output"),
            "deadline": deadline,
        }
        batch = {
            "id": batch_id,
            "dag_id": dag_id,
            "run_id": batch_id,
            "plan_task_id": plan_task_id(),
            "endpoint": endpoint,
            "input_file_id": input_meta["id"],
            "completion_window": window,
            "metadata": metadata,
            "created_at": _ts(_now()),
            "expires_at": expires_at,
            "conf": conf,
        }
        # the sidecar first: a run without one could never be found again
        record_batch(storage, batch)
        try:
            _trigger(request, dag_id, batch_id, conf)
        except HTTPException:
            if _dag_run(dag_id, batch_id).state is None:  # refused, or never reached Airflow
                forget_batch(storage, batch)
                raise
            log.warning("batch %s: its run was triggered, but Airflow's answer was an error", batch_id)
        return _batch_object(batch)

    @router.get("/batches/{batch_id}")
    def get_batch(batch_id: str, user: BaseUser = user_dep) -> dict[str, Any]:
        return _batch_object(readable_batch(batch_id, user))

    @router.get("/batches")
    def list_batches(after: str | None = None, limit: int = 20, user: BaseUser = user_dep) -> dict[str, Any]:
        limit = max(1, min(limit, LIST_MAX))
        allowed: dict[str, bool] = {}

        def readable(batch: dict[str, Any]) -> bool:
            dag_id = batch["dag_id"]
            if dag_id not in allowed:
                allowed[dag_id] = may_read(user, DagRunRef(dag_id=dag_id, run_id=batch["run_id"], task_id=""))
            return allowed[dag_id]

        page = list_page(_files(), after, limit, readable)
        shown = [_batch_object(batch) for batch in page.batches]
        return {
            "object": "list",
            "data": shown,
            "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None,
            "has_more": page.has_more,
        }

    @router.post("/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, user: BaseUser = user_dep) -> dict[str, Any]:
        batch = readable_batch(batch_id, user)
        if not _may_edit_runs(user, batch["dag_id"]):
            raise HTTPException(status_code=403, detail="Forbidden")
        current = _batch_object(batch)
        if current["terminal"] or batch.get("cancel_requested_at"):
            # an ended batch keeps its status (a failed one read ``cancelled`` once asked); a second
            # cancel changes nothing
            return current
        asked_at = _ts(_now())

        def ask(now: dict[str, Any]) -> dict[str, Any]:
            if now.get("cancel_requested_at") or now.get("exported"):
                return now  # asked meanwhile, or published and exported first: the cancel lost
            return {**now, "cancel_requested_at": asked_at}

        changed = update_sidecar(_files(), batch_id, ask)
        if changed is None:  # forgotten meanwhile: its run was never created
            raise HTTPException(status_code=404, detail=f"no such batch: {batch_id}")
        return _batch_object(changed)  # cancels the job when it exists (else on a later read)

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def not_served(path: str, request: Request, user: BaseUser = user_dep) -> None:
        """Whatever else the SDK may ask (``GET /files``, ``DELETE /files/{id}``, another API): an
        OpenAI 404 that says so, where the router's own answer had no message for the SDK."""
        detail = f"Invalid URL ({request.method} /{path}): not served here (docs/openai.md lists them)"
        raise HTTPException(status_code=404, detail=detail)

    return router
