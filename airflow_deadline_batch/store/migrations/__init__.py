"""Alembic migrations of the manifest store; run them with ``ManifestStore.migrate()``."""
