"""Alembic revisions of the manifest store, oldest first."""
