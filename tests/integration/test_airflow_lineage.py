"""Lineage: the plan and the sensor report "this manifest came from that input with this model".

A local run (plan → local shard tasks → sensor, echo engine, SQLite store) with Airflow's real
hook-lineage collector in place of the no-op one Airflow uses when no lineage reader (the
OpenLineage provider) is installed: the plan reports the input, the sensor the input and the
published manifest, both with the job's model, digest and input checksum; the manifest's Asset
event carries the same facts. ``get_openlineage_facets_on_complete`` returns an
``OperatorLineage`` with the same datasets where the OpenLineage provider is installed (that test
is skipped where it is not) and None otherwise.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.lineage import HookLineageCollector

from airflow_deadline_batch import lineage
from airflow_deadline_batch.operators.plan import DeadlineBatchOperator
from airflow_deadline_batch.operators.shard import LocalShardOperator
from airflow_deadline_batch.sensors.completeness import CompletenessSensor
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "echo-lineage-model"


class TaskInstance(SimpleNamespace):
    def xcom_push(self, key: str, value: Any, **_: Any) -> None:
        self.xcoms[(self.task_id, key)] = value

    def xcom_pull(self, task_ids: str, key: str = "return_value", **_: Any) -> Any:
        return self.xcoms.get((task_ids, key))


def context(task_id: str, xcoms: dict[tuple[str, str], Any], outlet_events: Any = None) -> dict[str, Any]:
    ti = TaskInstance(task_id=task_id, xcoms=xcoms, dag_id="lineage", try_number=1, map_index=-1)
    out: dict[str, Any] = {"ti": ti, "run_id": "manual__lineage", "dag": SimpleNamespace(dag_id="lineage")}
    if outlet_events is not None:
        out["outlet_events"] = outlet_events
    return out


@pytest.fixture()
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """One finished run, with what each task handed to a real HookLineageCollector."""
    collectors: list[HookLineageCollector] = []

    def collector() -> HookLineageCollector:
        return collectors[-1]

    monkeypatch.setattr("airflow.sdk.lineage.get_hook_lineage_collector", collector)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    input_path = mixed_input(8, seed=11, bad_fraction=0.0, blank_fraction=0.0).write(tmp_path / "in.jsonl")
    xcoms: dict[tuple[str, str], Any] = {}

    collectors.append(HookLineageCollector())
    plan = DeadlineBatchOperator(
        task_id="plan",
        input_uri=str(input_path),
        output_uri=str(tmp_path / "out"),
        deadline="+2h",
        store_url=store_url,
        engine="echo",
        model=MODEL,
        workers=1,
        microbatch_size=4,
    )
    specs = plan.execute(context("plan", xcoms))
    plan_collected = collectors[-1].collected_assets
    for spec in specs:
        LocalShardOperator(task_id="shard", store_url=store_url, **spec).execute(context("shard", xcoms))

    collectors.append(HookLineageCollector())
    job_id = xcoms[("plan", "job_id")]
    sensor = CompletenessSensor(
        task_id="verify", job_id=job_id, store_url=store_url, deferrable=False, poke_interval=0.1
    )
    outlet_events: defaultdict[Any, Any] = defaultdict(lambda: SimpleNamespace(extra={}))
    assert sensor.poke(context("verify", xcoms, outlet_events)) is True
    store = ManifestStore(store_url)
    digests = {c.model_digest for c in store.list_commits(job_id) if c.shard_index >= 0 and c.model_digest}
    return {
        "plan": plan,
        "sensor": sensor,
        "plan_collected": plan_collected,
        "sensor_collected": collectors[-1].collected_assets,
        "asset_extra": outlet_events[sensor.manifest_asset].extra,
        "job": store.get_job(job_id),
        "digest": next(iter(digests)) if len(digests) == 1 else None,
        "input_uri": f"file://{input_path}",
    }


def test_plan_and_sensor_report_input_manifest_and_model(run: dict[str, Any]) -> None:
    job = run["job"]
    assert job.manifest_uri, "the sensor published no manifest"
    # the plan knows the model by name; the digest the workers loaded is known once they commit
    facts = {"job_id": job.job_id, "model": MODEL, "engine": "echo", "input_sha256": job.input_sha256}
    plan = run["plan_collected"]
    assert [a.asset.uri for a in plan.inputs] == [run["input_uri"]]
    assert plan.inputs[0].asset.extra == facts
    assert plan.outputs == []
    assert [(e.key, e.value) for e in plan.extra] == [(lineage.EXTRA_KEY, facts)]

    sensor = run["sensor_collected"]
    assert run["digest"], "the echo worker committed no model digest"
    published = {**facts, "model_digest": run["digest"], "state": "completed"}
    assert [a.asset.uri for a in sensor.inputs] == [run["input_uri"]]
    assert [a.asset.uri for a in sensor.outputs] == [lineage.asset_uri(job.manifest_uri)]
    assert sensor.outputs[0].asset.extra == published
    assert [(e.key, e.value) for e in sensor.extra] == [(lineage.EXTRA_KEY, published)]

    # the manifest's Asset event says where it came from, with which model
    extra = run["asset_extra"]
    assert extra["manifest_uri"] == job.manifest_uri and extra["input_uri"] == job.input_uri
    assert {k: extra[k] for k in published} == published


def test_openlineage_facets_match_the_collected_datasets(run: dict[str, Any]) -> None:
    pytest.importorskip("airflow.providers.openlineage", reason="the OpenLineage provider is not installed")
    job = run["job"]
    plan_lineage = run["plan"].get_openlineage_facets_on_complete(None)
    sensor_lineage = run["sensor"].get_openlineage_facets_on_complete(None)
    assert [(d.namespace, d.name) for d in plan_lineage.inputs] == [("file", job.input_uri)]
    assert plan_lineage.outputs == []
    assert [(d.namespace, d.name) for d in sensor_lineage.inputs] == [("file", job.input_uri)]
    assert [(d.namespace, d.name) for d in sensor_lineage.outputs] == [
        lineage.openlineage_dataset_name(job.manifest_uri)
    ]
    assert MODEL in sensor_lineage.outputs[0].facets["documentation"].description


def test_without_the_openlineage_provider_the_facets_are_none(run: dict[str, Any]) -> None:
    try:
        import airflow.providers.openlineage  # noqa: F401
    except ImportError:
        assert run["plan"].get_openlineage_facets_on_complete(None) is None
        assert run["sensor"].get_openlineage_facets_on_complete(None) is None
    else:
        pytest.skip("the OpenLineage provider is installed")


def test_asset_uris_and_openlineage_names() -> None:
    assert lineage.asset_uri("/data/in.jsonl") == "file:///data/in.jsonl"
    assert lineage.asset_uri("s3://b/k/in.jsonl") == "s3://b/k/in.jsonl"
    assert lineage.openlineage_dataset_name("s3://b/k/in.jsonl") == ("s3://b", "k/in.jsonl")
    assert lineage.openlineage_dataset_name("/data/in.jsonl") == ("file", "/data/in.jsonl")
