"""The embedded runner behind ``deadline-batch run``: plan, launch local workers, preempt, publish.

Workers are real subprocesses running the same program as the Kubernetes pods. Each launch is
placed by the same policy the shard operator uses (``core.placement.choose_pool``); workers on
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
from typing import Any

from airflow_deadline_batch.core.clock import Clock, SystemClock
from airflow_deadline_batch.core.exit_codes import WorkerExit, worker_exit
from airflow_deadline_batch.core.placement import JobSnapshot, choose_pool
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.core.states import JobState, ShardState
from airflow_deadline_batch.exceptions import VerificationError
from airflow_deadline_batch.local.launcher import (
    WorkerProcess,
    fence_dead_worker,
    start_worker,
)
from airflow_deadline_batch.service.finalize import FinalizeResult, finalize_job, verify_job
from airflow_deadline_batch.service.planning import PlanRequest, PlanResult, plan_job
from airflow_deadline_batch.store import ManifestStore

#: job states in which no shard can be claimed any more, so the runner stops launching workers
_STOPPED_JOB_STATES = frozenset({JobState.CANCELLED, JobState.FAILED, JobState.COMPLETED, JobState.PARTIAL})


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
    on_progress: Callable[[Any], None] | None = None,
    on_plan: Callable[[PlanResult], None] | None = None,
) -> RunSummary:
    """Run one job to a published manifest (or to the deadline) with local subprocess workers."""
    clock = clock or SystemClock()
    started = time.monotonic()
    plan = plan_job(store, request, clock=clock)
    if on_plan:
        on_plan(plan)
    job = store.get_job(plan.job_id)
    deadline = job.deadline
    injector = PreemptionInjector(options.preempt_rate_per_worker_hour, options.seed)
    pending: deque[int] = deque(
        s.shard_index
        for s in store.list_shards(plan.job_id)
        if s.state not in (ShardState.SUCCEEDED, ShardState.TERMINAL_FAILURE)
    )
    running: dict[int, _Running] = {}
    not_before: dict[int, float] = {}  # monotonic time before which a shard is not relaunched
    previous_pool: dict[int, PoolKind] = {}
    placements = {kind.value: 0 for kind in PoolKind}
    preemptions = 0
    deadline_passed = False
    stopped = False
    grace_s = max(1.0, options.preempt_notice_s)
    spot_pools = [p for p in request.pools if p.kind is PoolKind.SPOT]
    changeover_s = max((p.startup_seconds for p in request.pools), default=0.0)
    stderr = _open_log(options.worker_log)
    worker_env = dict(options.worker_env)
    # N workers on one machine: split the cores between them, or CPU engines' spin-waiting
    # OpenMP threads oversubscribe the machine and generation slows down several-fold
    if "OMP_NUM_THREADS" not in os.environ:
        worker_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.workers)))
    try:
        while pending or running:
            now = time.monotonic()
            if clock.now() >= deadline:
                deadline_passed = True
                _stop_all(store, running, grace_s)
                break
            while pending and len(running) < options.workers:
                if not_before.get(pending[0], 0.0) > now:
                    pending.rotate(-1)  # its old lease is still live: try another shard first
                    if all(not_before.get(i, 0.0) > now for i in pending):
                        break
                    continue
                index = pending.popleft()
                progress = store.progress(plan.job_id)
                shard = store.get_shard(plan.job_id, index)
                remaining_share = 1.0 - (
                    shard.cursor / shard.num_microbatches if shard.num_microbatches else 1.0
                )
                snapshot = JobSnapshot(
                    now=clock.now(),
                    deadline=deadline,
                    remaining_work_s=progress.remaining_work_s,
                    shard_work_s=shard.est_work_s * remaining_share,
                    parallelism=options.workers,
                    changeover_s=changeover_s,
                    notice_s=options.preempt_notice_s,
                    spot_preemptions_per_hour=options.preempt_rate_per_worker_hour,
                    spot_available=bool(spot_pools),
                    previous_pool=previous_pool.get(index),
                    on_demand_workers=sum(1 for r in running.values() if r.pool is PoolKind.ON_DEMAND),
                    started_at=job.created_at,
                    total_work_s=progress.committed_work_s + progress.remaining_work_s,
                )
                decision = choose_pool(snapshot)
                previous_pool[index] = decision.pool
                placements[decision.pool.value] += 1
                proc = start_worker(
                    store.url,
                    plan.job_id,
                    index,
                    pool=decision.pool.value,
                    lease_ttl_s=options.lease_ttl_s,
                    grace_s=grace_s,
                    env=worker_env,
                    stderr=stderr,
                )
                running[index] = _Running(proc, decision.pool, injector.next_preemption(now, decision.pool))
            for item in running.values():
                if item.term_sent_at is None and now >= item.preempt_at:
                    item.proc.signal(signal.SIGTERM)
                    item.term_sent_at = now
                    preemptions += 1
                elif item.term_sent_at is not None and now - item.term_sent_at >= options.preempt_notice_s:
                    item.proc.signal(signal.SIGKILL)
            for index in list(running):
                item = running[index]
                code = item.proc.popen.poll()
                if code is None:
                    continue
                del running[index]
                if code < 0:
                    fence_dead_worker(store, item.proc)
                if worker_exit(code) is WorkerExit.SUCCEEDED:
                    continue
                if store.get_job(plan.job_id).state in _STOPPED_JOB_STATES:
                    # cancelled (or finished elsewhere): no retry could claim a shard; stop relaunching
                    stopped = True
                    break
                shard = store.get_shard(plan.job_id, index)
                if shard.state in (ShardState.SUCCEEDED, ShardState.TERMINAL_FAILURE):
                    continue
                if shard.state is ShardState.LEASED and shard.lease_expires_at:
                    # another attempt (say, a worker of a killed earlier run) still holds a live
                    # lease: relaunching before it expires would only be refused again
                    not_before[index] = now + max(0.0, shard.lease_expires_at - store.db_time())
                pending.append(index)
            if stopped:
                _stop_all(store, running, grace_s)
                break
            if on_progress:
                on_progress(store.progress(plan.job_id))
            time.sleep(options.poll_interval_s)
    except BaseException:
        _stop_all(store, running, grace_s)
        raise
    finally:
        if stderr is not None:
            stderr.close()
    result = _finalize(store, plan.job_id, clock, deadline_passed)
    if on_progress:
        on_progress(store.progress(plan.job_id))
    progress = store.progress(plan.job_id)
    job = store.get_job(plan.job_id)
    records = dict(result.report.outcomes)
    records["total"] = result.report.expected
    return RunSummary(
        job_id=plan.job_id,
        state=str(JobState(job.state).value),
        manifest=result.manifest_uri,
        records=records,
        attempts=progress.attempts,
        preemptions=preemptions,
        deadline_met=result.manifest_uri is not None
        and job.completed_at is not None
        and job.completed_at <= deadline
        and job.state == JobState.COMPLETED,
        shards=plan.shards,
        elapsed_s=time.monotonic() - started,
        placements=placements,
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


def _open_log(path: str | None) -> Any:
    import os

    return open(path or os.devnull, "ab")  # noqa: SIM115 - closed by run_job
