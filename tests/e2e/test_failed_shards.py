"""Failed shards still give every line exactly one terminal outcome (docs/design.md §4.5 invariant 1).

Every worker kills itself (a real SIGKILL) right after writing its first object and before
committing it, and a shard has a single attempt: every shard ends ``terminal_failure`` without a
commit. The job must still be published, as ``partial``, with an ``errored`` outcome of code
``shard_failed`` for each of those records, beside the planner's validation errors.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from airflow_deadline_batch.core.pools import default_local_pools
from airflow_deadline_batch.core.states import ShardState
from airflow_deadline_batch.local.runner import RunOptions, run_job
from airflow_deadline_batch.service.finalize import verify_job
from airflow_deadline_batch.service.planning import PlanRequest
from airflow_deadline_batch.storage import open_storage
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import read_manifest, read_outcomes

pytestmark = pytest.mark.e2e


def test_shards_that_fail_for_good_are_published_as_errored_outcomes(tmp_path: Path) -> None:
    mixed = mixed_input(60, seed=4, bad_fraction=0.05, blank_fraction=0.02)
    input_path = mixed.write(tmp_path / "input.jsonl")
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}")
    request = PlanRequest(
        input_uri=str(input_path),
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        output_uri=str(tmp_path / "out"),
        engine="echo",
        pools=default_local_pools("echo"),
        workers=2,
        microbatch_size=10,
        max_shards=2,
        max_invalid_fraction=0.5,
        max_attempts=1,
    )
    options = RunOptions(
        workers=2,
        worker_env={"ADB_FAULT_KILL_AFTER_WRITE_PROB": "1.0"},
        worker_log=str(tmp_path / "worker.log"),
    )
    try:
        summary = run_job(store, request, options)
        assert summary.state == "partial", summary
        assert summary.manifest is not None
        shards = store.list_shards(summary.job_id)
        assert shards and all(s.state is ShardState.TERMINAL_FAILURE for s in shards)
        assert store.list_commits(summary.job_id) == [] or all(
            c.shard_index == -1 for c in store.list_commits(summary.job_id)
        )
        manifest = read_manifest(summary.manifest)
        outcomes = read_outcomes(manifest)
        assert sorted(outcomes) == sorted(e.line for e in mixed.expected)
        failed = [o for o in outcomes.values() if o["error"] and o["error"]["code"] == "shard_failed"]
        valid = [e for e in mixed.expected if e.status == "succeeded" or e.code == "engine_error"]
        assert len(failed) == len(valid)
        assert all(o["status"] == "errored" and o["output"] is None for o in failed)
        assert manifest["outcomes"]["succeeded"] == 0
        # the killed attempts wrote objects that never committed: garbage-collected at publication
        output = open_storage(store.get_job(summary.job_id).output_uri)
        assert list(output.list_keys("attempts/")) == []
        assert verify_job(store, summary.job_id).complete
    finally:
        store.close()
