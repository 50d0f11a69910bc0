"""The provider's plugin: the progress extra link and a tiny JSON/HTML progress page.

The page reads the manifest store named by ``ADB_STORE_URL`` or the ``[deadline_batch]
store_conn_id`` Airflow option (else the SQLite default) and shows committed progress only.
"""

from __future__ import annotations

import html
import os
from typing import TYPE_CHECKING, Any

from airflow.plugins_manager import AirflowPlugin

from airflow_deadline_batch.links.progress import PLUGIN_URL_PREFIX, DeadlineBatchProgressLink

if TYPE_CHECKING:
    from airflow_deadline_batch.store import ManifestStore


def _store() -> ManifestStore:
    from airflow_deadline_batch.hooks.store import ManifestStoreHook

    conn_id = os.environ.get("ADB_STORE_CONN_ID")
    if not conn_id:
        try:
            from airflow.configuration import conf

            conn_id = conf.get("deadline_batch", "store_conn_id", fallback=None)
        except Exception:  # no such section: fall back to the URL / default
            conn_id = None
    return ManifestStoreHook(store_conn_id=conn_id, store_url=os.environ.get("ADB_STORE_URL")).get_store()


def render_progress_html(progress: dict[str, Any], manifest: str | None) -> str:
    """An escaped, dependency-free HTML page for one job's progress (pure)."""
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in progress.items()
    )
    title = html.escape(str(progress.get("job_id", "job")))
    link = f"<p>Manifest: <code>{html.escape(manifest)}</code></p>" if manifest else ""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
        f"<body><h1>Deadline Batch job {title}</h1>{link}<table>{rows}</table></body></html>"
    )


def create_app() -> Any:
    """The FastAPI sub-application mounted under ``/deadline-batch`` by Airflow's API server."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import HTMLResponse

    from airflow_deadline_batch.exceptions import JobNotFound
    from airflow_deadline_batch.triggers.completeness import plain

    app = FastAPI(title="Deadline Batch progress")

    def _progress(job_id: str) -> dict[str, Any]:
        try:
            return {"job_id": job_id, **plain(_store().progress(job_id))}
        except JobNotFound as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc

    @app.get("/api/jobs/{job_id}")
    def job_json(job_id: str) -> dict[str, Any]:
        return _progress(job_id)

    @app.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(job_id: str, manifest: str | None = None) -> str:
        return render_progress_html(_progress(job_id), manifest)

    return app


class DeadlineBatchPlugin(AirflowPlugin):
    """Registers the progress link and the progress page."""

    name = "deadline_batch"
    operator_extra_links = [DeadlineBatchProgressLink()]
    fastapi_apps = [{"app": create_app(), "url_prefix": PLUGIN_URL_PREFIX, "name": "Deadline Batch progress"}]
