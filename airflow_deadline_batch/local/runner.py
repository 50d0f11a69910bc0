"""The embedded runner behind ``deadline-batch run``: plan, launch local workers, preempt, publish.

Workers are real subprocesses running the same program as the Kubernetes pods. Each launch is
placed by the shard operator's own decision (``operators.placement.decide_for_try`` over the
job's ``core.job_view.JobView``), so the same store state places a shard the same way; workers on
the Spot-like pool are preempted at a seeded Poisson rate the way a cloud does it — SIGTERM as the
notice, SIGKILL when the notice runs out — and retried until the deadline.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from airflow_deadline_batch.core.clock import Clock, SystemClock
from airflow_deadline_batch.core.exit_codes import WorkerExit, worker_exit
from airflow_deadline_batch.core.job_view import is_stopped
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.core.states import TERMINAL_SHARD_STATES, JobState, ShardState
from airflow_deadline_batch.exceptions import VerificationError
from airflow_deadline_batch.local.launcher import (
    WorkerProcess,
    fence_dead_worker,
    start_worker,
)
from airflow_deadline_batch.operators.placement import TryAction, TryDecision, decide_for_try, read_job_view
from airflow_deadline_batch.service.finalize import FinalizeResult, finalize_job, verify_job
from airflow_deadline_batch.service.planning import PlanRequest, PlanResult, plan_job
from airflow_deadline_batch.store import ManifestStore, Progress


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How the local run behaves; the defaults suit a laptop."""

    workers: int = 4
    preempt_rate_per_worker_hour: float = 0.0
    preempt_notice_s: float = 5.0
    seed: int = 0
    lease_ttl_s: float = 30.0
    poll_interval_s: float = 0.1
    worker_env: Mapping[str, str] = field(default_factory=dict)
    #: where worker stderr goes (appended); None discards it
    worker_log: str | None = None


@dataclass
class _Running:
    proc: WorkerProcess
    pool: PoolKind
    preempt_at: float
    term_sent_at: float | None = None


@dataclass(frozen=True)
class RunSummary:
    """The ``--json`` summary of docs/design.md §8 (and a little more)."""

    job_id: str
    state: str
    manifest: str | None
    records: dict[str, int]
    attempts: int
    preemptions: int
    deadline_met: bool
    shards: int
    elapsed_s: float
    placements: dict[str, int]
    problems: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "manifest": self.manifest,
            "records": self.records,
            "attempts": self.attempts,
            "preemptions": self.preemptions,
            "deadline_met": self.deadline_met,
            "shards": self.shards,
            "elapsed_s": round(self.elapsed_s, 3),
            "placements": self.placements,
            "problems": self.problems,
        }


class PreemptionInjector:
    """Seeded Poisson preemptions per Spot worker: exponential times between interruptions."""

    def __init__(self, rate_per_hour: float, seed: int) -> None:
        self.rate_per_s = rate_per_hour / 3600.0
        self.rng = random.Random(seed)

    def next_preemption(self, now: float, pool: PoolKind) -> float:
        if pool is not PoolKind.SPOT or self.rate_per_s <= 0:
            return math.inf
        return now + self.rng.expovariate(self.rate_per_s)


def run_job(
    store: ManifestStore,
    request: PlanRequest,
    options: RunOptions,
    *,
    clock: Clock | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_plan: Callable[[PlanResult], None] | None = None,
) -> RunSummary:
    """Run one job to a published manifest (or to the deadline) with local subprocess workers."""
    clock = clock or SystemClock()
    started = time.monotonic()
    plan = plan_job(store, request, clock=clock)
    if on_plan:
        on_plan(plan)
    run = LocalRun(store, plan.job_id, options, clock)
    run.work_until_done(on_progress)
    result = _finalize(store, plan.job_id, clock, run.deadline_passed)
    if on_progress:
        on_progress(store.progress(plan.job_id))
    return _summary(store, plan, result, run, time.monotonic() - started)


class LocalRun:
    """The launch loop of one job: keep ``workers`` shards running until none is left to run."""

    def __init__(self, store: ManifestStore, job_id: str, options: RunOptions, clock: Clock) -> None:
        self.store, self.job_id, self.options, self.clock = store, job_id, options, clock
        self.deadline = store.get_job(job_id).deadline
        self.injector = PreemptionInjector(options.preempt_rate_per_worker_hour, options.seed)
        self.pending: deque[int] = deque(
            s.shard_index for s in store.list_shards(job_id) if s.state not in TERMINAL_SHARD_STATES
        )
        self.running: dict[int, _Running] = {}
        self.not_before: dict[int, float] = {}  # monotonic time before which a shard is not relaunched
        self.placements = {kind.value: 0 for kind in PoolKind}
        self.preemptions = 0
        self.deadline_passed = False
        self.stopped = False
        self.grace_s = max(1.0, options.preempt_notice_s)
        self.worker_env = _worker_env(options)

    def work_until_done(self, on_progress: Callable[[Progress], None] | None) -> None:
        """Launch, preempt and reap until every shard is terminal, the job stops or the deadline passes."""
        stderr = _open_log(self.options.worker_log)
        try:
            while (self.pending or self.running) and not self.stopped:
                now = time.monotonic()
                if self.clock.now() >= self.deadline:
                    self.deadline_passed = True
                    break
                self.launch_ready(now, stderr)
                self.inject_preemptions(now)
                self.reap_exited(now)
                if on_progress and not self.stopped:
                    on_progress(self.store.progress(self.job_id))
                if not self.stopped:
                    time.sleep(self.options.poll_interval_s)
        finally:
            _stop_all(self.store, self.running, self.grace_s)
            stderr.close()

    def launch_ready(self, now: float, stderr: IO[bytes]) -> None:
        """Fill the free worker slots with shards whose old lease (if any) has expired."""
        while self.pending and len(self.running) < self.options.workers and not self.stopped:
            index = self._next_ready(now)
            if index is None:
                return
            self.launch(index, now, stderr)

    def _next_ready(self, now: float) -> int | None:
        if all(self.not_before.get(i, 0.0) > now for i in self.pending):
            return None
        while self.not_before.get(self.pending[0], 0.0) > now:
            self.pending.rotate(-1)  # its old lease is still live: try another shard first
        return self.pending.popleft()

    def decide(self, index: int) -> TryDecision:
        """The shard operator's decision for this shard, from the same store state."""
        view = read_job_view(self.store, self.job_id, now=self.clock.now(), parallelism=self.options.workers)
        return decide_for_try(view, self.store.get_shard(self.job_id, index))

    def launch(self, index: int, now: float, stderr: IO[bytes]) -> None:
        """Place one shard and start its worker (or drop it: committed, failed for good, job stopped)."""
        decision = self.decide(index)
        if decision.action is TryAction.JOB_STOPPED:
            self.stopped = True
            return
        if decision.pool is None:
            return  # already committed, or failed for good: nothing to launch
        pool = decision.pool
        self.placements[pool.kind.value] += 1
        proc = start_worker(
            self.store.url,
            self.job_id,
            index,
            pool=pool.name,
            lease_ttl_s=self.options.lease_ttl_s,
            grace_s=self.grace_s,
            env=self.worker_env,
            stderr=stderr,
        )
        self.running[index] = _Running(proc, pool.kind, self.injector.next_preemption(now, pool.kind))

    def inject_preemptions(self, now: float) -> None:
        """SIGTERM a Spot worker whose preemption time came; SIGKILL it once the notice ran out."""
        for item in self.running.values():
            if item.term_sent_at is None and now >= item.preempt_at:
                item.proc.signal(signal.SIGTERM)
                item.term_sent_at = now
                self.preemptions += 1
            elif item.term_sent_at is not None and now - item.term_sent_at >= self.options.preempt_notice_s:
                item.proc.signal(signal.SIGKILL)

    def reap_exited(self, now: float) -> None:
        """Collect exited workers: fence the killed ones, queue their shards again unless done."""
        for index in list(self.running):
            item = self.running[index]
            code = item.proc.popen.poll()
            if code is None:
                continue
            del self.running[index]
            if code < 0:
                fence_dead_worker(self.store, item.proc)
            if worker_exit(code) is WorkerExit.SUCCEEDED:
                continue
            if is_stopped(self.store.get_job(self.job_id).state):
                # cancelled (or finished elsewhere): no retry could claim a shard; stop relaunching
                self.stopped = True
                return
            self.requeue(index, now)

    def requeue(self, index: int, now: float) -> None:
        shard = self.store.get_shard(self.job_id, index)
        if shard.state in TERMINAL_SHARD_STATES:
            return
        if shard.state is ShardState.LEASED and shard.lease_expires_at:
            # another attempt (say, a worker of a killed earlier run) still holds a live
            # lease: relaunching before it expires would only be refused again
            self.not_before[index] = now + max(0.0, shard.lease_expires_at - self.store.db_time())
        self.pending.append(index)


def _worker_env(options: RunOptions) -> dict[str, str]:
    env = dict(options.worker_env)
    # N workers on one machine: split the cores between them, or CPU engines' spin-waiting
    # OpenMP threads oversubscribe the machine and generation slows down several-fold
    if "OMP_NUM_THREADS" not in os.environ:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.workers)))
    return env


def _summary(
    store: ManifestStore, plan: PlanResult, result: FinalizeResult, run: LocalRun, elapsed_s: float
) -> RunSummary:
    progress = store.progress(plan.job_id)
    job = store.get_job(plan.job_id)
    records = dict(result.report.outcomes)
    records["total"] = result.report.expected
    return RunSummary(
        job_id=plan.job_id,
        state=job.state.value,
        manifest=result.manifest_uri,
        records=records,
        attempts=progress.attempts,
        preemptions=run.preemptions,
        deadline_met=result.manifest_uri is not None
        and job.completed_at is not None
        and job.completed_at <= job.deadline
        and job.state is JobState.COMPLETED,
        shards=plan.shards,
        elapsed_s=elapsed_s,
        placements=run.placements,
        problems=list(result.report.problems),
    )


def _finalize(store: ManifestStore, job_id: str, clock: Clock, deadline_passed: bool) -> FinalizeResult:
    try:
        return finalize_job(store, job_id, clock=clock, expire_unfinished=deadline_passed)
    except VerificationError:
        return FinalizeResult(job_id, JobState(store.get_job(job_id).state), None, verify_job(store, job_id))


def _stop_all(store: ManifestStore, running: dict[int, _Running], grace_s: float) -> None:
    """Stop every worker as a node drain would: SIGTERM, then SIGKILL after the grace period."""
    for item in running.values():
        item.proc.signal(signal.SIGTERM)
    stop_by = time.monotonic() + grace_s
    for item in running.values():
        try:
            item.proc.popen.wait(timeout=max(0.0, stop_by - time.monotonic()))
        except Exception:
            item.proc.signal(signal.SIGKILL)
            item.proc.popen.wait()
        if item.proc.popen.returncode is not None and item.proc.popen.returncode < 0:
            fence_dead_worker(store, item.proc)
    running.clear()


def _open_log(path: str | None) -> IO[bytes]:
    return open(path or os.devnull, "ab")  # noqa: SIM115 - closed by LocalRun.work_until_done
