"""The shard worker on a bad day: an engine that misbehaves, garbage arguments, signals at bad times.

Real worker processes against a real SQLite store and real files; the engine that misbehaves is
``tests.helpers.hostile_engine``, run inside the real worker program. Jobs are created the way
``tests/integration/test_worker.py`` creates them (one shard, straight into the store).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.storage import open_uri
from airflow_deadline_batch.store import ManifestStore
from tests.helpers.waiting import wait_for
from tests.integration.test_worker import (
    EXIT_DONE,
    EXIT_RETRYABLE,
    EXIT_TERMINAL,
    WAIT_S,
    Workers,
    assert_exactly_one_outcome_per_line,
    create_test_job,
    input_lines,
)
from tests.integration.test_worker import workers as workers  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]


class HostileWorkers(Workers):
    """Workers whose engine ``hostile`` (tests.helpers.hostile_engine) misbehaves on cue."""

    module = "tests.helpers.hostile_engine"
    extra_env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[HostileWorkers]:
    pool = HostileWorkers(tmp_path)
    try:
        yield pool
    finally:
        pool.cleanup()


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[tuple[ManifestStore, str]]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = ManifestStore.open(url, migrate=True)
    try:
        yield store, url
    finally:
        store.close()


def prompt_line(record_id: str, prompt: str) -> str:
    return orjson.dumps({"id": record_id, "prompt": prompt}).decode()


# ------------------------------------------------------------------------------------- engine output


def test_a_result_that_cannot_be_recorded_errors_its_record_not_its_microbatch(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, hostile: HostileWorkers
) -> None:
    store, url = sqlite
    markers = ["__surrogate__", "__nan_logprob__", "__bad_finish__", "__huge_usage__"]
    lines = input_lines(6) + [prompt_line(f"bad-{m.strip('_')}", f"please {m}") for m in markers]
    job = create_test_job(
        store, str(tmp_path / "data"), lines, microbatch_size=3, config={"engine": "hostile"}
    )

    worker = hostile.run(url, job.job_id)

    # before: the one bad record failed its whole microbatch (exit 75), try after try
    assert worker.popen.returncode == EXIT_DONE, worker.log
    assert store.get_shard(job.job_id, 0).state is ShardState.SUCCEEDED
    outcomes = {o.line: o for o in assert_exactly_one_outcome_per_line(store, job)}  # every object parses
    for line, prompt in job.prompts.items():
        outcome = outcomes[line]
        if "__" not in prompt:
            assert outcome.status == "succeeded" and outcome.output == " ".join(["echo:", *prompt.split()])
            continue
        assert outcome.status == "errored" and outcome.error is not None, outcome
        assert outcome.error.code == "engine_error"
        assert outcome.error.message.startswith("the engine's result cannot be recorded: ")
    by_id = {o.id: o for o in outcomes.values()}
    assert "surrogates not allowed" in by_id["bad-surrogate"].error.message  # type: ignore[union-attr]
    assert "finish_reason" in by_id["bad-bad_finish"].error.message  # type: ignore[union-attr]
    # the tokens were spent and are kept, unless they are what cannot be recorded
    assert by_id["bad-surrogate"].usage.completion_tokens == 3
    assert by_id["bad-huge_usage"].usage.completion_tokens == 0


def test_an_engine_that_ends_the_process_fails_its_try_instead_of_exiting_done(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, hostile: HostileWorkers
) -> None:
    store, url = sqlite
    lines = [*input_lines(3), prompt_line("quits", "now __exit__")]
    job = create_test_job(
        store,
        str(tmp_path / "data"),
        lines,
        microbatch_size=4,
        config={"engine": "hostile", "max_attempts": 2},
    )

    first = hostile.run(url, job.job_id)

    # before: exit 0 ("shard done") with the shard still leased, nothing recorded
    assert first.popen.returncode == EXIT_RETRYABLE, first.log
    (attempt,) = store.list_attempts(job.job_id)
    assert attempt.outcome is AttemptOutcome.FAILED_RETRYABLE
    assert "tried to end the process (exit code 0)" in (attempt.error or "")
    shard = store.get_shard(job.job_id, 0)
    assert shard.state is ShardState.RETRYABLE_FAILURE and shard.failures == 1
    # a poison shard: the next try spends the last unit of the budget and the shard fails for good
    second = hostile.run(url, job.job_id)
    assert second.popen.returncode == EXIT_TERMINAL, second.log
    shard = store.get_shard(job.job_id, 0)
    assert shard.state is ShardState.TERMINAL_FAILURE
    assert "tried to end the process" in (shard.last_error or "")
    assert store.list_commits(job.job_id) == []


# ------------------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--shard", "abc"), "argument --shard: invalid int value: 'abc'"),
        (("--shard", "0", "--lease-ttl", "nan"), "--lease-ttl must be a number of seconds > 0"),
        (("--shard", "0", "--lease-ttl", "1e300"), "--lease-ttl must be a number of seconds > 0"),
        (("--shard", "0", "--grace", "inf"), "--grace must be a number of seconds >= 0"),
        # before: exit 75 (deterministic), so a launcher retried a try that can never claim
        (("--shard", "5"), "has no shard 5; check the shard index"),
    ],
)
def test_garbage_arguments_are_one_line_and_exit_1_before_any_claim(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    store, url = sqlite
    job = create_test_job(store, str(tmp_path / "data"), input_lines(2), microbatch_size=2)
    done = subprocess.run(
        [sys.executable, "-m", "airflow_deadline_batch.worker", "--job", job.job_id, *args],
        env={**os.environ, "ADB_STORE_URL": url},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    # before: argparse exited 2 (no worker exit code) after its usage text; a NaN lease was claimed
    # and lost at once (75); an infinite or huge one was claimed and outlived a dead worker
    assert done.returncode == EXIT_TERMINAL, done.stderr
    (line,) = done.stderr.splitlines()
    assert says in line
    assert store.list_attempts(job.job_id) == []
    assert store.get_shard(job.job_id, 0).state is ShardState.PENDING


def test_a_job_whose_lease_ttl_is_not_a_number_of_seconds_is_refused_before_the_claim(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, workers: Workers
) -> None:
    store, url = sqlite
    job = create_test_job(
        store, str(tmp_path / "data"), input_lines(2), microbatch_size=2, config={"lease_ttl_s": 1e300}
    )
    worker = workers.run(url, job.job_id)
    assert worker.popen.returncode == EXIT_TERMINAL, worker.log
    assert "has lease_ttl_s 1e+300" in worker.log and "pass --lease-ttl" in worker.log
    assert store.list_attempts(job.job_id) == []
    # an explicit, valid --lease-ttl overrides the job's
    assert workers.run(url, job.job_id, "--lease-ttl", "30").popen.returncode == EXIT_DONE


# ------------------------------------------------------------------------------------- a hung engine


def test_an_engine_that_hangs_loses_its_lease_instead_of_keeping_it_alive_forever(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, hostile: HostileWorkers
) -> None:
    store, url = sqlite
    lines = [*input_lines(2), prompt_line("stuck", "a much longer prompt that hangs __hang__")]
    job = create_test_job(
        store, str(tmp_path / "data"), lines, microbatch_size=2, config={"engine": "hostile"}
    )
    # two microbatches: the first commits, the second (the longest prompt) never returns
    worker = hostile.start(url, job.job_id, "--lease-ttl", "1.5", "--stall-timeout", "3")

    # before: the heartbeat thread renewed the hung worker's lease for ever; the wait timed out
    assert worker.wait() == EXIT_RETRYABLE, worker.log
    assert "the engine made no progress for" in worker.log and "during microbatch 1" in worker.log
    (attempt,) = store.list_attempts(job.job_id)
    assert attempt.outcome is AttemptOutcome.FAILED_RETRYABLE
    assert attempt.failure_class == "deterministic"
    shard = store.get_shard(job.job_id, 0)
    assert shard.state is ShardState.RETRYABLE_FAILURE and shard.cursor == 1
    assert shard.failures == 0  # the try committed a microbatch: it spends no budget
    assert [c.seq for c in store.list_commits(job.job_id)] == [0]


def test_a_worker_stopped_past_its_lease_mid_microbatch_ends_stalled_not_hung(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, workers: Workers
) -> None:
    store, url = sqlite
    job = create_test_job(store, str(tmp_path / "data"), input_lines(6), microbatch_size=2)
    # the stall limit is shorter than the stop: the stopped time is not the engine's
    worker = workers.start(
        url,
        job.job_id,
        "--lease-ttl",
        "1.5",
        "--stall-timeout",
        "2",
        "--engine-option",
        "delay_s_per_record=0.4",
    )
    wait_for(lambda: store.get_shard(job.job_id, 0).cursor >= 1, timeout_s=WAIT_S, what="the first commit")
    worker.kill(signal.SIGSTOP)
    try:
        expires = store.get_shard(job.job_id, 0).lease_expires_at
        assert expires is not None
        wait_for(lambda: store.db_time() > expires + 2.0, timeout_s=WAIT_S, what="the lease to expire")
    finally:
        worker.kill(signal.SIGCONT)

    assert worker.wait() == EXIT_RETRYABLE, worker.log
    (attempt,) = store.list_attempts(job.job_id)
    assert attempt.outcome is AttemptOutcome.STALLED, worker.log
    assert "made no progress" not in worker.log
    # fenced: nothing committed after the lease lapsed, and the shard is free for the next try
    assert [c.seq for c in store.list_commits(job.job_id)] == [0]
    assert store.get_shard(job.job_id, 0).state is ShardState.RETRYABLE_FAILURE


# ------------------------------------------------------------------------------------- the input


def test_an_input_deleted_after_planning_stops_the_job_instead_of_spending_every_shards_budget(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, workers: Workers
) -> None:
    store, url = sqlite
    job = create_test_job(store, str(tmp_path / "data"), input_lines(4), microbatch_size=2)
    storage, key = open_uri(job.input_uri)
    storage.delete(key)

    worker = workers.run(url, job.job_id)

    # before: a deterministic failure (exit 75), one unit of budget per try, then shard_failed
    assert worker.popen.returncode == EXIT_TERMINAL, worker.log
    assert "no longer exists" in worker.log and "restore it, or re-plan the job" in worker.log
    assert store.get_shard(job.job_id, 0).state is ShardState.TERMINAL_FAILURE
    stopped = store.get_job(job.job_id)
    assert stopped.state is JobState.FAILED and "no longer exists" in (stopped.error or "")


def test_a_hung_engine_whose_job_is_cancelled_still_ends(
    sqlite: tuple[ManifestStore, str], tmp_path: Path, hostile: HostileWorkers
) -> None:
    store, url = sqlite
    lines = [prompt_line("stuck", "hangs __hang__")]
    job = create_test_job(
        store, str(tmp_path / "data"), lines, microbatch_size=1, config={"engine": "hostile"}
    )
    worker = hostile.start(url, job.job_id, "--lease-ttl", "1.5", "--stall-timeout", "4")
    wait_for(lambda: "engine hostile loaded" in worker.log, timeout_s=WAIT_S, what="the engine to load")
    store.cancel_job(job.job_id, reason="cancelled while its engine hangs")  # fences the lease
    wait_for(lambda: "lease lost" in worker.log, timeout_s=WAIT_S, what="the heartbeat to lose the lease")

    # before: the heartbeat thread ended with the lease, so nothing watched the engine any more
    # and the process hung for ever (its launcher waiting on it)
    assert worker.wait() == EXIT_RETRYABLE, worker.log
    assert "the engine made no progress for" in worker.log
    assert store.list_commits(job.job_id) == []


# ------------------------------------------------------------------------------------- the store


def test_a_store_url_with_a_wrong_password_is_one_masked_line_and_exit_1(
    pg_password_store_url: str, tmp_path: Path, workers: Workers
) -> None:
    store = ManifestStore.open(pg_password_store_url, migrate=True)
    try:
        job = create_test_job(store, str(tmp_path / "data"), input_lines(2), microbatch_size=2)
        password = pg_password_store_url.split(":", 2)[2].split("@", 1)[0]
        wrong = pg_password_store_url.replace(f":{password}@", ":not-the-password@", 1)

        worker = workers.run(wrong, job.job_id)

        assert worker.popen.returncode == EXIT_TERMINAL, worker.log
        (line,) = worker.log.splitlines()
        assert "cannot claim (configuration)" in line and "password authentication failed" in line
        assert "not-the-password" not in line and password not in line
        assert store.list_attempts(job.job_id) == []
    finally:
        store.close()


# ------------------------------------------------------------------------------------- the local disk


def test_an_object_past_the_file_size_limit_leaves_nothing_behind_and_frees_the_shard(
    sqlite: tuple[ManifestStore, str], tmp_path: Path
) -> None:
    store, url = sqlite
    # 20 records of ~14 KB in one microbatch: its object (~280 KB) passes the 200 KB limit the
    # worker runs under, the store's small writes do not
    lines = [prompt_line(f"r{i}", ("w" * 7000 + " ") * 2) for i in range(20)]
    job = create_test_job(store, str(tmp_path / "data"), lines, microbatch_size=20)
    limit = 200 * 1024

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-m", "airflow_deadline_batch.worker", "--job", job.job_id, "--shard", "0"],
        env={**os.environ, "ADB_STORE_URL": url},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        preexec_fn=limit_file_size,  # noqa: PLW1509 - a resource limit, no threads in the child yet
    )

    assert done.returncode == EXIT_RETRYABLE, done.stderr
    assert "File too large" in done.stderr
    (attempt,) = store.list_attempts(job.job_id)
    assert attempt.outcome is AttemptOutcome.FAILED_RETRYABLE and "File too large" in (attempt.error or "")
    assert store.get_shard(job.job_id, 0).state is ShardState.RETRYABLE_FAILURE  # the lease is released
    assert store.list_commits(job.job_id) == []
    out = Path(job.output_uri)
    assert not out.exists() or [p for p in out.rglob("*") if p.is_file()] == []  # no partial object, no temp
