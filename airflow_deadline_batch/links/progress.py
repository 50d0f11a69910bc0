"""``DeadlineBatchProgressLink``: a task button that opens the job's page in the jobs view.

The page is served by this package's plugin (``/deadline-batch/jobs/<job_id>``, docs/airflow.md,
*Jobs view*) behind Airflow's login. Once the manifest is published the sensor's link carries its
URI as a ``manifest`` query parameter, for the reader of the URL only: the page shows the manifest
the store recorded, never a value from its URL. Airflow 3 resolves links from XCom, so the task
pushes the finished URL with :meth:`DeadlineBatchProgressLink.persist`.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import SplitResult, quote, urlencode, urlsplit

from airflow.sdk import BaseOperatorLink

PLUGIN_URL_PREFIX = "/deadline-batch"
#: the port of an http(s) URL that names none
_PORTS = {"http": 80, "https": 443}


def airflow_base_url() -> str:
    """The API server's public URL (``[api] base_url``), without a trailing slash."""
    value = os.environ.get("AIRFLOW__API__BASE_URL")
    if not value:
        try:
            from airflow.sdk import conf

            value = conf.get("api", "base_url", fallback="") or ""
        except Exception:  # configuration unreadable: a relative link still works in the UI
            value = ""
    return value.rstrip("/")


def progress_url(base_url: str, job_id: str, manifest_uri: str | None = None) -> str:
    """The plugin page of ``job_id`` (pure)."""
    url = f"{base_url.rstrip('/')}{PLUGIN_URL_PREFIX}/jobs/{quote(job_id, safe='')}"
    if manifest_uri:
        url += "?" + urlencode({"manifest": manifest_uri})
    return url


def job_page_link(value: object, base_url: str | None = None) -> str:
    """``value`` if it is a link :func:`progress_url` could have made, else "" (no button).

    The URL comes from XCom, which more than the task can write (Airflow's REST API edits XCom
    entries): a ``javascript:`` or foreign URL there would be a button in the UI that runs script
    or leads away for whoever clicks it. So only a rooted path to a job page, or an http(s) URL of
    one on the host and port of Airflow's own ``base_url`` (default :func:`airflow_base_url`; none
    configured: no absolute URL is a link) with no user name in it, is a link; and neither may
    hold whitespace or control characters (which browsers strip from schemes) or a backslash
    (which browsers read as ``/``: ``/\\host`` is another site).
    """
    if not isinstance(value, str) or any(ch <= " " or ch in "\x7f\\" for ch in value):
        return ""
    parts = urlsplit(value)
    absolute = parts.scheme in ("http", "https") and bool(parts.netloc) and _on_airflow_host(parts, base_url)
    rooted = not parts.scheme and not parts.netloc and value.startswith("/") and not value.startswith("//")
    if not (absolute or rooted) or f"{PLUGIN_URL_PREFIX}/jobs/" not in parts.path:
        return ""
    return value


def _on_airflow_host(parts: SplitResult, base_url: str | None) -> bool:
    """Whether the URL of ``parts`` is on the host and port of Airflow's ``base_url``."""
    own = urlsplit(airflow_base_url() if base_url is None else base_url)
    try:
        return (
            bool(own.hostname)
            and parts.username is None
            and (parts.hostname, parts.port or _PORTS[parts.scheme])
            == (own.hostname, own.port or _PORTS.get(own.scheme))
        )
    except ValueError:  # a port that is not a number
        return False


class DeadlineBatchProgressLink(BaseOperatorLink):
    """Deadline Batch progress (and manifest, once published)."""

    name = "Deadline Batch progress"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        return job_page_link(XCom.get_value(key=self.xcom_key, ti_key=ti_key))

    @classmethod
    def persist(cls, context: Any, job_id: str, manifest_uri: str | None = None) -> str:
        """Push the link's URL for this task instance; returns it (also for the log)."""
        url = progress_url(airflow_base_url(), job_id, manifest_uri)
        context["ti"].xcom_push(key=cls().xcom_key, value=url)
        return url
