"""Lineage of a job: "this manifest came from that input with this model".

The plan task reports the job's input; the sensor reports the input and the published manifest.
Both go through Airflow 3's hook-lineage collector (``airflow.sdk.lineage``), which hands them to
whichever lineage reader is installed: with the OpenLineage provider, its listener puts them in
the task's OpenLineage events. The model and the job travel as the Assets' ``extra`` and as the
collector's extra under :data:`EXTRA_KEY`. Without a reader (no OpenLineage provider), Airflow's
collector is a no-op and nothing is sent.

:func:`openlineage_facets` additionally builds the ``OperatorLineage`` that the plan operator's and
the sensor's ``get_openlineage_facets_on_complete`` return when the OpenLineage provider is
installed (``None`` otherwise).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

#: the key of the job's facts in the hook-lineage collector's extras
EXTRA_KEY = "deadline_batch"


@dataclasses.dataclass(frozen=True)
class JobLineage:
    """What lineage tools are told about one job (plain values)."""

    job_id: str
    input_uri: str
    input_sha256: str
    model: str | None
    model_digest: str | None
    engine: str | None
    manifest_uri: str | None = None
    state: str | None = None

    def facts(self) -> dict[str, Any]:
        """The job's facts, the ``extra`` of both Assets and of the collector (JSON values only)."""
        out: dict[str, Any] = {
            "job_id": self.job_id,
            "model": self.model,
            "model_digest": self.model_digest,
            "engine": self.engine,
            "input_sha256": self.input_sha256,
        }
        if self.state:
            out["state"] = self.state
        return {k: v for k, v in out.items() if v is not None}


def asset_uri(uri: str) -> str:
    """A URI for an Asset: local paths become ``file://`` URIs, URIs stay as they are."""
    if urlsplit(uri).scheme:
        return uri
    return "file://" + (uri if uri.startswith("/") else "/" + uri)


def job_lineage(job: Any, *, manifest_uri: str | None = None, model_digests: Any = ()) -> JobLineage:
    """The lineage of a store ``JobRow``; ``model_digests`` (seen at verification) fill a missing digest."""
    config: Mapping[str, Any] = job.config or {}
    digest = config.get("model_digest")
    observed = sorted(str(d) for d in model_digests or ())
    if not digest and len(observed) == 1:
        digest = observed[0]
    state = getattr(job, "state", None)
    return JobLineage(
        job_id=str(job.job_id),
        input_uri=str(job.input_uri),
        input_sha256=str(job.input_sha256),
        model=config.get("model"),
        model_digest=digest,
        engine=config.get("engine"),
        manifest_uri=manifest_uri or getattr(job, "manifest_uri", None),
        state=getattr(state, "value", state) if manifest_uri else None,
    )


def report(context: Any, lineage: JobLineage, *, collector: Any = None) -> None:
    """Hand the input (and the manifest, once published) to Airflow's hook-lineage collector.

    ``context`` is what the collector groups entries by (the operator). Never raises.
    """
    try:
        if collector is None:
            from airflow.sdk.lineage import get_hook_lineage_collector

            collector = get_hook_lineage_collector()
        facts = lineage.facts()
        collector.add_input_asset(context, uri=asset_uri(lineage.input_uri), asset_extra=facts)
        if lineage.manifest_uri:
            collector.add_output_asset(context, uri=asset_uri(lineage.manifest_uri), asset_extra=facts)
        collector.add_extra(context, EXTRA_KEY, facts)
    except Exception:
        log.warning("reporting lineage of job %s failed", lineage.job_id, exc_info=True)


def openlineage_dataset_name(uri: str) -> tuple[str, str]:
    """OpenLineage's (namespace, name) of a URI: ``s3://bucket`` + key, ``file`` + path."""
    parts = urlsplit(asset_uri(uri))
    if parts.scheme == "file":
        return "file", parts.path
    return f"{parts.scheme}://{parts.netloc}", parts.path.lstrip("/")


def openlineage_facets(lineage: JobLineage | None) -> Any:
    """The ``OperatorLineage`` of a job (input; manifest once published), or None.

    ``None`` when the OpenLineage provider is not installed or nothing is known yet.
    """
    if lineage is None:
        return None
    try:
        from airflow.providers.openlineage.extractors import OperatorLineage
        from openlineage.client.event_v2 import Dataset
        from openlineage.client.facet_v2 import documentation_dataset
    except ImportError:
        return None
    facts = lineage.facts()
    described = ", ".join(f"{k}={v}" for k, v in facts.items())
    doc = documentation_dataset.DocumentationDatasetFacet(description=f"deadline-batch job: {described}")
    namespace, name = openlineage_dataset_name(lineage.input_uri)
    inputs = [Dataset(namespace=namespace, name=name, facets={"documentation": doc})]
    outputs = []
    if lineage.manifest_uri:
        namespace, name = openlineage_dataset_name(lineage.manifest_uri)
        outputs.append(Dataset(namespace=namespace, name=name, facets={"documentation": doc}))
    return OperatorLineage(inputs=inputs, outputs=outputs)
