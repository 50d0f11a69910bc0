"""Signals to ``deadline-batch run`` itself (docs/design.md §8): SIGTERM is handled like SIGINT
(workers stopped, leases released, one line, exit 143), and no worker outlives a SIGKILLed runner
(parent-death signal); either way, rerunning the same command resumes the same job.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import orjson
import psutil
import pytest

from airflow_deadline_batch.store import ManifestStore
from tests.e2e.conftest import cli_argv, cli_env, run_cli, wait_for
from tests.helpers.inputs import mixed_input
from tests.helpers.outcomes import assert_outcomes_match, read_manifest, read_outcomes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _workers_of(job_id: str) -> list[psutil.Process]:
    """Live worker processes of the job (``python -m airflow_deadline_batch.worker --job JOB``)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "airflow_deadline_batch.worker" in cmdline and job_id in cmdline:
            found.append(proc)
    return found


def _start_run(tmp_path: Path, n: int = 300) -> tuple[subprocess.Popen[str], list[str], object, str]:
    mixed = mixed_input(n, seed=31)
    path = mixed.write(tmp_path / "input.jsonl")
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    args = [
        "run", str(path), "--deadline", "+1h", "--engine", "echo", "--workers", "2", "--store", store_url,
        "--output", str(tmp_path / "out"), "--lease-ttl", "5", "--microbatch-size", "8",
        "--max-invalid-fraction", "0.5", "--json",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cli_argv(*args),
        cwd=tmp_path,
        env=cli_env({"ADB_ECHO_DELAY_S": "0.05"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return proc, args, mixed, store_url


def _mid_job(store: ManifestStore, proc: subprocess.Popen[str], *, left: int = 0) -> tuple[str, int]:
    """Wait until the job has commits, a worker running and a leased shard with at least
    ``left`` microbatches to go; the job's ID and that shard's index."""

    def ready() -> tuple[str, int] | None:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        jobs = store.list_jobs()
        if not jobs:
            return None
        job_id = jobs[0].job_id
        progress = store.progress(job_id)
        if not (0 < progress.committed_records < progress.total_records and _workers_of(job_id)):
            return None
        for shard in store.list_shards(job_id):
            if shard.state.value == "leased" and shard.num_microbatches - shard.cursor >= left:
                return job_id, shard.shard_index
        return None

    return wait_for(ready, timeout_s=120, what="commits with a worker running")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _rerun_completes(args: list[str], tmp_path: Path, mixed: object, job_id: str, before: dict) -> None:
    again = run_cli(*args, cwd=tmp_path, env={"ADB_ECHO_DELAY_S": "0.001"})
    assert again.code == 0, again.describe()
    summary = again.json()
    assert summary["job_id"] == job_id, "the rerun did not resume the interrupted job"
    assert summary["state"] == "completed" and summary["verified"] is True
    assert_outcomes_match(read_outcomes(read_manifest(summary["manifest"])), mixed)  # type: ignore[arg-type]
    store = ManifestStore(args[args.index("--store") + 1])
    try:
        after = {(c.shard_index, c.seq): c.sha256 for c in store.list_commits(job_id)}
        assert all(after.get(k) == v for k, v in before.items()), "commits made before the stop were redone"
        assert len(store.list_jobs()) == 1
    finally:
        store.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_sigint_stops_workers_and_the_rerun_resumes(signum: int, tmp_path: Path) -> None:
    proc, args, mixed, store_url = _start_run(tmp_path)
    store = ManifestStore.open(store_url, migrate=True)
    try:
        job_id, _ = _mid_job(store, proc)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signum, (stdout, stderr)
        # the runner may log a retry warning before the stop; the stop itself is one last line
        lines = stderr.strip().splitlines()
        stops = [line for line in lines if "stopped by" in line]
        assert len(stops) == 1 and lines[-1] == stops[0] and "Traceback" not in stderr, stderr
        assert f"stopped by {signal.Signals(signum).name}" in stops[0]
        assert "rerun the same command to resume" in stops[0], stops[0]
        payload = orjson.loads(stdout.strip().splitlines()[-1])
        assert payload["job_id"] == job_id and payload["resumable"] is True, payload
        assert not _workers_of(job_id), "a worker outlived the stopped run"
        shards = store.list_shards(job_id)
        assert all(s.state.value != "leased" for s in shards), "a lease was left held"
        before = {(c.shard_index, c.seq): c.sha256 for c in store.list_commits(job_id)}
    finally:
        _kill_group(proc)
        store.close()
    _rerun_completes(args, tmp_path, mixed, job_id, before)


def test_sigkill_of_the_runner_leaves_no_worker_and_the_rerun_resumes(tmp_path: Path) -> None:
    proc, args, mixed, store_url = _start_run(tmp_path)
    store = ManifestStore.open(store_url, migrate=True)
    try:
        job_id, held = _mid_job(store, proc, left=5)
        os.kill(proc.pid, signal.SIGKILL)  # the runner alone, not its process group
        proc.communicate(timeout=60)
        wait_for(lambda: not _workers_of(job_id), timeout_s=60, what="the workers to die with their runner")
        # killed with their runner, not finished: the shard held at the kill never completed
        shard = store.get_shard(job_id, held)
        assert shard.state.value != "succeeded" and shard.cursor < shard.num_microbatches, shard
        before = {(c.shard_index, c.seq): c.sha256 for c in store.list_commits(job_id)}
    finally:
        _kill_group(proc)
        store.close()
    _rerun_completes(args, tmp_path, mixed, job_id, before)
