"""Provider registration: schema-valid info, importable classes, discovery by Airflow, the store hook."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import airflow
import jsonschema
import pytest

from airflow_deadline_batch.exceptions import ConfigurationError
from airflow_deadline_batch.hooks.store import ManifestStoreHook, default_store_url, url_from_connection
from airflow_deadline_batch.provider import get_provider_info

AIRFLOW_DIR = Path(airflow.__file__).parent


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_provider_info_validates_against_airflow_schema():
    schema = json.loads((AIRFLOW_DIR / "provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)


def test_ui_field_behaviour_validates_against_airflow_schema():
    schema = json.loads((AIRFLOW_DIR / "customized_form_field_behaviours.schema.json").read_text())
    (conn,) = get_provider_info()["connection-types"]
    behaviour = conn["ui-field-behaviour"]
    jsonschema.validate(
        {
            "hidden_fields": behaviour["hidden-fields"],
            "relabeling": behaviour["relabeling"],
            "placeholders": behaviour["placeholders"],
        },
        schema,
    )
    assert conn["connection-type"] == ManifestStoreHook.conn_type


def test_every_referenced_module_and_class_imports():
    info = get_provider_info()
    for section in ("operators", "sensors", "hooks", "triggers"):
        for entry in info[section]:
            for module in entry["python-modules"]:
                importlib.import_module(module)
    for path in [
        *info["extra-links"],
        *info["notifications"],
        *(c["hook-class-name"] for c in info["connection-types"]),
    ]:
        assert isinstance(_import(path), type), path


def test_airflow_discovers_the_provider_through_its_entry_point():
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "airflow-deadline-batch" in manager.providers


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {
                "conn_type": "postgres",
                "host": "db.internal",
                "login": "batch",
                "password": "p@ss/word",
                "port": 5433,
                "schema": "adb",
                "extra": {"sslmode": "require", "ignored": "x"},
            },
            "postgresql+psycopg://batch:p%40ss%2Fword@db.internal:5433/adb?sslmode=require",
        ),
        (
            {"conn_type": "deadline_batch_store", "host": "sqlite:////var/adb/store.db"},
            "sqlite:////var/adb/store.db",
        ),
        (
            {"conn_type": "deadline_batch_store", "host": "postgresql://batch@db/adb", "password": "pw"},
            "postgresql+psycopg://batch:pw@db/adb",
        ),
        (
            {"conn_type": "deadline_batch_store", "extra": {"url": "postgresql+psycopg://u:x@h/d"}},
            "postgresql+psycopg://u:x@h/d",
        ),
    ],
)
def test_url_from_connection(fields, expected):
    values = {
        "conn_type": None,
        "host": None,
        "login": None,
        "password": None,
        "port": None,
        "schema": None,
        "extra": {},
        **fields,
    }
    assert url_from_connection(conn_id="c", **values) == expected


@pytest.mark.parametrize(
    "fields",
    [
        {"conn_type": "deadline_batch_store"},
        {"conn_type": "mysql", "host": "h"},
        {"conn_type": "postgres"},
        {"conn_type": "deadline_batch_store", "host": "not a url"},
    ],
)
def test_url_from_connection_rejects_unusable_connections(fields):
    values = {
        "conn_type": None,
        "host": None,
        "login": None,
        "password": None,
        "port": None,
        "schema": None,
        "extra": {},
        **fields,
    }
    with pytest.raises(ConfigurationError, match="connection 'c'"):
        url_from_connection(conn_id="c", **values)


def test_hook_resolution_order(monkeypatch, tmp_path):
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setenv(
        "AIRFLOW_CONN_ADB",
        json.dumps({"conn_type": "deadline_batch_store", "host": f"sqlite:///{tmp_path / 'conn.db'}"}),
    )
    assert (
        ManifestStoreHook().get_store_url()
        == default_store_url()
        == f"sqlite:///{tmp_path / 'deadline_batch.db'}"
    )
    assert ManifestStoreHook(store_conn_id="adb").get_store_url() == f"sqlite:///{tmp_path / 'conn.db'}"
    assert (
        ManifestStoreHook(store_conn_id="adb", store_url="sqlite:///x.db").get_store_url() == "sqlite:///x.db"
    )
    store = ManifestStoreHook(store_conn_id="adb").get_store(migrate=True)
    assert store.list_jobs() == []
    assert ManifestStoreHook(store_conn_id="adb").test_connection() == (True, "manifest store reachable")


def test_airflow_loads_the_plugin_with_its_default_settings():
    """The jobs view's plugin comes from an ``airflow.plugins`` entry point, not from provider
    discovery, which Airflow 3.3 does lazily by default (docs/airflow.md, *Jobs view*)."""
    from airflow.plugins_manager import _load_entrypoint_plugins

    plugins, errors = _load_entrypoint_plugins()
    assert not errors
    (ours,) = [p for p in plugins if p.name == "deadline_batch"]
    assert ours.fastapi_apps and ours.fastapi_apps[0]["url_prefix"] == "/deadline-batch"
