"""plan_job's checksums: the whole input hashed beside the duplicate check, shards' ranges on threads."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

import airflow_deadline_batch.service.planning as planning
from airflow_deadline_batch.store import ManifestStore
from tests.unit.planning_inputs import plan_request, write_input


def test_a_parallel_plan_records_the_checksums_of_the_bytes_it_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_input(tmp_path / "in.jsonl", 4000, 11)
    # a small input planned as a large one: two scan processes, range hashes on threads
    monkeypatch.setattr(planning, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(planning, "_cores", lambda: 2)
    order: list[str] = []
    finish = planning._InputScan.finish
    scan_input = planning._scan_input

    def finish_logged(self: Any, parts: Any) -> None:
        order.append("finish")
        finish(self, parts)

    def scan_input_logged(request: Any, work_model: Any, on_scanned: Any = None) -> Any:
        assert on_scanned is not None  # plan_job hashes a local input once it has been read

        def scanned() -> None:
            order.append("scanned")
            on_scanned()

        return scan_input(request, work_model, scanned)

    monkeypatch.setattr(planning._InputScan, "finish", finish_logged)
    monkeypatch.setattr(planning, "_scan_input", scan_input_logged)
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        result = planning.plan_job(store, plan_request(path, allow_infeasible=True))
        data = path.read_bytes()
        assert store.get_job(result.job_id).input_sha256 == hashlib.sha256(data).hexdigest()
        shards = store.list_shards(result.job_id)
        assert len(shards) > 2
        for shard in shards:
            assert shard.input_sha256 == hashlib.sha256(data[shard.byte_start : shard.byte_end]).hexdigest()
    finally:
        store.close()
    assert order == ["scanned", "finish"]


def test_on_scanned_is_called_once_every_line_is_read(tmp_path: Path) -> None:
    path = write_input(tmp_path / "in.jsonl", 300, 12)
    calls: list[int] = []
    analysis = planning.analyze_input(plan_request(path), on_scanned=lambda: calls.append(1))
    analysis.close()
    assert calls == [1]
