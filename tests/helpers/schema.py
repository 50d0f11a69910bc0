"""The store schema's latest Alembic revision, read from the migrations themselves."""

from __future__ import annotations

from alembic.script import ScriptDirectory

from airflow_deadline_batch.store.manifest_store import MIGRATIONS_DIR


def head_revision() -> str:
    """The revision ``ManifestStore.migrate`` upgrades to (one head: the migrations are a line)."""
    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    assert head is not None, f"no migrations under {MIGRATIONS_DIR}"
    return head
