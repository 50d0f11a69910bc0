"""The progress button links only to Airflow's own host: an absolute job-page URL planted in XCom
on another host (or port, or with a user name that makes the host another) shows no button.

``job_page_link`` reads Airflow's ``[api] base_url`` (``AIRFLOW__API__BASE_URL`` here) unless the
caller names it.
"""

from __future__ import annotations

import pytest

from airflow_deadline_batch.links.progress import DeadlineBatchProgressLink, job_page_link, progress_url

BASE = "https://airflow.example/sub"


@pytest.mark.parametrize(
    "value",
    [
        "https://evil.example/deadline-batch/jobs/j-1",
        "https://evil.example/sub/deadline-batch/jobs/j-1",
        "https://airflow.example.evil.example/sub/deadline-batch/jobs/j-1",
        "https://airflow.example@evil.example/sub/deadline-batch/jobs/j-1",
        "https://user@airflow.example/sub/deadline-batch/jobs/j-1",
        "https://airflow.example:8443/sub/deadline-batch/jobs/j-1",
        "http://airflow.example/sub/deadline-batch/jobs/j-1",  # port 80, not Airflow's 443
        "https://airflow.example:notaport/sub/deadline-batch/jobs/j-1",
    ],
)
def test_a_job_page_url_on_another_host_shows_no_button(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", BASE)
    assert job_page_link(value) == ""


@pytest.mark.parametrize(
    "value",
    [
        progress_url(BASE, "j-1"),
        progress_url(BASE, "j-1", "s3://bucket/j-1/manifest.json"),
        "https://AIRFLOW.example:443/sub/deadline-batch/jobs/j-1",  # the same host and port, spelt otherwise
        "/sub/deadline-batch/jobs/j-1",
    ],
)
def test_a_job_page_url_on_airflows_own_host_or_a_rooted_path_is_the_button(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", BASE)
    assert job_page_link(value) == value


def test_without_a_base_url_only_a_rooted_path_is_a_button(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``[api] base_url``: the link the task pushed is a rooted path; no absolute URL is Airflow's."""
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "")
    assert job_page_link("/deadline-batch/jobs/j-1") == "/deadline-batch/jobs/j-1"
    assert job_page_link("https://evil.example/deadline-batch/jobs/j-1") == ""
    assert job_page_link("http://localhost:8080/deadline-batch/jobs/j-1") == ""


def test_the_url_the_task_persists_is_the_button(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``persist`` pushes (made from the same ``base_url``) passes the check it is read back by."""
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow:8080")
    pushed: dict[str, object] = {}

    class TaskInstance:
        def xcom_push(self, key: str, value: object) -> None:
            pushed[key] = value

    url = DeadlineBatchProgressLink.persist({"ti": TaskInstance()}, "j-1", "s3://bucket/j-1/manifest.json")
    assert url.startswith("http://airflow:8080/deadline-batch/jobs/j-1?")
    assert job_page_link(pushed[DeadlineBatchProgressLink().xcom_key]) == url
