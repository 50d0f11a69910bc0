"""Alembic environment of the manifest store.

Runs only programmatically, from :meth:`ManifestStore.migrate`, which passes an open connection
inside a transaction (holding the migration lock) in ``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

from airflow_deadline_batch.store.schema import VERSION_TABLE, metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "run the manifest store's migrations with ManifestStore(url).migrate(), not the alembic CLI"
    )

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
