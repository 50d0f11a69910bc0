"""The jobs view against hostile values: what reaches the page, the progress link, the store's URL.

The renderer is driven with the page model of ``test_ui_render`` carrying hostile values; the
plugin's store with real URLs (a PostgreSQL engine connects lazily, so no server is needed to see
which store a URL opens).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import pytest

from airflow_deadline_batch.core.states import JobState, ShardState
from airflow_deadline_batch.links.progress import job_page_link, progress_url
from airflow_deadline_batch.plugins import progress
from airflow_deadline_batch.ui import render
from tests.unit.test_ui_render import page


@pytest.fixture()
def fresh_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("ADB_STORE_CONN_ID", raising=False)
    progress.reset_store()
    yield
    progress.reset_store()


@pytest.mark.parametrize(
    "url",
    ["postgresql+psycopg://adb:s3cret@127.0.0.1:1/adb", "postgresql://adb@127.0.0.1:1/adb"],
    ids=["password", "normalised-scheme"],
)
def test_the_store_is_opened_once_per_url_even_when_its_shown_url_differs(
    fresh_store: None, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """``ManifestStore.url`` hides the password and normalises the scheme; the plugin must not
    take that for an edited URL and open (and close) a store at every page view."""
    monkeypatch.setenv("ADB_STORE_URL", url)
    store = progress._store()
    assert store.url != url  # what made the old comparison fail
    assert progress._store() is store


def test_a_job_of_thousands_of_shards_lists_a_bounded_page_failed_shards_first() -> None:
    """Every shard with a 4000-character error (the store's cap) made a page of tens of megabytes."""
    base = page().shards[0]
    lines = tuple(
        dataclasses.replace(
            base,
            shard_index=i,
            state=ShardState.TERMINAL_FAILURE if i % 1000 == 999 else ShardState.SUCCEEDED,
            racing=False,
            last_error="e" * 4000,
        )
        for i in range(5000)
    )
    html = render.render_job_page(dataclasses.replace(page(), shards=lines), prefix="/deadline-batch")
    listed = [int(i) for i in re.findall(r"<tr><td class='n'>(\d+)</td>", html)]
    assert len(listed) == render.SHARD_ROWS and listed == sorted(listed)
    assert {999, 1999, 2999, 3999, 4999} <= set(listed)  # the failed ones make the list
    assert len(html) < render.SHARD_ROWS * 4500
    assert f"{5000 - render.SHARD_ROWS:d} more shard(s) not listed" in html
    assert "shards-unlisted" not in render.render_job_page(page(), prefix="/deadline-batch")


@pytest.mark.parametrize(
    "value",
    [
        "javascript:alert(document.cookie)//deadline-batch/jobs/j-1",
        " javascript:alert(1)//deadline-batch/jobs/j-1",
        "java\tscript:alert(1)//deadline-batch/jobs/j-1",
        "data:text/html,<script>alert(1)</script>/deadline-batch/jobs/j-1",
        "//evil.example/deadline-batch/jobs/j-1",
        "https://evil.example/phish",
        "/\\evil.example/deadline-batch/jobs/j-1",
        {"url": "/deadline-batch/jobs/j-1"},
        None,
    ],
)
def test_the_progress_button_shows_no_link_it_could_not_have_made(value: object) -> None:
    """XCom can be written through Airflow's REST API: the link read from it must be a job page's."""
    assert job_page_link(value) == ""


@pytest.mark.parametrize(
    ("base_url", "url"),
    [
        (
            "https://airflow.example/",
            progress_url("https://airflow.example/", "j-abc", "s3://b/j-abc/manifest.json"),
        ),
        ("", progress_url("", "j-abc")),
        ("http://airflow:8080/sub", progress_url("http://airflow:8080/sub", "j-abc")),
    ],
)
def test_the_progress_button_shows_the_links_it_made(base_url: str, url: str) -> None:
    assert job_page_link(url, base_url) == url


def test_every_field_of_the_page_is_text_a_response_can_carry() -> None:
    """A lone surrogate or control character in any field (tenant, DAG, run, pool, error, outcome)
    becomes U+FFFD: the page still encodes as UTF-8 and holds no raw control character."""
    hostile = "\ud800\x00\x1b[31m" + "</style><script>x</script>"
    for state in (JobState.RUNNING, JobState.COMPLETED):
        text = render.render_job_page(page(state=state, evil=hostile), prefix="/p")
        text.encode("utf-8")  # raised UnicodeEncodeError: the response was a 500
        assert not re.search("[\x00-\x08\x0b\x0c\x0e-\x1f]", text) and "<script>" not in text
    render.render_jobs_page([page(evil=hostile).summary], prefix="/p").encode("utf-8")
