"""Killing the runner itself (``deadline-batch run``) mid-job, then resubmitting (invariants 5, 6).

The CLI runs in its own session so that one ``killpg`` SIGKILLs it together with its workers, as
a node loss would. The leases of the dead workers then expire after ``--lease-ttl`` (until then
the rerun's workers find their shard leased and exit 75, and the runner tries again); the rerun
with the same idempotency key must resume that job: every microbatch committed before the kill
stays exactly as it was (same attempt, object and checksum), each new attempt resumes at or after
the shard's committed cursor, and the job completes with one outcome per line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import CliResult, cli_argv, cli_env, run_cli, wait_for
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import (
    assert_outcomes_match,
    assert_store_invariants,
    read_manifest,
    read_outcomes,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

_CLAIM = re.compile(r"shard=(\d+) attempt=\S+ claimed: epoch \d+, resuming at microbatch (\d+) of")


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_runner_killed_mid_job_resumes_without_redoing_commits(tmp_path: Path) -> None:
    mixed = mixed_input(400, seed=21)
    path = mixed.write(tmp_path / "input.jsonl")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    out = tmp_path / "out"
    key = "resume-after-runner-kill"
    args = [
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2", "--store", store_url,
        "--output", str(out), "--idempotency-key", key, "--lease-ttl", "5", "--microbatch-size", "10",
        "--max-invalid-fraction", "0.5", "--json",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cli_argv(*args),
        cwd=tmp_path,
        env=cli_env({"ADB_ECHO_DELAY_S": "0.02"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    store = ManifestStore.open(store_url, migrate=True)
    try:
        total = len(mixed.expected)

        def partly_committed() -> str | None:
            job = store.get_job_by_idempotency_key(key)
            if job is None:
                return None
            committed = store.progress(job.job_id).committed_records
            return job.job_id if total // 4 <= committed < total else None

        job_id = wait_for(partly_committed, timeout_s=120, what="a quarter of the records to commit")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: _group_gone(proc.pid), timeout_s=30, what="the runner's workers to die")

        before = {(c.shard_index, c.seq): (c.attempt_id, c.uri, c.sha256) for c in store.list_commits(job_id)}
        cursors = {s.shard_index: s.cursor for s in store.list_shards(job_id)}
        assert store.get_job(job_id).manifest_uri is None
        assert sum(cursors.values()) < sum(s.num_microbatches for s in store.list_shards(job_id))
        log = out / "worker.log"
        log_offset = log.stat().st_size
        # leases the killed workers held: no rerun attempt may take one of those shards before it
        # expires (on a quiet machine the rerun's first claims are refused as "leased"; on a loaded one
        # the rerun may only get there after expiry, so the check is on the store, not on the log)
        held_until = {
            s.shard_index: s.lease_expires_at
            for s in store.list_shards(job_id)
            if s.lease_expires_at is not None and s.lease_expires_at > store.db_time()
        }
        old_attempts = {a.attempt_id for a in store.list_attempts(job_id)}

        again: CliResult = run_cli(*args, cwd=tmp_path, env={"ADB_ECHO_DELAY_S": "0.001"})
        assert again.code == 0, again.describe()
        summary = again.json()
        assert summary["job_id"] == job_id
        assert summary["state"] == "completed"

        after = {(c.shard_index, c.seq): (c.attempt_id, c.uri, c.sha256) for c in store.list_commits(job_id)}
        changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
        assert not changed, f"commits made before the kill were redone or lost: {changed}"
        rerun_log = log.read_bytes()[log_offset:].decode()
        resumed = [(int(s), int(c)) for s, c in _CLAIM.findall(rerun_log)]
        assert resumed, "the rerun claimed no shard"
        for shard, cursor in resumed:
            assert cursor >= cursors[shard], (
                f"shard {shard} resumed at {cursor}, below its committed {cursors[shard]}"
            )

        new_attempts = [a for a in store.list_attempts(job_id) if a.attempt_id not in old_attempts]
        for attempt in new_attempts:
            expiry = held_until.get(attempt.shard_index)
            if expiry is not None:  # the runner waited out the dead worker's lease (fencing)
                assert attempt.started_at.timestamp() >= expiry - 0.001, (attempt, expiry)
        if "leased by another live attempt" in rerun_log:  # refused early, then retried
            assert held_until, "a claim was refused although no killed worker held a live lease"

        manifest = read_manifest(summary["manifest"])
        assert_outcomes_match(read_outcomes(manifest), mixed)
        assert_store_invariants(store, job_id, manifest)
        assert len(store.list_jobs()) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        store.close()
