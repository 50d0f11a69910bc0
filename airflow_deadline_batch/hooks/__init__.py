"""Airflow hooks of the deadline-batch provider."""

from __future__ import annotations

from airflow_deadline_batch.hooks.store import ManifestStoreHook

__all__ = ["ManifestStoreHook"]
