"""The shard worker as a real subprocess against a real store: completion, preemption, kills, fencing.

Jobs are created directly with ``ManifestStore.create_job`` from a small input written here, so
these tests depend on the store, storage and record parsing only, not on the planner.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_deadline_batch.core.ids import new_job_id
from airflow_deadline_batch.core.packing import microbatch_count
from airflow_deadline_batch.core.records import LineError, Record, ValidationLimits, Validator, iter_raw_lines
from airflow_deadline_batch.core.results import ResultRecord, encode_results
from airflow_deadline_batch.core.states import AttemptOutcome, ShardState
from airflow_deadline_batch.storage import join_uri, open_storage, open_uri, sha256_hex
from airflow_deadline_batch.store import ManifestStore, NewCommit, NewJob, NewShard
from airflow_deadline_batch.worker.engines.echo import FAIL_MARKER
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EXIT_DONE, EXIT_TERMINAL, EXIT_RETRYABLE = 0, 1, 75
WAIT_S = 30.0  # generous deadline for conditions on a loaded 2-core CI machine


# ------------------------------------------------------------------------------------- helpers


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout_s``."""
    return wait_for(predicate, timeout_s=timeout_s, what=what, interval_s=0.02)


def input_lines(n: int, *, extra: Sequence[str] = ()) -> list[str]:
    """``n`` native records of varied lengths (so length-aware ordering matters), then ``extra`` lines."""
    lines = [
        orjson.dumps(
            {"id": f"r{i}", "prompt": " ".join(f"w{i}x{k}" for k in range(1 + (i * 7) % 5))}
        ).decode()
        for i in range(n)
    ]
    return lines + list(extra)


@dataclass(frozen=True)
class PlannedShardJob:
    job_id: str
    input_uri: str
    output_uri: str
    outcome_lines: frozenset[int]  # every line that must have exactly one outcome
    prompts: dict[int, str] = field(default_factory=dict)  # line -> prompt of valid records
    num_microbatches: int = 0


def create_test_job(
    store: ManifestStore,
    base_uri: str,
    lines: Sequence[str],
    *,
    microbatch_size: int,
    config: dict[str, Any] | None = None,
) -> PlannedShardJob:
    """Write ``lines`` as the input, then record a one-shard job the way the planner would."""
    data = ("\n".join(lines) + "\n").encode()
    input_uri = join_uri(base_uri, "input", "records.jsonl")
    storage, key = open_uri(input_uri)
    storage.put_bytes(key, data)
    limits = ValidationLimits()
    validator = Validator(limits)
    records: list[Record] = []
    errors: list[LineError] = []
    for raw in iter_raw_lines(io.BytesIO(data), max_line_bytes=limits.max_line_bytes):
        outcome = validator.feed(raw)
        if isinstance(outcome, Record):
            records.append(outcome)
        elif isinstance(outcome, LineError):
            errors.append(outcome)
    job_id = new_job_id()
    output_uri = join_uri(base_uri, "out", job_id)
    validation = None
    if errors:
        blob = encode_results(ResultRecord.from_line_error(e) for e in errors)
        uri = open_storage(output_uri).put_bytes("validation/errors.jsonl", blob)
        validation = NewCommit(
            uri=uri, sha256=sha256_hex(blob), records=len(errors), counts={"errored": len(errors)}
        )
    n_mb = microbatch_count(len(records), microbatch_size)
    shard = NewShard(
        shard_index=0,
        byte_start=0,
        byte_end=len(data),
        first_line=1,
        line_count=len(lines),
        records=len(records),
        num_microbatches=n_mb,
        input_sha256=sha256_hex(data),
        est_work_s=1.0,
        excluded_lines=tuple(e.line for e in errors),
    )
    job = NewJob(
        job_id=job_id,
        deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        input_uri=input_uri,
        input_sha256=sha256_hex(data),
        input_lines=len(records) + len(errors),
        input_total_lines=len(lines),
        output_uri=output_uri,
        config={
            "engine": "echo",
            "model": None,
            "model_digest": None,
            "generation": {"max_tokens": 64},
            "microbatch_size": microbatch_size,
            "max_attempts": 10,
            "lease_ttl_s": 30.0,
            **(config or {}),
        },
    )
    store.create_job(job, [shard], validation)
    prompts = {r.line: r.request.prompt or "" for r in records}
    return PlannedShardJob(
        job_id, input_uri, output_uri, frozenset([*prompts, *(e.line for e in errors)]), prompts, n_mb
    )


@dataclass
class Worker:
    popen: subprocess.Popen[bytes]
    log_path: Path

    def wait(self, timeout_s: float = WAIT_S) -> int:
        return self.popen.wait(timeout=timeout_s)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self, signum: int) -> None:
        os.kill(self.popen.pid, signum)


class Workers:
    """Starts worker subprocesses and makes sure none outlives its test."""

    #: the program each worker runs (``python -m MODULE``), and what its environment adds
    module = "airflow_deadline_batch.worker"
    extra_env: dict[str, str] = {}

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Worker] = []

    def start(self, store_url: str, job_id: str, *args: str, env: dict[str, str] | None = None) -> Worker:
        log_path = self.tmp_path / f"worker-{len(self.started)}.log"
        full_env = {**os.environ, **self.extra_env, "ADB_STORE_URL": store_url, **(env or {})}
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    self.module,
                    "--job",
                    job_id,
                    "--shard",
                    "0",
                    *args,
                ],
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        worker = Worker(popen, log_path)
        self.started.append(worker)
        return worker

    def run(self, store_url: str, job_id: str, *args: str, env: dict[str, str] | None = None) -> Worker:
        worker = self.start(store_url, job_id, *args, env=env)
        worker.wait()
        return worker

    def cleanup(self) -> None:
        for worker in self.started:
            if worker.popen.poll() is None:
                worker.popen.kill()
                worker.popen.wait()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    try:
        yield pool
    finally:
        pool.cleanup()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[ManifestStore]:
    """A migrated SQLite store, for the tests whose point is not the database."""
    store = ManifestStore.open(f"sqlite:///{tmp_path / 'store.db'}", migrate=True)
    try:
        yield store
    finally:
        store.close()


def committed_outcomes(store: ManifestStore, job_id: str) -> list[ResultRecord]:
    """Every outcome in the job's committed objects, each object checked against its SHA-256."""
    outcomes = []
    for commit in store.list_commits(job_id):
        storage, key = open_uri(commit.uri)
        data = storage.get_bytes(key)
        assert sha256_hex(data) == commit.sha256, f"object {commit.uri} does not match its commit"
        rows = [ResultRecord.parse_line(line) for line in data.splitlines()]
        assert len(rows) == commit.records
        outcomes.extend(rows)
    return outcomes


def assert_exactly_one_outcome_per_line(store: ManifestStore, job: PlannedShardJob) -> list[ResultRecord]:
    outcomes = committed_outcomes(store, job.job_id)
    per_line = Counter(o.line for o in outcomes)
    duplicated = sorted(line for line, n in per_line.items() if n > 1)
    assert not duplicated, f"lines with more than one outcome: {duplicated}"
    assert set(per_line) == set(job.outcome_lines)
    return outcomes


def assert_one_commit_per_seq(store: ManifestStore, job: PlannedShardJob) -> dict[int, str]:
    """Seq -> attempt ID of the shard's commits; exactly one commit per microbatch."""
    commits = [c for c in store.list_commits(job.job_id) if c.shard_index == 0]
    seqs = [c.seq for c in commits]
    assert sorted(seqs) == list(range(job.num_microbatches)), seqs
    return {c.seq: c.attempt_id for c in commits}


def shard_cursor(store: ManifestStore, job_id: str) -> int:
    return store.get_shard(job_id, 0).cursor


# ------------------------------------------------------------------------------------- (a) done


def test_worker_completes_a_shard_and_a_rerun_is_a_no_op(
    store: ManifestStore, store_url: str, tmp_path: Path, workers: Workers
) -> None:
    lines = input_lines(
        10,
        extra=[
            "",
            "{not json",
            orjson.dumps({"id": "bad", "prompt": f"x {FAIL_MARKER}"}).decode(),
            orjson.dumps({"id": "r3", "prompt": "duplicate id"}).decode(),
        ],
    )
    job = create_test_job(store, str(tmp_path / "data"), lines, microbatch_size=4)
    assert job.num_microbatches == 3  # 11 valid records (the fail marker is valid input)

    first = workers.run(store_url, job.job_id)
    assert first.popen.returncode == EXIT_DONE, first.log

    outcomes = assert_exactly_one_outcome_per_line(store, job)
    by_line = {o.line: o for o in outcomes}
    for line, prompt in job.prompts.items():
        outcome = by_line[line]
        if FAIL_MARKER in prompt:
            assert outcome.status == "errored" and outcome.error is not None
            assert outcome.error.code == "engine_error"
        else:
            assert outcome.status == "succeeded"
            assert outcome.output == " ".join(["echo:", *prompt.split()])
            assert outcome.usage.prompt_tokens == len(prompt.split())
        assert outcome.shard_id == "00000"
    assert by_line[12].error is not None and by_line[12].error.code == "invalid_json"
    assert by_line[14].error is not None and by_line[14].error.code == "duplicate_id"
    assert 11 not in by_line  # a blank line is not a record

    shard = store.get_shard(job.job_id, 0)
    assert shard.state is ShardState.SUCCEEDED and shard.cursor == 3
    (attempt,) = store.list_attempts(job.job_id)
    assert attempt.outcome is AttemptOutcome.SUCCEEDED
    commits = [c for c in store.list_commits(job.job_id) if c.shard_index == 0]
    assert [c.uri for c in commits] == [
        join_uri(job.output_uri, f"attempts/{attempt.attempt_id}/shard-00000-mb-{seq:06d}.jsonl")
        for seq in range(3)
    ]
    assert all(c.attempt_id == attempt.attempt_id for c in commits)
    assert f"job={job.job_id} shard=00000 attempt={attempt.attempt_id}" in first.log
    assert "w1x" not in first.log  # record contents never reach the log

    again = workers.run(store_url, job.job_id)
    assert again.popen.returncode == EXIT_DONE, again.log
    assert "already committed" in again.log
    assert len(store.list_attempts(job.job_id)) == 1
    assert len(store.list_commits(job.job_id)) == 4  # 3 microbatches + the validation object


# ------------------------------------------------------------------------------------- (b) SIGTERM


def test_sigterm_mid_shard_keeps_committed_work_and_a_new_worker_resumes(
    store: ManifestStore, store_url: str, tmp_path: Path, workers: Workers
) -> None:
    job = create_test_job(store, str(tmp_path / "data"), input_lines(30), microbatch_size=3)
    first = workers.start(store_url, job.job_id, "--engine-option", "delay_s_per_record=0.1")
    wait_until(lambda: shard_cursor(store, job.job_id) >= 1, "the first microbatch commit")
    first.kill(signal.SIGTERM)
    assert first.wait() == EXIT_RETRYABLE, first.log

    stopped_at = shard_cursor(store, job.job_id)
    assert 1 <= stopped_at < job.num_microbatches
    (attempt,) = store.list_attempts(job.job_id)
    assert attempt.outcome is AttemptOutcome.PREEMPTED
    assert store.get_shard(job.job_id, 0).state is ShardState.RETRYABLE_FAILURE
    assert len(store.list_commits(job.job_id)) == stopped_at

    second = workers.run(store_url, job.job_id)
    assert second.popen.returncode == EXIT_DONE, second.log
    assert f"resuming at microbatch {stopped_at} " in second.log
    by_seq = assert_one_commit_per_seq(store, job)
    second_attempt = store.list_attempts(job.job_id)[1].attempt_id
    assert by_seq == {
        seq: attempt.attempt_id if seq < stopped_at else second_attempt for seq in range(job.num_microbatches)
    }
    assert_exactly_one_outcome_per_line(store, job)


def test_sigterm_abandons_a_microbatch_that_cannot_fit_in_the_grace(
    sqlite_store: ManifestStore, tmp_path: Path, workers: Workers
) -> None:
    store, store_url = sqlite_store, f"sqlite:///{tmp_path / 'store.db'}"
    # 20 microbatches of ~0.8 s: however late a loaded machine delivers the signal, it lands mid-shard
    job = create_test_job(store, str(tmp_path / "data"), input_lines(40), microbatch_size=2)
    worker = workers.start(
        store_url, job.job_id, "--grace", "0.5", "--engine-option", "delay_s_per_record=0.4"
    )
    wait_until(lambda: shard_cursor(store, job.job_id) >= 1, "the first microbatch commit")
    # the next microbatch is measured to take ~0.8 s: more than the 0.5 s grace
    worker.kill(signal.SIGTERM)
    assert worker.wait() == EXIT_RETRYABLE, worker.log
    assert "would not fit in the grace period" in worker.log
    assert store.list_attempts(job.job_id)[0].outcome is AttemptOutcome.PREEMPTED
    assert shard_cursor(store, job.job_id) < job.num_microbatches


def test_second_signal_stops_at_once(sqlite_store: ManifestStore, tmp_path: Path, workers: Workers) -> None:
    store, store_url = sqlite_store, f"sqlite:///{tmp_path / 'store.db'}"
    job = create_test_job(store, str(tmp_path / "data"), input_lines(4), microbatch_size=4)
    # a 20 s microbatch with a 600 s grace: only the second signal can end it early
    worker = workers.start(store_url, job.job_id, "--grace", "600", "--engine-option", "delay_s_per_record=5")
    wait_until(lambda: "engine echo loaded" in worker.log, "the engine to load")
    worker.kill(signal.SIGTERM)
    wait_until(lambda: "preemption notice" in worker.log, "the first signal to be handled")
    worker.kill(signal.SIGINT)
    assert worker.wait() == EXIT_RETRYABLE, worker.log
    assert store.list_attempts(job.job_id)[0].outcome is AttemptOutcome.PREEMPTED
    assert store.list_commits(job.job_id) == []
    assert store.get_shard(job.job_id, 0).state is ShardState.RETRYABLE_FAILURE


# ------------------------------------------------------------------------------------- (c) SIGKILL


def test_sigkill_between_write_and_commit_loses_only_that_microbatch(
    store: ManifestStore, store_url: str, tmp_path: Path, workers: Workers
) -> None:
    job = create_test_job(store, str(tmp_path / "data"), input_lines(6), microbatch_size=2)
    pause = tmp_path / "paused"
    first = workers.start(
        store_url,
        job.job_id,
        env={"ADB_FAULT_PAUSE_AFTER_WRITE": str(pause), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1"},
    )
    wait_until(pause.exists, "the worker to pause between write and commit")
    assert pause.read_text().split() == [str(first.popen.pid), "1"]
    first.kill(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL

    (attempt,) = store.list_attempts(job.job_id)
    orphan_key = f"attempts/{attempt.attempt_id}/shard-00000-mb-000001.jsonl"
    output = open_storage(job.output_uri)
    assert output.exists(orphan_key)  # written ...
    orphan_uri = output.uri(orphan_key)
    assert [c.seq for c in store.list_commits(job.job_id)] == [0]  # ... but not committed
    assert store.abandon_attempt(job.job_id, 0, attempt.attempt_id, "worker killed")

    second = workers.run(store_url, job.job_id)
    assert second.popen.returncode == EXIT_DONE, second.log
    by_seq = assert_one_commit_per_seq(store, job)
    assert by_seq[0] == attempt.attempt_id and by_seq[1] != attempt.attempt_id
    assert orphan_uri not in {c.uri for c in store.list_commits(job.job_id)}
    assert output.exists(orphan_key)  # garbage collection is the finalizer's job
    assert_exactly_one_outcome_per_line(store, job)
    assert store.list_attempts(job.job_id)[0].outcome is AttemptOutcome.ABANDONED


# ------------------------------------------------------------------------------------- (d) two workers


def test_second_worker_is_refused_while_the_first_lease_is_live(
    store: ManifestStore, store_url: str, tmp_path: Path, workers: Workers
) -> None:
    job = create_test_job(store, str(tmp_path / "data"), input_lines(4), microbatch_size=2)
    first = workers.start(store_url, job.job_id, "--engine-option", "delay_s_per_record=5")
    wait_until(lambda: store.get_shard(job.job_id, 0).state is ShardState.LEASED, "the first claim")
    second = workers.run(store_url, job.job_id)
    assert second.popen.returncode == EXIT_RETRYABLE, second.log
    assert "leased by another live attempt" in second.log
    assert len(store.list_attempts(job.job_id)) == 1
    first.kill(signal.SIGINT)
    assert first.wait() == EXIT_RETRYABLE, first.log


def test_a_stopped_worker_is_fenced_after_its_lease_expires(
    store: ManifestStore, store_url: str, tmp_path: Path, workers: Workers
) -> None:
    job = create_test_job(store, str(tmp_path / "data"), input_lines(6), microbatch_size=2)
    pause = tmp_path / "paused"
    first = workers.start(
        store_url,
        job.job_id,
        "--lease-ttl",
        "2",
        env={"ADB_FAULT_PAUSE_AFTER_WRITE": str(pause), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1"},
    )
    wait_until(pause.exists, "the first worker to write microbatch 1")
    first.kill(signal.SIGSTOP)
    try:
        expires = store.get_shard(job.job_id, 0).lease_expires_at
        assert expires is not None
        wait_until(lambda: store.db_time() > expires, "the first lease to expire")
        second = workers.run(store_url, job.job_id)
        assert second.popen.returncode == EXIT_DONE, second.log
    finally:
        first.kill(signal.SIGCONT)
    Path(f"{pause}.resume").touch()
    assert first.wait() == EXIT_RETRYABLE, first.log
    assert "lost its lease" in first.log

    first_attempt, second_attempt = store.list_attempts(job.job_id)
    # the take-over ended it lost_lease; its worker, alive again, made it stalled (not a preemption)
    assert first_attempt.outcome is AttemptOutcome.STALLED
    assert second_attempt.outcome is AttemptOutcome.SUCCEEDED
    by_seq = assert_one_commit_per_seq(store, job)
    assert by_seq == {0: first_attempt.attempt_id, 1: second_attempt.attempt_id, 2: second_attempt.attempt_id}
    assert open_storage(job.output_uri).exists(
        f"attempts/{first_attempt.attempt_id}/shard-00000-mb-000001.jsonl"
    )
    assert_exactly_one_outcome_per_line(store, job)


# ------------------------------------------------------------------------------------- (e) S3


def test_worker_reads_and_writes_s3(
    sqlite_store: ManifestStore, s3_base_uri: str, tmp_path: Path, workers: Workers
) -> None:
    store, store_url = sqlite_store, f"sqlite:///{tmp_path / 'store.db'}"
    job = create_test_job(store, s3_base_uri, input_lines(7, extra=["[1, 2]"]), microbatch_size=3)
    assert job.input_uri.startswith("s3://") and job.output_uri.startswith("s3://")
    worker = workers.run(store_url, job.job_id)
    assert worker.popen.returncode == EXIT_DONE, worker.log
    commits = [c for c in store.list_commits(job.job_id) if c.shard_index == 0]
    assert len(commits) == 3 and all(c.uri.startswith(s3_base_uri) for c in commits)
    outcomes = assert_exactly_one_outcome_per_line(store, job)
    assert Counter(o.status for o in outcomes) == {"succeeded": 7, "errored": 1}
    assert workers.run(store_url, job.job_id).popen.returncode == EXIT_DONE


# ------------------------------------------------------------------------------------- (f) terminal


def test_model_digest_mismatch_is_terminal(
    sqlite_store: ManifestStore, tmp_path: Path, workers: Workers
) -> None:
    store, store_url = sqlite_store, f"sqlite:///{tmp_path / 'store.db'}"
    job = create_test_job(
        store, str(tmp_path / "data"), input_lines(3), microbatch_size=2, config={"model_digest": "0" * 64}
    )
    worker = workers.run(store_url, job.job_id)
    assert worker.popen.returncode == EXIT_TERMINAL, worker.log
    assert "model digest mismatch" in worker.log
    assert store.get_shard(job.job_id, 0).state is ShardState.TERMINAL_FAILURE
    assert store.list_attempts(job.job_id)[0].outcome is AttemptOutcome.FAILED_TERMINAL
    assert store.list_commits(job.job_id) == []
    # a terminal shard is not retried
    assert workers.run(store_url, job.job_id).popen.returncode == EXIT_TERMINAL


def test_tampered_input_range_is_terminal(
    sqlite_store: ManifestStore, tmp_path: Path, workers: Workers
) -> None:
    store, store_url = sqlite_store, f"sqlite:///{tmp_path / 'store.db'}"
    job = create_test_job(store, str(tmp_path / "data"), input_lines(3), microbatch_size=2)
    storage, key = open_uri(job.input_uri)
    data = storage.get_bytes(key)
    storage.put_bytes(key, data.replace(b"w0x0", b"w0x9"))  # same length, different bytes
    worker = workers.run(store_url, job.job_id)
    assert worker.popen.returncode == EXIT_TERMINAL, worker.log
    assert "the input changed after planning" in worker.log
    assert store.get_shard(job.job_id, 0).state is ShardState.TERMINAL_FAILURE
    assert store.list_commits(job.job_id) == []


def test_bad_engine_option_is_terminal(sqlite_store: ManifestStore, tmp_path: Path, workers: Workers) -> None:
    store, store_url = sqlite_store, f"sqlite:///{tmp_path / 'store.db'}"
    job = create_test_job(
        store, str(tmp_path / "data"), input_lines(2), microbatch_size=2, config={"engine": "no-such-engine"}
    )
    worker = workers.run(store_url, job.job_id)
    assert worker.popen.returncode == EXIT_TERMINAL, worker.log
    assert "unknown engine" in worker.log
