"""``DeadlineBatchExportOperator``: a published job's outcomes as OpenAI Batch files (docs/export.md).

Put it downstream of the ``CompletenessSensor``: it exports only a published, verified manifest and
fails the task (no retry can help) when there is none or it no longer verifies. It calls the
same ``service.export.export_job`` as ``deadline-batch export``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_deadline_batch.exceptions import ConfigurationError, JobNotFound, VerificationError
from airflow_deadline_batch.hooks.s3 import connection_s3
from airflow_deadline_batch.hooks.store import ManifestStoreHook


class DeadlineBatchExportOperator(BaseOperator):
    """Write ``output.jsonl``, ``errors.jsonl``, ``retry.jsonl`` and ``export.json`` for one job.

    :param job_id: the job to export (templated), e.g. ``{{ ti.xcom_pull(task_ids="plan", key="job_id") }}``.
    :param output_uri: a directory or ``s3://bucket/prefix`` to write to (templated).
    :param format: ``openai`` (the only format so far).
    :param store_url: manifest store URL (wins over ``store_conn_id``; templated).
    :param store_conn_id: Airflow connection of the manifest store.
    :param aws_conn_id: Airflow AWS connection for ``s3://`` outputs and the job's objects.

    Returns the export's summary (files with URI, SHA-256 and line counts; outcome counts).
    """

    template_fields: Sequence[str] = ("job_id", "output_uri", "store_url", "store_conn_id")
    ui_color = "#e0f0e8"

    def __init__(
        self,
        *,
        job_id: str,
        output_uri: str,
        format: str = "openai",
        store_url: str | None = None,
        store_conn_id: str | None = None,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job_id = job_id
        self.output_uri = output_uri
        self.format = format
        self.store_url = store_url
        self.store_conn_id = store_conn_id
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow_deadline_batch.service.export import export_job

        store = ManifestStoreHook(store_conn_id=self.store_conn_id, store_url=self.store_url).get_store()
        try:
            with connection_s3(self.aws_conn_id):
                result = export_job(store, str(self.job_id), str(self.output_uri), fmt=self.format)
        except (ConfigurationError, JobNotFound, VerificationError) as exc:
            raise AirflowFailException(exc.message or str(exc)) from exc
        self.log.info(
            "job %s exported to %s: %s",
            result.job_id,
            result.manifest_uri,
            ", ".join(f"{f.name} {f.lines} lines" for f in result.files),
        )
        return result.to_dict()
