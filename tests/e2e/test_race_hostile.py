"""The tail race attacked with real worker processes and real signals (issue 13, hostile).

Each test runs a primary worker and a ``--race`` worker on one shard, attacks one of them
(SIGSTOP past its lease then SIGCONT; SIGKILL between writing an object and committing it;
``deadline-batch cancel``), and then checks what must hold after any attack: one commit per
microbatch, no attempt left running, nothing spent from the shard's budget by the race, and for a
job that finishes, ``deadline-batch verify`` with one outcome per input line. On PostgreSQL (the
production store; tests/integration/test_store_race_hostile.py runs both backends). The racer's
process runs with its own wall clock a day ahead (``time.time`` shifted): only the store's clock
may decide who holds the shard.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.service.finalize import finalize_job
from airflow_deadline_batch.service.planning import PlanRequest, plan_job
from airflow_deadline_batch.store import AttemptRow, ManifestStore
from tests.e2e.conftest import run_cli, wait_for
from tests.helpers.inputs import mixed_input
from tests.helpers.racing import renewing_the_paused_primary, wait_racer_claimed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WAIT_S = 60.0  # generous: a loaded 2-core CI machine starts Python slowly
LINES = 24
SKEW_S = 86400.0

SKEWED_CLOCK = f"""
import time as _time
_real = _time.time
_time.time = lambda: _real() + {SKEW_S}
_real_ns = _time.time_ns
_time.time_ns = lambda: _real_ns() + {int(SKEW_S * 1e9)}
"""


def plan(store: ManifestStore, tmp_path: Path, ttl_s: float, lines: int = LINES) -> str:
    return plan_job(
        store,
        PlanRequest(
            input_uri=str(mixed_input(lines, seed=19).write(tmp_path / "in.jsonl")),
            deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
            output_uri=str(tmp_path / "out"),
            microbatch_size=3,
            max_shards=1,
            max_invalid_fraction=0.5,
            lease_ttl_s=ttl_s,
        ),
    ).job_id


def start_worker(
    url: str, job_id: str, log: Path, *args: str, env: dict[str, str], skewed: bool = False
) -> subprocess.Popen[bytes]:
    extra = dict(env)
    if skewed:
        site = log.parent / f"{log.stem}-site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SKEWED_CLOCK)
        extra["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "airflow_deadline_batch.worker", "--job", job_id, "--shard", "0", *args],
            env={**os.environ, "ADB_STORE_URL": url, **extra},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )


def start_primary(url: str, job_id: str, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The shard's try on the Spot pool."""
    return start_worker(url, job_id, tmp_path / "primary.log", "--pool", "local-spot", env=env)


def start_racer(url: str, job_id: str, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Its racer on the on-demand pool, with a wall clock a day ahead."""
    return start_worker(
        url, job_id, tmp_path / "racer.log", "--pool", "local-on-demand", "--race", env=env, skewed=True
    )


def wait_first_commit(store: ManifestStore, job_id: str) -> None:
    wait_for(lambda: store.get_shard(job_id, 0).cursor >= 1, timeout_s=WAIT_S, what="the primary's commit")


def attempts_of(store: ManifestStore, job_id: str) -> list[AttemptRow]:
    return [a for a in store.list_attempts(job_id) if a.shard_index == 0]


def check_after_attack(store: ManifestStore, job_id: str, tmp_path: Path, *, finished: bool = True) -> None:
    """What must hold after any attack on the race."""
    shard = store.get_shard(job_id, 0)
    seqs = Counter(c.seq for c in store.list_commits(job_id) if c.shard_index == 0)
    assert all(n == 1 for n in seqs.values()), seqs  # one commit per microbatch
    assert sorted(seqs) == list(range(len(seqs)))
    tries = attempts_of(store, job_id)
    assert not [a for a in tries if a.outcome is AttemptOutcome.RUNNING], tries
    assert shard.failures == 0, shard  # the race spent nothing from the budget
    assert shard.race_attempt_id is None or not finished, shard
    if not finished:
        return
    assert shard.state is ShardState.SUCCEEDED, shard
    assert sorted(seqs) == list(range(shard.num_microbatches))
    finalize_job(store, job_id)
    verify_one_outcome_per_line(store, job_id, tmp_path)


def verify_one_outcome_per_line(store: ManifestStore, job_id: str, tmp_path: Path) -> None:
    verified = run_cli("verify", job_id, "--store", store.url, "--json", cwd=tmp_path)
    assert verified.code == 0, verified.describe()
    report = verified.json()
    assert report["published"] is True
    lines = store.get_job(job_id).input_lines
    assert (report["expected"], report["seen"], report["duplicates"]) == (lines, lines, 0), report


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("*.log")))


# on PostgreSQL only (CI time): the fencing is the same SQL on SQLite, where a SIGSTOPped process
# that holds the file's write lock blocks every other writer anyway
@pytest.mark.parametrize("racer_delay", ["0.05", "0.6"], ids=["racer-finishes-first", "racer-still-running"])
def test_a_primary_stopped_past_its_lease_commits_nothing_once_resumed(
    pg_store_url: str, tmp_path: Path, racer_delay: str
) -> None:
    store_url = pg_store_url
    store = ManifestStore.open(store_url)
    job_id = plan(store, tmp_path, ttl_s=4.0, lines=36)
    stalled = tmp_path / "stalled"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # the primary commits microbatch 0, then holds microbatch 1 between its write and its commit
        # (so it cannot win microbatch 1 before the stop: the racer would lose it and exit, and no
        # one would commit while the primary is stopped)
        primary = start_primary(
            store_url,
            job_id,
            tmp_path,
            {
                "ADB_ECHO_DELAY_S": "0.3",
                "ADB_FAULT_PAUSE_AFTER_WRITE": str(stalled),
                "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1",
            },
        )
        procs.append(primary)
        wait_for(stalled.exists, timeout_s=WAIT_S, what="the primary to write microbatch 1")
        racer = start_racer(store_url, job_id, tmp_path, {"ADB_ECHO_DELAY_S": racer_delay})
        procs.append(racer)
        wait_racer_claimed(store, job_id, racer, timeout_s=WAIT_S)
        os.kill(primary.pid, signal.SIGSTOP)
        Path(f"{stalled}.resume").touch()  # once resumed (SIGCONT), it goes on to commit microbatch 1
        [mine] = [a for a in attempts_of(store, job_id) if not a.speculative]
        shard = store.get_shard(job_id, 0)
        if shard.lease_attempt_id == mine.attempt_id and shard.state is ShardState.LEASED:
            expires = shard.lease_expires_at or 0.0
            wait_for(
                lambda: store.db_time() > expires + 0.5, timeout_s=WAIT_S, what="the stopped lease to expire"
            )
        if racer_delay != "0.05":
            wait_for(
                lambda: store.get_shard(job_id, 0).cursor >= shard.cursor + 1,
                timeout_s=WAIT_S,
                what="a commit",
            )
            assert racer.poll() is None, logs(tmp_path)  # the attack: resume while the racer still runs
        else:
            assert racer.wait(timeout=WAIT_S) == 0, logs(tmp_path)
        before = [c.seq for c in store.list_commits(job_id) if c.attempt_id == mine.attempt_id]
        os.kill(primary.pid, signal.SIGCONT)
        assert racer.wait(timeout=WAIT_S) == 0, logs(tmp_path)
        assert primary.wait(timeout=WAIT_S) in (0, 75), logs(tmp_path)
    finally:
        stop_all(procs)
    after = [c.seq for c in store.list_commits(job_id) if c.attempt_id == mine.attempt_id]
    assert after == before, logs(tmp_path)  # fenced: nothing committed once its lease had expired
    ended = {a.attempt_id: a for a in attempts_of(store, job_id)}[mine.attempt_id]
    # resumed alive: it lost the race, or (its lease lapsed, the racer promoted) it stalled
    assert ended.outcome in (AttemptOutcome.LOST_RACE, AttemptOutcome.STALLED), ended
    check_after_attack(store, job_id, tmp_path)
    store.close()


def test_a_racer_killed_between_write_and_commit_leaves_the_primary_to_finish(
    pg_store_url: str, tmp_path: Path
) -> None:
    store_url = pg_store_url
    store = ManifestStore.open(store_url)
    job_id = plan(store, tmp_path, ttl_s=4.0)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        primary = start_primary(store_url, job_id, tmp_path, {"ADB_ECHO_DELAY_S": "0.1"})
        procs.append(primary)
        wait_first_commit(store, job_id)
        racer = start_racer(store_url, job_id, tmp_path, {"ADB_FAULT_KILL_AFTER_WRITE_PROB": "1"})
        procs.append(racer)
        racer_code = racer.wait(timeout=WAIT_S)
        assert racer_code in (-signal.SIGKILL, 0), logs(tmp_path)  # 0: nothing left to race
        assert primary.wait(timeout=WAIT_S) == 0, logs(tmp_path)
    finally:
        stop_all(procs)
    killed = [a for a in attempts_of(store, job_id) if a.speculative]
    assert all(a.outcome is AttemptOutcome.LOST_RACE and a.failure_class is None for a in killed), killed
    check_after_attack(store, job_id, tmp_path)
    store.close()


def test_a_primary_killed_between_write_and_commit_hands_the_shard_to_its_racer(
    pg_store_url: str, tmp_path: Path
) -> None:
    store_url = pg_store_url
    store = ManifestStore.open(store_url)
    job_id = plan(store, tmp_path, ttl_s=20.0)
    stalled = tmp_path / "stalled"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        primary = start_primary(
            store_url,
            job_id,
            tmp_path,
            {"ADB_FAULT_PAUSE_AFTER_WRITE": str(stalled), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1"},
        )
        procs.append(primary)
        wait_for(stalled.exists, timeout_s=WAIT_S, what="the primary to write microbatch 1")
        racer = start_racer(store_url, job_id, tmp_path, {"ADB_ECHO_DELAY_S": "0.2"})
        procs.append(racer)
        wait_racer_claimed(store, job_id, racer, timeout_s=WAIT_S)
        os.kill(primary.pid, signal.SIGKILL)  # after its object write, before its commit
        primary.wait(timeout=WAIT_S)
        [dead] = [a for a in attempts_of(store, job_id) if not a.speculative]
        # the launcher's view of an unexpected death: a crash, which would spend the budget alone
        store.abandon_attempt(
            job_id, 0, dead.attempt_id, "worker died (SIGKILL)", failure=FailureClass.DETERMINISTIC
        )
        assert racer.wait(timeout=WAIT_S) == 0, logs(tmp_path)
    finally:
        stop_all(procs)
    ended = {a.attempt_id: a for a in attempts_of(store, job_id)}
    assert ended[dead.attempt_id].outcome is AttemptOutcome.ABANDONED
    [won] = [a for a in ended.values() if a.speculative]
    assert won.outcome is AttemptOutcome.SUCCEEDED
    assert store.get_shard(job_id, 0).last_pool == "local-on-demand"
    check_after_attack(store, job_id, tmp_path)
    store.close()


def test_cancel_during_a_race_ends_both_tries_and_commits_nothing_more(
    pg_store_url: str, tmp_path: Path
) -> None:
    store_url = pg_store_url
    store = ManifestStore.open(store_url)
    job_id = plan(store, tmp_path, ttl_s=6.0)
    stalled = tmp_path / "stalled"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # both tries hold the shard until the cancel has landed, however long the CLI takes to
        # start: the primary parked between writing microbatch 1 and committing it (its lease
        # renewed), the racer 6 s a microbatch (with 0.3 s both, a loaded machine's racer claimed
        # after the primary had finished, or the cancel came after both were done)
        primary = start_primary(
            store_url,
            job_id,
            tmp_path,
            {"ADB_FAULT_PAUSE_AFTER_WRITE": str(stalled), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1"},
        )
        procs.append(primary)
        wait_for(stalled.exists, timeout_s=WAIT_S, what="the primary to write microbatch 1")
        racer = start_racer(store_url, job_id, tmp_path, {"ADB_ECHO_DELAY_S": "2.0"})
        procs.append(racer)
        wait_racer_claimed(store, job_id, racer, timeout_s=WAIT_S)
        assert racer.poll() is None, logs(tmp_path)
        with ThreadPoolExecutor(1) as pool:
            cancelling = pool.submit(run_cli, "cancel", job_id, "--store", store_url, cwd=tmp_path)
            renewing_the_paused_primary(store, job_id, cancelling.done, what="the cancel", timeout_s=WAIT_S)
            cancelled = cancelling.result()
        assert cancelled.code == 0, cancelled.describe()
        committed = len(store.list_commits(job_id))
        Path(f"{stalled}.resume").touch()  # the primary goes on to commit microbatch 1: refused
        codes = (primary.wait(timeout=WAIT_S), racer.wait(timeout=WAIT_S))
    finally:
        stop_all(procs)
    assert all(code in (0, 75) for code in codes), logs(tmp_path)
    assert len(store.list_commits(job_id)) == committed  # no commit after the cancel
    assert store.get_job(job_id).state is JobState.CANCELLED
    check_after_attack(store, job_id, tmp_path, finished=False)
    # the cancel published the manifest: committed records and the rest as cancelled, one each
    verify_one_outcome_per_line(store, job_id, tmp_path)
    store.close()


def test_both_killed_between_write_and_commit_then_a_third_try_takes_over(
    pg_store_url: str, tmp_path: Path
) -> None:
    store_url = pg_store_url
    store = ManifestStore.open(store_url)
    job_id = plan(store, tmp_path, ttl_s=4.0)
    stalled = tmp_path / "stalled"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        primary = start_primary(
            store_url,
            job_id,
            tmp_path,
            {"ADB_FAULT_PAUSE_AFTER_WRITE": str(stalled), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "1"},
        )
        procs.append(primary)
        wait_for(stalled.exists, timeout_s=WAIT_S, what="the primary to write microbatch 1")
        racer = start_racer(store_url, job_id, tmp_path, {"ADB_FAULT_KILL_AFTER_WRITE_PROB": "1"})
        procs.append(racer)
        wait_racer_claimed(store, job_id, racer, timeout_s=WAIT_S)
        assert racer.wait(timeout=WAIT_S) == -signal.SIGKILL, logs(tmp_path)
        os.kill(primary.pid, signal.SIGKILL)
        primary.wait(timeout=WAIT_S)
        shard = store.get_shard(job_id, 0)
        assert shard.race_attempt_id is not None  # the racer died holding its racing lease
        expires = max(shard.lease_expires_at or 0.0, shard.race_expires_at or 0.0)
        wait_for(lambda: store.db_time() > expires, timeout_s=WAIT_S, what="both leases to expire")
        third = start_worker(store_url, job_id, tmp_path / "third.log", "--pool", "local-spot", env={})
        procs.append(third)
        assert third.wait(timeout=WAIT_S) == 0, logs(tmp_path)
    finally:
        stop_all(procs)
    tries = attempts_of(store, job_id)
    dead = [a for a in tries if a.worker.endswith((f":{primary.pid}", f":{racer.pid}"))]
    assert len(dead) == 2 and all(a.outcome is AttemptOutcome.LOST_LEASE for a in dead), tries
    check_after_attack(store, job_id, tmp_path)
    store.close()
