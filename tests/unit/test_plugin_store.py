"""The plugin's store follows its configuration: an edited ``ADB_STORE_URL`` or connection takes effect.

The api-server keeps one store per resolved URL; the URL is read again on every call (the
environment) or after :data:`plugins.progress.STORE_URL_TTL_S` (an Airflow connection, read from
``AIRFLOW_CONN_*`` here as from any secrets backend).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_deadline_batch.plugins import progress


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("ADB_STORE_URL", raising=False)
    monkeypatch.delenv("ADB_STORE_CONN_ID", raising=False)
    progress.reset_store()
    yield
    progress.reset_store()


def test_an_edited_store_url_takes_effect_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first, second = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    monkeypatch.setenv("ADB_STORE_URL", first)
    store = progress._store()
    assert store.url == first and progress._store() is store  # opened once while the URL holds
    monkeypatch.setenv("ADB_STORE_URL", second)
    assert progress._store().url == second


def test_an_edited_connection_takes_effect_once_the_resolved_url_is_stale(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(progress, "_monotonic", lambda: clock[0])
    first, second = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"

    def connection(url: str) -> None:
        monkeypatch.setenv(
            "AIRFLOW_CONN_ADB_UI_STORE", json.dumps({"conn_type": "deadline_batch_store", "host": url})
        )

    monkeypatch.setenv("ADB_STORE_CONN_ID", "adb_ui_store")
    connection(first)
    store = progress._store()
    assert store.url == first
    connection(second)
    clock[0] += progress.STORE_URL_TTL_S / 2
    assert progress._store() is store  # the connection is not read on every page view
    clock[0] += progress.STORE_URL_TTL_S / 2
    assert progress._store().url == second
    monkeypatch.setenv("ADB_STORE_URL", first)  # the URL wins over the connection, at once
    assert progress._store().url == first
