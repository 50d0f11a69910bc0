"""Provider registration: what Airflow's ProvidersManager learns about this package.

Imported by Airflow at start-up through the ``apache_airflow_provider`` entry point, so it must stay
cheap: plain literals and the option declarations (:mod:`airflow_deadline_batch.config`), no Airflow
(or any heavy) import.
"""

from __future__ import annotations

from typing import Any

from airflow_deadline_batch import __version__
from airflow_deadline_batch.config import provider_config

PACKAGE_NAME = "airflow-deadline-batch"
INTEGRATION = "Deadline Batch"
CONN_TYPE = "deadline_batch_store"


def get_provider_info() -> dict[str, Any]:
    """Return the provider metadata dict validated by Airflow's ``provider_info.schema.json``."""
    return {
        "package-name": PACKAGE_NAME,
        "name": "Deadline Batch",
        "description": (
            "Deadline-aware LLM batch inference on interruptible (Spot) GPUs: admission, shard pods "
            "that escalate to on-demand as slack shrinks, verified manifests and deadline-risk alerts.\n"
        ),
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": INTEGRATION,
                "external-doc-url": "https://github.com/airflow-deadline-batch/airflow-deadline-batch",
                "tags": ["ai", "software"],
            }
        ],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_deadline_batch.operators.plan",
                    "airflow_deadline_batch.operators.shard",
                    "airflow_deadline_batch.operators.export",
                ],
            }
        ],
        "sensors": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["airflow_deadline_batch.sensors.completeness"],
            }
        ],
        "triggers": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["airflow_deadline_batch.triggers.completeness"],
            }
        ],
        "hooks": [
            {
                "integration-name": INTEGRATION,
                "python-modules": ["airflow_deadline_batch.hooks.store"],
            }
        ],
        "connection-types": [
            {
                "connection-type": CONN_TYPE,
                "hook-class-name": "airflow_deadline_batch.hooks.store.ManifestStoreHook",
                "hook-name": "Deadline Batch manifest store",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "login", "port"],
                    "relabeling": {"host": "SQLAlchemy URL", "password": "Password (inserted into the URL)"},
                    "placeholders": {
                        "host": "postgresql+psycopg://user@db.example.com:5432/deadline_batch",
                        "extra": '{"url": "sqlite:////opt/airflow/deadline_batch.db"}',
                    },
                },
            }
        ],
        "extra-links": ["airflow_deadline_batch.links.progress.DeadlineBatchProgressLink"],
        "notifications": ["airflow_deadline_batch.notifiers.deadline_risk.DeadlineRiskNotifier"],
        "config": provider_config(),
    }
