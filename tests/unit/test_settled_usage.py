"""The manifest's optional settled usage: absent, the bytes are those of an older manifest."""

from __future__ import annotations

import orjson

from airflow_deadline_batch.core.results import OutputManifest, SettledUsage
from tests.unit.test_results import manifest


def test_manifest_with_usage_round_trips_and_without_it_has_no_usage_key() -> None:
    plain = manifest()
    assert "usage" not in orjson.loads(plain.to_json_bytes())
    usage = SettledUsage(
        tenant="ads",
        attempts=3,
        prompt_tokens=10,
        completion_tokens=5,
        superseded_records=1,
        gpu_seconds=12.5,
        cost=0.25,
    )
    settled = plain.model_copy(update={"usage": usage})
    data = settled.to_json_bytes()
    assert orjson.loads(data)["usage"]["cost"] == 0.25
    assert OutputManifest.from_json_bytes(data) == settled
