"""The provider's Airflow options, ``[deadline_batch]``: each declared once, here, with its type,
default, description and example.

:func:`airflow_deadline_batch.provider.get_provider_info` hands them to Airflow (its ``config``
key), so ``airflow config list`` and ``airflow config get-value deadline_batch <option>`` show them
with their defaults, and ``conf.get`` returns the default of one that is not set. A default the
code defines as a constant is that constant, read here. Imported at Airflow's start-up through the
provider's entry point, so it must stay cheap: no Airflow (or any heavy) import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_deadline_batch.core.failures import MAX_RESUME_DELAY_S, MIN_RESUME_DELAY_S, SCHEDULER_LATENCY_S

__all__ = ["DEFAULT_BATCH_DAG_ID", "DEFAULT_PLAN_TASK_ID", "OPTIONS", "SECTION", "Option", "provider_config"]

SECTION = "deadline_batch"
#: the DAG the OpenAI Batch API runs a batch as, and its plan task (``api.openai_batches``)
DEFAULT_BATCH_DAG_ID = "example_deadline_batch_local"
DEFAULT_PLAN_TASK_ID = "plan"
#: the provider version that declared the options (each existed since it)
_FIRST_VERSION = "0.1.0"


@dataclass(frozen=True)
class Option:
    """One ``[deadline_batch]`` option as Airflow's ``config.yml`` schema describes it.

    ``default`` is the value as Airflow's configuration holds it (a string), None where the option
    has none (``conf.get`` then returns the caller's fallback); ``env`` is the provider's own
    environment variable that wins over the option, where it has one.
    """

    key: str
    type: str
    default: str | None
    description: str
    example: str | None = None
    env: str | None = None

    def declaration(self) -> dict[str, Any]:
        """The option's entry under the section's ``options`` in the provider info."""
        description = self.description
        if self.env:
            description += f"\nThe environment variable ``{self.env}`` wins over it where set.\n"
        return {
            "description": description,
            "version_added": _FIRST_VERSION,
            "type": self.type,
            "example": self.example,
            "default": self.default,
        }


OPTIONS: tuple[Option, ...] = (
    Option(
        "min_resume_delay_s",
        "float",
        str(MIN_RESUME_DELAY_S),
        "Seconds, at least, between a task handing its worker slot back (a shard task's reschedule, a "
        "deferral) and its next start: Airflow's scheduler fails a task that starts again before it "
        "has processed the executor's report of the previous exit. Raise it on a loaded scheduler; "
        f"every reschedule waits it. 0 to {MAX_RESUME_DELAY_S:g}; another value fails the task, "
        "naming the option.\n",
        example="15",
    ),
    Option(
        "scheduler_latency_s",
        "float",
        str(SCHEDULER_LATENCY_S),
        "Seconds, at least, that Airflow takes to start a task that is due (a scheduler loop, the "
        "executor starting the task, the DAG file's parse), as shard placement assumes it before it "
        f"has seen a later start. 0 to {MAX_RESUME_DELAY_S:g}; another value fails the try, naming "
        "the option.\n",
        example="120",
    ),
    Option(
        "store_conn_id",
        "string",
        None,
        "The connection of the manifest store the jobs view and the OpenAI-compatible Batch API "
        "read (a ``deadline_batch_store`` or ``postgres`` connection). Unset: the SQLite file "
        "``$AIRFLOW_HOME/deadline_batch.db``.\n",
        example="deadline_batch_store",
        env="ADB_STORE_CONN_ID",
    ),
    Option(
        "files_uri",
        "string",
        None,
        "The Batch API's files store: a folder or ``s3://bucket/prefix`` that the batch DAG's tasks "
        "can read. Unset: the API's routes answer 503.\n",
        example="s3://my-bucket/deadline-batch/files",
        env="ADB_FILES_URI",
    ),
    Option(
        "batch_dag_id",
        "string",
        DEFAULT_BATCH_DAG_ID,
        "The DAG each Batch API batch runs: it must accept the params ``input_uri``, ``output_uri`` "
        "and ``deadline`` and plan with ``DeadlineBatchOperator``.\n",
        example="nightly_batch",
        env="ADB_BATCH_DAG_ID",
    ),
    Option(
        "batch_plan_task_id",
        "string",
        DEFAULT_PLAN_TASK_ID,
        "The task ID of that DAG's ``DeadlineBatchOperator``: a batch's job is the one with "
        "idempotency key ``{dag_id}/{run_id}/{task_id}``.\n",
        env="ADB_BATCH_PLAN_TASK_ID",
    ),
    Option(
        "airflow_api_url",
        "string",
        None,
        "Where the api-server reaches its own REST API to trigger a batch's DAG run, where "
        "``[api] base_url`` is not reachable from it. Unset: ``[api] base_url``, else the request's "
        "own scheme and host.\n",
        example="http://localhost:8080",
        env="ADB_AIRFLOW_API_URL",
    ),
)


def provider_config() -> dict[str, Any]:
    """The provider info's ``config``: the ``[deadline_batch]`` section and its options."""
    return {
        SECTION: {
            "description": "Options of the Deadline Batch provider (airflow-deadline-batch).\n",
            "options": {option.key: option.declaration() for option in OPTIONS},
        }
    }
