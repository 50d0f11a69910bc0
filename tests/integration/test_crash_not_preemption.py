"""A crash on Spot is not a preemption: a crash loop is not a Spot storm (docs/design.md §4.4, issue 13).

Real subprocess workers started by the local launcher (``local.launcher``), real signals, SQLite
and PostgreSQL. A Spot worker that dies of a SIGSEGV or SIGABRT nobody in the launcher sent (a
segfault, an abort in the engine) is fenced ``abandoned`` with class ``deterministic``: six such
crashes in a row, enough for the storm rule's default (6 + workers - 1 fruitless tries), leave 0
preemptions in the job view, the progress report, the UI model, the metrics and what a later job
learns of the pool, and the next try stays on Spot. Their Spot time still counts as Spot time and
their uncommitted work as redone. The launcher's own kill (an injected preemption) is one
preemption everywhere. Then every reader against the rule itself, on rows of every outcome and
class: the SQL of the progress report, the fold of ``pool_stats`` and the job view agree.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from airflow_deadline_batch import metrics
from airflow_deadline_batch.core.exit_codes import EXIT_RETRYABLE
from airflow_deadline_batch.core.failures import FailureClass
from airflow_deadline_batch.core.placement import DEFAULT_POLICY
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import TERMINAL_ATTEMPT_OUTCOMES, AttemptOutcome, is_preemption
from airflow_deadline_batch.local.launcher import (
    WorkerProcess,
    fence_dead_worker,
    run_worker_subprocess,
    start_worker,
)
from airflow_deadline_batch.operators.placement import TryAction, decide_for_try, read_job_view
from airflow_deadline_batch.store import ManifestStore
from airflow_deadline_batch.store.schema import attempts
from airflow_deadline_batch.ui import model
from tests.integration.test_worker import create_test_job, input_lines, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SPOT = PoolSpec(name="local-spot", kind=PoolKind.SPOT, price_per_gpu_hour=1.0, preemptions_per_hour=0.5)
ON_DEMAND = PoolSpec(name="local-on-demand", kind=PoolKind.ON_DEMAND, price_per_gpu_hour=3.0)
CONFIG = {"pools": [SPOT.to_dict(), ON_DEMAND.to_dict()], "workers": 1}
#: fruitless Spot tries that make a storm for a one-worker job under the default policy
STORM = DEFAULT_POLICY.storm_tries
UTC = dt.timezone.utc


def two_jobs(store: ManifestStore, tmp_path: Path) -> tuple[str, str]:
    """The job whose worker crashes, and a later job on the same pools (what it learns of Spot)."""
    job = create_test_job(store, str(tmp_path / "data"), input_lines(4), microbatch_size=2, config=CONFIG)
    later = create_test_job(store, str(tmp_path / "later"), input_lines(1), microbatch_size=1, config=CONFIG)
    return job.job_id, later.job_id


def paused_env(pause: Path) -> dict[str, str]:
    """The worker writes microbatch 0's object, then waits before committing it (nothing committed)."""
    return {"ADB_FAULT_PAUSE_AFTER_WRITE": str(pause), "ADB_FAULT_PAUSE_BEFORE_COMMIT_SEQ": "0"}


def crash_once(store_url: str, job_id: str, pause: Path, signum: signal.Signals) -> int:
    """One try through the launcher (``run_worker_subprocess``) whose worker dies of ``signum``,
    sent by nobody in the launcher, between writing its first object and committing it."""
    with ThreadPoolExecutor(1) as pool:
        launched = pool.submit(
            run_worker_subprocess, store_url, job_id, 0, pool=SPOT.name, env=paused_env(pause)
        )
        wait_until(lambda: pause.exists() or launched.done(), "the worker to write microbatch 0")
        if not launched.done():
            os.kill(int(pause.read_text().split()[0]), signum)
        return launched.result(timeout=60)


def kill_paused_worker(store_url: str, job_id: str, pause: Path) -> WorkerProcess:
    """Start a worker of shard 0 through the launcher, SIGKILL it once it wrote microbatch 0 (not
    committed), and return it dead, for the caller to fence."""
    proc = start_worker(store_url, job_id, 0, pool=SPOT.name, env=paused_env(pause))
    try:
        wait_until(pause.exists, "the worker to write microbatch 0")
        proc.signal(signal.SIGKILL)
        assert proc.popen.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait()
    return proc


def counted(store: ManifestStore, job_id: str, later_id: str) -> dict[str, int]:
    """Preemptions of ``job_id`` as each reader counts them."""
    now = dt.datetime.now(UTC)
    view = read_job_view(store, job_id, now=now)
    page = model.read_job_page(store, job_id, now=now)
    return {
        "job view": view.spot_tries.preemptions,
        "progress": store.progress(job_id).preemptions,
        "ui page": page.preemptions,
        "ui shard lines": sum(line.preemptions for line in page.shards),
        "metrics": int(metrics.job_metrics(view)[metrics.PREEMPTIONS]),
        "later job's history": store.pool_history([SPOT.name], exclude_job=later_id)[SPOT.name].preemptions,
    }


def test_a_crash_loop_on_spot_is_no_storm_and_the_launchers_kill_is_a_preemption(
    store: ManifestStore, store_url: str, tmp_path: Path
) -> None:
    job_id, later_id = two_jobs(store, tmp_path)
    crashes = [signal.SIGSEGV, signal.SIGABRT] * (STORM // 2) + [signal.SIGSEGV] * (STORM % 2)
    for n, signum in enumerate(crashes):
        assert crash_once(store_url, job_id, tmp_path / f"paused-{n}", signum) == EXIT_RETRYABLE

    tries = store.list_attempts(job_id)
    assert [(a.outcome, a.failure_class) for a in tries] == [
        (AttemptOutcome.ABANDONED, "deterministic")
    ] * STORM
    assert all(a.error and a.error.endswith(f"exited with {-s}") for a, s in zip(tries, crashes, strict=True))
    assert not [c for c in store.list_commits(job_id) if c.shard_index >= 0]  # fruitless tries, all
    seen = counted(store, job_id, later_id)
    assert seen == dict.fromkeys(seen, 0), seen
    view = read_job_view(store, job_id, now=dt.datetime.now(UTC))
    assert (view.spot_tries.tries, view.spot_tries.fruitless) == (STORM, 0)
    assert view.spot_tries.spot_s > 0  # the pool was there: Spot time without a preemption
    history = store.pool_history([SPOT.name], exclude_job=later_id)[SPOT.name]
    assert (history.tries, history.spot_s) == (STORM, pytest.approx(view.spot_tries.spot_s))
    totals = metrics.attempt_totals(view, store.list_attempts(job_id), store.list_commits(job_id))
    assert totals.redone_work_s == pytest.approx(view.spot_tries.spot_s)  # their work is done again
    shard = store.get_shard(job_id, 0)
    assert shard.failures == STORM  # each crash spent the budget (§6.6), as before
    decision = decide_for_try(view, shard)
    assert decision.action is TryAction.RUN and decision.pool == SPOT, decision.reason
    assert "storm" not in decision.reason

    # the launcher's own kill: an injected preemption (SIGKILL, fenced as sent by the launcher)
    proc = kill_paused_worker(store_url, job_id, tmp_path / "paused-kill")
    assert fence_dead_worker(store, proc, signalled=True)
    last = store.list_attempts(job_id)[-1]
    assert (last.outcome, last.failure_class) == (AttemptOutcome.ABANDONED, "preempted")
    seen = counted(store, job_id, later_id)
    assert seen == dict.fromkeys(seen, 1), seen
    after = read_job_view(store, job_id, now=dt.datetime.now(UTC))
    assert (after.spot_tries.tries, after.spot_tries.fruitless) == (STORM + 1, 1)
    assert store.get_shard(job_id, 0).failures == STORM  # a preemption spends no budget


def test_every_reader_counts_preemptions_by_the_one_rule(store: ManifestStore, tmp_path: Path) -> None:
    """Rows of every ended outcome and every class (and none) on the Spot pool, put there by hand:
    the progress report's SQL, the ``pool_stats`` fold, the job view and the UI count what
    :func:`is_preemption` counts, and a crash (``deterministic``, ``configuration``) is never one."""
    job_id, later_id = two_jobs(store, tmp_path)
    classes = [None, *(c.value for c in FailureClass)]
    ended = sorted(TERMINAL_ATTEMPT_OUTCOMES, key=lambda o: o.value)
    now = dt.datetime.now(UTC) - dt.timedelta(minutes=1)
    rows = list(itertools.product(ended, classes))
    engine = sa.create_engine(store.url)
    try:
        with engine.begin() as conn:
            for n, (outcome, cls) in enumerate(rows):
                conn.execute(
                    sa.insert(attempts).values(
                        attempt_id=f"a-{n}",
                        job_id=job_id,
                        shard_index=0,
                        epoch=n + 1,
                        worker=f"w-{n}",
                        pool=SPOT.name,
                        started_at=now - dt.timedelta(seconds=60 + n),
                        ended_at=now - dt.timedelta(seconds=n),
                        outcome=outcome.value,
                        error=None,
                        failure_class=cls,
                    )
                )
    finally:
        engine.dispose()
    expected = sum(is_preemption(o, c) for o, c in rows)
    outcomes_counted = {AttemptOutcome.PREEMPTED, AttemptOutcome.ABANDONED, AttemptOutcome.LOST_LEASE}
    assert expected == len(outcomes_counted) * (len(classes) - 2)  # all but the two crash classes
    seen = counted(store, job_id, later_id)
    assert seen == dict.fromkeys(seen, expected), seen
    assert store.progress(job_id).attempts == len(rows)
