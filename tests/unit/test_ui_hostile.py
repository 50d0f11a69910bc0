"""The jobs view against a hostile user and a hostile store: what reaches the page, and the store.

The renderer is driven with the page model of ``test_ui_render`` carrying hostile values; the
plugin's store with real URLs (a PostgreSQL engine connects lazily, so no server is needed to see
which store a URL opens).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_deadline_batch.plugins import progress


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
