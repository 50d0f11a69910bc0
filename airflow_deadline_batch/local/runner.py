"""The embedded runner behind ``deadline-batch run``: plan, launch local workers, preempt, publish.

Workers are real subprocesses running the same program as the Kubernetes pods. Each launch is
placed by the shard operator's own decision (``operators.placement.decide_for_try`` over the
job's ``core.job_view.JobView``), so the same store state places a shard the same way; workers on
the Spot-like pool are preempted at a seeded Poisson rate per hour of work on their claimed shard
(``PreemptionInjector``) the way a cloud does it — SIGTERM as the notice, SIGKILL when the notice
runs out — and retried until the deadline.

Failed tries follow docs/design.md §6.6, classified once (``core.failures``): the worker says how
its try failed in a termination message (a kill the runner did not send is a crash); preempted
shards are relaunched at once, transient failures after a jittered exponential backoff bounded
by the job's slack, deterministic ones after a short backoff while the store counts the budget.
A configuration failure stops the run with its cause (``ConfigurationError``), and so do
``unclaimed_limit`` launches in a row that die before claiming for a reason that is not a
transient outage. The runner's own store calls ride out a store outage for up to
``outage_window_s`` (never past the deadline); a shard whose claim was refused because another
attempt holds it is watched, and dropped as soon as that attempt finishes it.

On a pool with a ``capacity`` row the GPUs are shared with every other run on the store: a shard
asks the store's dispatcher for a slot and starts when granted, least slack first within the
tenants' weighted fair shares (``core.dispatch``, docs/tenants.md "Dispatch"); its slot goes
back when its worker ends, and all of the run's requests are withdrawn when the run stops.

The tenant's GPU quota (docs/tenants.md "Quotas and budgets") is taken launch by launch: every
worker, racers included, first reserves its GPU in the store (the check and the reservation in
one serialized transaction, counted across all the tenant's jobs and runs until the worker's
claim shows), renewed while it runs and given back when it ends.

The tail race (issue 13, docs/simulator.md "The tail race"): once no shard waits for a worker and
a worker slot is free, a running Spot try that the safety rule would now escalate races a
duplicate on the on-demand pool (``worker --race``: a racing lease beside its own) when
``core.placement.should_speculate`` says the expected gain beats the duplicate's cost
(``operators.placement.race_pool``, the shard pod operator's rule too); one racer per shard at
most. Whichever commits a microbatch first wins it; the loser's worker exits 0 (``lost_race``) and
is neither retried nor counted as a failure.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import random
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import IO, Any

from airflow_deadline_batch.core.clock import Clock, SystemClock
from airflow_deadline_batch.core.exit_codes import WorkerExit, worker_exit
from airflow_deadline_batch.core.failures import (
    FailureClass,
    TryFailure,
    backoff_s,
    classify_exception,
    classify_exit,
)
from airflow_deadline_batch.core.job_view import JobView, is_stopped
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import TERMINAL_SHARD_STATES, JobState, ShardState
from airflow_deadline_batch.exceptions import ConfigurationError, StoreError, VerificationError
from airflow_deadline_batch.local.launcher import (
    WorkerProcess,
    fence_dead_worker,
    launched_attempt,
    start_worker,
)
from airflow_deadline_batch.operators.placement import (
    TryAction,
    TryDecision,
    decide_for_try,
    race_pool,
    read_job_view,
)
from airflow_deadline_batch.service.finalize import FinalizeResult, finalize_job, verify_job
from airflow_deadline_batch.service.planning import PlanRequest, PlanResult, plan_job
from airflow_deadline_batch.service.quotas import quota_allows_launch
from airflow_deadline_batch.store import DispatchRow, ManifestStore, Progress

log = logging.getLogger("airflow_deadline_batch.local")
#: environment variable the worker writes its termination message to (worker.worker)
ENV_TERMINATION_LOG = "ADB_TERMINATION_LOG"
#: how soon a launch held back by the tenant's GPU quota is tried again
QUOTA_RECHECK_S = 0.5
#: how long the run trusts its last read of which pools are managed (have a ``capacity`` row)
MANAGED_POOLS_TTL_S = 1.0
#: how often a shard waiting for a slot is placed again (its slack falls while it waits)
REDECIDE_WAITING_S = 1.0
#: how often a shard another run of the job asked a slot for is looked at again
HELD_BY_OTHER_RUN_RECHECK_S = 1.0
#: how often the job's tail is looked at for a race (core.placement.should_speculate)
RACE_CHECK_S = 1.0


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
    #: launches in a row that die before claiming (not in an outage) before the run stops
    unclaimed_limit: int = 5
    #: how long the run rides out an unreachable store or object store before it gives up
    #: (never past the deadline); the job stays resumable
    outage_window_s: float = 300.0
    #: cap of the backoff after a transient failure (docs/design.md §6.6)
    backoff_cap_s: float = 30.0


@dataclass
class _Running:
    proc: WorkerProcess
    pool: PoolKind
    #: seconds the worker works on its claimed shard before the injector preempts it (inf: never)
    exposure_s: float
    #: where this try's worker writes its termination message
    message_path: str = ""
    term_sent_at: float | None = None
    #: the runner signalled this worker itself (an injected preemption or a drain)
    signalled: bool = False
    #: the worker holds a dispatcher slot of a managed pool, given back when it ends
    dispatched: bool = False
    #: its GPU of the tenant's quota (``ManifestStore.reserve_launch``), given back when it ends
    reservation: str | None = None
    #: the shard's epoch when the worker was launched: a higher one means it claimed the shard
    launch_epoch: int = 0
    #: when the injector preempts it: ``exposure_s`` after its claim was seen (inf until then)
    preempt_at: float = math.inf


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
    """Seeded Poisson preemptions per Spot worker-hour of claimed work: exponential exposures.

    A Spot node's preemption does not care whether its worker has claimed anything yet; this
    injector does, on purpose. It exists to hit tries in the middle of their work (between a
    write and its commit, mid-microbatch), so a worker's exposure starts when it has claimed its
    shard, not when it was launched. Counted from the launch, a worker slow to start (its imports
    on a loaded machine) would be preempted before its claim again and again, and the run's
    progress would hang on the machine's speed: on a slow enough one it would never come.
    """

    def __init__(self, rate_per_hour: float, seed: int) -> None:
        self.rate_per_s = rate_per_hour / 3600.0
        self.rng = random.Random(seed)

    def exposure_s(self, pool: PoolKind) -> float:
        """The next launch's seconds of claimed work before its preemption (inf: not preempted).

        Drawn at the launch, in launch order, so a seed replays the same draws whatever the
        machine's speed."""
        if pool is not PoolKind.SPOT or self.rate_per_s <= 0:
            return math.inf
        return self.rng.expovariate(self.rate_per_s)


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
    run.raise_if_stopped_by_failure()
    result = _finalize(store, plan.job_id, clock, run.deadline_passed)
    if on_progress:
        on_progress(store.progress(plan.job_id))
    return _summary(store, plan, result, run, time.monotonic() - started)


class LocalRun:
    """The launch loop of one job: keep ``workers`` shards running until none is left to run."""

    def __init__(self, store: ManifestStore, job_id: str, options: RunOptions, clock: Clock) -> None:
        self.job_id, self.options, self.clock = job_id, options, clock
        job = store.get_job(job_id)
        self.deadline, self.tenant = job.deadline, job.tenant
        self.store: ManifestStore = _DurableStore(store, self)  # type: ignore[assignment]
        self.raw_store = store
        self.injector = PreemptionInjector(options.preempt_rate_per_worker_hour, options.seed)
        self.pending: deque[int] = deque(
            s.shard_index for s in store.list_shards(job_id) if s.state not in TERMINAL_SHARD_STATES
        )
        self.running: dict[int, _Running] = {}
        #: the tail race: the racer (worker --race) of a running shard, by shard index
        self.racing: dict[int, _Running] = {}
        self.next_race_check = 0.0
        self.not_before: dict[int, float] = {}  # monotonic time before which a shard is not relaunched
        self.placements = {kind.value: 0 for kind in PoolKind}
        self.preemptions = 0
        self.deadline_passed = False
        self.stopped = False
        self.grace_s = max(1.0, options.preempt_notice_s)
        self.worker_env = _worker_env(options)
        self._messages_dir: str | None = None  # made by the first launch (messages_dir)
        self.launches = 0
        #: failures in a row per shard (transient, deterministic), for the backoff
        self.failures_in_a_row: dict[int, int] = {}
        #: launches in a row that died before claiming, and the last one's failure
        self.unclaimed_in_a_row = 0
        self.last_unclaimed: TryFailure | None = None
        self.outage_since: float | None = None
        #: shards refused because another live attempt holds them: watched until it ends
        self.held_elsewhere: set[int] = set()
        self.next_watch = 0.0
        #: why the run stopped early: a configuration error (exit 2), an outage past the window
        self.stop_error: Exception | None = None
        #: managed pools (docs/tenants.md "Dispatch"): shards waiting for a slot of a pool, shards
        #: granted one, and when this run last read which pools are managed
        self.waiting: dict[int, str] = {}
        self.granted: dict[int, str] = {}
        self.managed: frozenset[str] = frozenset()
        self.managed_read_at = -math.inf
        self.next_renew = 0.0
        self.next_launch_renew = 0.0
        self.next_redecide = 0.0
        self.dispatch_used = False
        #: names this run's dispatch rows and launch reservations: a second run of the same job
        #: neither launches on nor gives back this run's slots, and counts its workers in the quota
        self.run_id = uuid.uuid4().hex

    def work_until_done(self, on_progress: Callable[[Progress], None] | None) -> None:
        """Launch, preempt and reap until every shard is terminal, the job stops or the deadline passes."""
        stderr = _open_log(self.options.worker_log)
        try:
            while (self.pending or self.running or self.racing or self.waiting) and not self.stopped:
                now = time.monotonic()
                if self.clock.now() >= self.deadline:
                    self.deadline_passed = True
                    break
                self.poll_dispatch(now)
                self.renew_launches(now)
                self.redecide_waiting(now)
                self.launch_ready(now, stderr)
                self.race_tail(now, stderr)
                self.inject_preemptions(now)
                self.reap_exited(now)
                if on_progress and not self.stopped:
                    on_progress(self.store.progress(self.job_id))
                if not self.stopped:
                    time.sleep(self.options.poll_interval_s)
        finally:
            _stop_all(self.raw_store, self.running, self.grace_s)
            _stop_all(self.raw_store, self.racing, self.grace_s)
            self.withdraw_dispatch()
            self.withdraw_launches()
            stderr.close()
            if self._messages_dir is not None:
                shutil.rmtree(self._messages_dir, ignore_errors=True)
                self._messages_dir = None

    @property
    def messages_dir(self) -> str:
        """The folder of the workers' termination messages, made at the first launch and removed
        when :meth:`work_until_done` ends: a run built and never run (a test driving its steps, a
        failure before the loop) leaves no empty folder in ``TMPDIR``."""
        if self._messages_dir is None:
            self._messages_dir = tempfile.mkdtemp(prefix="adb-tries-")
        return self._messages_dir

    def raise_if_stopped_by_failure(self) -> None:
        """After the loop: raise why the run stopped early (configuration, an outage past its window)."""
        if self.stop_error is not None:
            raise self.stop_error
        job = self.store.get_job(self.job_id)
        if job.state is JobState.FAILED:
            raise ConfigurationError(job.error or f"job {self.job_id} failed", job_id=self.job_id)

    def launch_ready(self, now: float, stderr: IO[bytes]) -> None:
        """Fill the free worker slots with shards whose old lease (if any) has expired."""
        self.launch_granted(now, stderr)
        while self.pending and self.busy_slots() < self.options.workers and not self.stopped:
            index = self._next_ready(now)
            if index is None:
                return
            self.launch(index, now, stderr)

    def _next_ready(self, now: float) -> int | None:
        self.watch_held_elsewhere(now)
        if not self.pending or all(self.not_before.get(i, 0.0) > now for i in self.pending):
            return None
        while self.not_before.get(self.pending[0], 0.0) > now:
            self.pending.rotate(-1)  # its old lease is still live: try another shard first
        return self.pending.popleft()

    def decide(self, index: int, view: JobView | None = None) -> TryDecision:
        """The shard operator's decision for this shard, from the same store state."""
        if view is None:
            view = self.read_view()
        return decide_for_try(view, self.store.get_shard(self.job_id, index))

    def read_view(self) -> JobView:
        """The job as the runner decides on it: a dead worker's shard is placed again at the next
        poll, so that is the turnaround between its tries (``JobSnapshot.turnaround_s``)."""
        view = read_job_view(self.store, self.job_id, now=self.clock.now(), parallelism=self.options.workers)
        return replace(view, turnaround_s=self.options.poll_interval_s)

    def launch(self, index: int, now: float, stderr: IO[bytes]) -> None:
        """Place one shard and start its worker (or drop it: committed, failed for good, job stopped)."""
        decision = self.decide(index)
        if decision.action is TryAction.JOB_STOPPED:
            self.stopped = True
            return
        if decision.pool is None:
            self.release_slot(index, how="withdrawn")
            return  # already committed, or failed for good: nothing to launch
        pool = decision.pool
        if self.granted.get(index, pool.name) != pool.name:
            # the decision moved (say, slack fell and it escalates to on-demand): ask on the new pool
            self.release_slot(index, how="withdrawn")
        dispatched = index in self.granted
        if not dispatched and pool.name in self.managed_pools(now):
            if quota_allows_launch(self.store, self.tenant, pool.kind):
                self.request_slot(index, pool.name)
            else:
                self.wait_for_quota(index, now)
            return
        if not self._launch_reserved(index, pool, stderr, self.running, now, dispatched=dispatched):
            self.release_slot(index, how="withdrawn")
            self.wait_for_quota(index, now)

    def wait_for_quota(self, index: int, now: float) -> None:
        """The tenant holds its GPU quota of the shard's pool kind (docs/tenants.md): try again soon."""
        self.not_before[index] = now + QUOTA_RECHECK_S
        self.pending.append(index)

    def _launch_reserved(
        self,
        index: int,
        pool: PoolSpec,
        stderr: IO[bytes],
        into: dict[int, _Running],
        now: float,
        *,
        race: bool = False,
        dispatched: bool = False,
    ) -> bool:
        """Take a GPU of the tenant's quota, then start the worker on it (False: the quota is full).

        The reservation is checked and written in one transaction, so no other run (of this job
        or another of the tenant's) can take the same GPU before this worker's claim shows; it
        stops counting once the worker's lease does, and goes back when the worker ends.
        """
        reservation = self.store.reserve_launch(
            self.job_id,
            index,
            tenant=self.tenant,
            kind=pool.kind,
            pool=pool.name,
            runner=self.run_id,
            ttl_s=self.options.lease_ttl_s,
        )
        if reservation is None:
            return False
        exposure_s = math.inf if race else self.injector.exposure_s(pool.kind)
        # read before the start: the worker's claim bumps the epoch past it
        epoch = self.store.get_shard(self.job_id, index).epoch if exposure_s < math.inf else 0
        try:
            proc, message_path = self._start_worker(index, pool, stderr, race=race)
        except BaseException:
            with contextlib.suppress(Exception):  # it expires after the TTL otherwise
                self.raw_store.release_launches(self.run_id, reservation)
            raise
        into[index] = _Running(
            proc,
            pool.kind,
            exposure_s,
            message_path,
            dispatched=dispatched,
            reservation=reservation,
            launch_epoch=epoch,
        )
        # the name the worker gives its attempts (worker.default_worker_name): its claim is the
        # attempt of that name, and from then on its lease counts instead of the reservation
        self.store.launch_started(reservation, f"{socket.gethostname()}:{proc.pid}")
        return True

    def _start_worker(
        self, index: int, pool: PoolSpec, stderr: IO[bytes], *, race: bool = False
    ) -> tuple[WorkerProcess, str]:
        """Start one try's worker process on ``pool`` (a racer with ``race``); count the launch."""
        self.placements[pool.kind.value] += 1
        self.launches += 1
        message_path = os.path.join(self.messages_dir, f"try-{self.launches}.json")
        proc = start_worker(
            self.raw_store.url,
            self.job_id,
            index,
            pool=pool.name,
            lease_ttl_s=self.options.lease_ttl_s,
            grace_s=self.grace_s,
            env={**self.worker_env, ENV_TERMINATION_LOG: message_path},
            stderr=stderr,
            race=race,
        )
        return proc, message_path

    # -- managed pools: the store's dispatcher (core.dispatch, store/dispatch.py) -------------------

    def launch_granted(self, now: float, stderr: IO[bytes]) -> None:
        """Start the shards granted a slot first: the local cap counted them when they asked.

        The grants are read back (and renewed) first: a run that stalled past the TTL (SIGSTOP, a
        long pause) lost its rows and the slot may be another run's now, so a shard whose grant is
        gone is not launched on it; it goes back to ``launch``, which asks for a slot again.
        """
        idle = [i for i in self.granted if i not in self.running]
        if not idle:
            return
        rows = self.store.poll_dispatch(self.job_id, self.options.lease_ttl_s, runner=self.run_id)
        self.next_renew = now + self.options.lease_ttl_s / 3
        for index in idle:
            row = rows.get(index)
            if not self._holds(row, self.granted[index], granted=True):
                del self.granted[index]  # still pending: placed and asked anew below
        for index in [i for i in self.granted if i not in self.running]:
            if self.stopped:
                return
            if index in self.pending and self.not_before.get(index, 0.0) <= now:
                self.pending.remove(index)
                self.launch(index, now, stderr)

    def busy_slots(self) -> int:
        """The run's local cap counts running workers, shards waiting for a slot and granted ones."""
        granted_idle = sum(1 for i in self.granted if i not in self.running)
        return len(self.running) + len(self.racing) + len(self.waiting) + granted_idle

    def managed_pools(self, now: float) -> frozenset[str]:
        """Pools with a ``capacity`` row (re-read at most every ``MANAGED_POOLS_TTL_S``)."""
        if now - self.managed_read_at >= MANAGED_POOLS_TTL_S:
            self.managed = frozenset(row.pool for row in self.store.list_capacity())
            self.managed_read_at = now
        return self.managed

    def request_slot(self, index: int, pool: str) -> None:
        """Ask the dispatcher for a slot of ``pool``: least slack first, by the job's latest start."""
        slack = self.slack_s()
        latest_start = self.deadline.timestamp() if slack is None else self.clock.now().timestamp() + slack
        self.dispatch_used = True
        row = self.store.request_dispatch(
            self.job_id,
            index,
            tenant=self.tenant,
            pool=pool,
            latest_start=latest_start,
            ttl_s=self.options.lease_ttl_s,
            runner=self.run_id,
        )
        if row is not None and row.runner != self.run_id:
            # another run of this job asked for (or holds) this shard's slot: leave it to that run,
            # look again later (it ends with the shard committed, or its rows gone)
            self.not_before[index] = time.monotonic() + HELD_BY_OTHER_RUN_RECHECK_S
            self.pending.append(index)
        elif row is not None and row.granted:
            self.granted[index] = pool
            self.pending.appendleft(index)
        else:
            self.waiting[index] = pool

    def _holds(self, row: DispatchRow | None, pool: str, *, granted: bool) -> bool:
        """Whether ``row`` is this run's request (or, ``granted``, its slot) on ``pool``."""
        return row is not None and row.runner == self.run_id and row.pool == pool and row.granted == granted

    def poll_dispatch(self, now: float) -> None:
        """Renew the run's rows; a shard granted a slot goes to the front of the queue.

        Polls every loop while shards wait, else every third of the TTL to keep held slots alive.
        """
        if not self.waiting and (not self.granted or now < self.next_renew):
            return
        self.next_renew = now + self.options.lease_ttl_s / 3
        rows = self.store.poll_dispatch(self.job_id, self.options.lease_ttl_s, runner=self.run_id)
        managed = self.managed_pools(now)
        for index, pool in list(self.waiting.items()):
            row = rows.get(index)
            if self._holds(row, pool, granted=False) and pool in managed:
                continue
            del self.waiting[index]
            if self._holds(row, pool, granted=True):
                self.granted[index] = pool
            elif self._holds(row, pool, granted=False):
                # its pool is no longer managed (`capacity delete`): withdraw the request, else it
                # stays renewed and is granted a slot nobody launches on if the pool is managed again
                self.store.release_dispatch(self.job_id, index, how="withdrawn", runner=self.run_id)
            # granted; or expired (the run stalled past the TTL), or the pool no longer managed:
            # launch() places it again and asks again where needed
            self.pending.appendleft(index)

    def redecide_waiting(self, now: float) -> None:
        """Place waiting shards again: one whose placement moved (say, slack fell and it escalates
        to on-demand) gives up its request and is placed, and asks, anew by ``launch``."""
        if not self.waiting or now < self.next_redecide:
            return
        self.next_redecide = now + REDECIDE_WAITING_S
        view = self.read_view()  # once for all of them: the job's rows are the same
        for index, pool in list(self.waiting.items()):
            decision = self.decide(index, view)
            if decision.pool is None or decision.pool.name != pool:
                self.release_slot(index, how="withdrawn")
                self.pending.appendleft(index)

    def release_slot(self, index: int, *, how: str = "released") -> None:
        """Give a shard's slot (or request) back to the dispatcher."""
        if self.granted.pop(index, None) is not None or self.waiting.pop(index, None) is not None:
            self.store.release_dispatch(self.job_id, index, how=how, runner=self.run_id)

    def withdraw_dispatch(self) -> None:
        """The run ends: every request and slot it still has goes back (else they expire)."""
        self.waiting.clear()
        self.granted.clear()
        if self.dispatch_used:
            with contextlib.suppress(Exception):  # they expire after the TTL otherwise
                self.raw_store.release_dispatch(self.job_id, how="withdrawn", runner=self.run_id)

    # -- the tenant's GPU quota: launch reservations (service/quotas.py, store/tenancy.py) --------

    def renew_launches(self, now: float) -> None:
        """Keep the run's launch reservations alive (every third of the TTL) while it has any."""
        if now < self.next_launch_renew:
            return
        if not any(r.reservation for r in [*self.running.values(), *self.racing.values()]):
            return
        self.next_launch_renew = now + self.options.lease_ttl_s / 3
        self.store.renew_launches(self.run_id, self.options.lease_ttl_s)

    def release_launch(self, item: _Running) -> None:
        """A worker ended: its GPU goes back to the tenant's quota (a claimed one already counts no more)."""
        if item.reservation is not None:
            self.store.release_launches(self.run_id, item.reservation)
            item.reservation = None

    def withdraw_launches(self) -> None:
        """The run ends, its workers stopped: every reservation it still has goes back."""
        if self.launches:
            with contextlib.suppress(Exception):  # they expire after the TTL otherwise
                self.raw_store.release_launches(self.run_id)

    # -- the tail race ------------------------------------------------------------------------------

    def race_tail(self, now: float, stderr: IO[bytes]) -> None:
        """Race a running Spot try on on-demand where :func:`race_pool` says so, on a free slot.

        Never while a shard waits for a worker (queued, or for a dispatcher slot): a duplicate
        only uses a worker that has nothing else to pull. Managed pools are not raced (a racer
        would need a dispatcher slot of its own).
        """
        if self.pending or self.waiting or self.granted or self.stopped or now < self.next_race_check:
            return
        self.next_race_check = now + RACE_CHECK_S
        candidates = [
            i for i, item in self.running.items() if i not in self.racing and item.pool is PoolKind.SPOT
        ]
        if not candidates or self.busy_slots() >= self.options.workers:
            return
        view = self.read_view()
        for index in candidates:
            if self.busy_slots() >= self.options.workers or self.stopped:
                return
            pool = race_pool(view, self.store.get_shard(self.job_id, index), self.running[index].proc.pool)
            if pool is None or pool.name in self.managed_pools(now):
                continue
            if not self._launch_reserved(index, pool, stderr, self.racing, now, race=True):
                continue  # the tenant holds its GPU quota of on-demand
            log.info(
                "shard %05d: racing its Spot try on %s (core.placement.should_speculate)", index, pool.name
            )

    def reap_racers(self) -> None:
        """Collect exited racers: a racer that won, lost or found nothing to race exits 0; a racer
        that died is fenced (its racing lease goes, the primary runs on); none is retried."""
        for index in list(self.racing):
            item = self.racing[index]
            code = item.proc.popen.poll()
            if code is None:
                continue
            del self.racing[index]
            self.release_launch(item)
            _read_message(item.message_path)  # the try's own word: nothing to act on for a racer
            if code < 0:
                self._fence_dead(item.proc, FailureClass.PREEMPTED, f"racer pid {item.proc.pid} died")
            elif code != 0:
                log.warning("shard %05d: its racer exited %d; the running try goes on", index, code)

    def inject_preemptions(self, now: float) -> None:
        """SIGTERM a Spot worker whose preemption time came; SIGKILL it once the notice ran out.

        A worker's preemption time is set once its claim is seen (``PreemptionInjector``)."""
        for index, item in self.running.items():
            if (
                item.preempt_at == math.inf
                and item.exposure_s < math.inf
                and self.store.get_shard(self.job_id, index).epoch > item.launch_epoch
            ):
                item.preempt_at = now + item.exposure_s
            if item.term_sent_at is None and now >= item.preempt_at:
                item.signalled = True
                item.proc.signal(signal.SIGTERM)
                item.term_sent_at = now
                self.preemptions += 1
            elif item.term_sent_at is not None and now - item.term_sent_at >= self.options.preempt_notice_s:
                item.proc.signal(signal.SIGKILL)

    def reap_exited(self, now: float) -> None:
        """Collect exited workers: classify each failed try once, then requeue, back off or stop."""
        self.reap_racers()
        for index in list(self.running):
            item = self.running[index]
            code = item.proc.popen.poll()
            if code is None:
                continue
            del self.running[index]
            self.release_launch(item)
            if item.dispatched:
                self.release_slot(index)
            failure = self.try_failure(item, code)
            if index in self.racing and (
                failure is None or failure.failure is not FailureClass.CONFIGURATION
            ):
                # the shard is in its racer's hands now (the store promoted it, or it won): it
                # becomes the shard's running try, and nothing is retried
                self.running[index] = self.racing.pop(index)
                continue
            if failure is None:
                self.failures_in_a_row.pop(index, None)
                # a try that ended well need not have finished its shard: a racer promoted to the
                # running try (its primary preempted while it started) that then found nothing to
                # race exits 0 without claiming it; the shard is placed again unless it is done
                self.requeue(index, now)
                continue
            if is_stopped(self.store.get_job(self.job_id).state):
                # cancelled, failed (a configuration error stops the job) or finished elsewhere
                self.stopped = True
                return
            self.settle(index, failure, now)
            if self.stopped:
                return

    def try_failure(self, item: _Running, code: int) -> TryFailure | None:
        """How the try failed: the worker's own word, else its exit read with what the runner did."""
        message = _read_message(item.message_path)
        if code < 0 or message is None:
            failure = classify_exit(code, signalled_by_launcher=item.signalled)
            if failure is None:
                return None
            if code < 0:
                reason = f"worker pid {item.proc.pid} " + (
                    "stopped by the runner" if item.signalled else f"died of signal {-code} (a crash)"
                )
                fenced = self._fence_dead(item.proc, failure, reason)
                # a process killed before it claimed counts towards the launches that never claim
                claimed = fenced or launched_attempt(self.store, item.proc) is not None
                return TryFailure(failure, reason, claimed=claimed)
            return TryFailure(failure, f"worker exited {code} without saying why", claimed=False)
        if worker_exit(code) is WorkerExit.SUCCEEDED:
            return None
        return message

    def settle(self, index: int, failure: TryFailure, now: float) -> None:
        """docs/design.md §6.6 for one failed try: stop, back off or requeue at once."""
        if failure.failure is FailureClass.CONFIGURATION:
            self.stop(ConfigurationError(f"configuration error: {failure.error}", job_id=self.job_id))
            return
        if failure.refused == "leased":
            self.held_elsewhere.add(index)
        if failure.failure is FailureClass.PREEMPTED:
            pass  # a launch the runner itself stopped says nothing about whether workers can start
        elif not failure.claimed and failure.refused is None:
            self.unclaimed_in_a_row += 1
            self.last_unclaimed = failure
            if failure.failure is FailureClass.TRANSIENT:
                self.note_outage(now, failure.error)
            elif self.unclaimed_in_a_row >= self.options.unclaimed_limit:
                self.stop(
                    ConfigurationError(
                        f"{self.unclaimed_in_a_row} worker launches in a row died before claiming a "
                        f"shard; the last one: {failure.error}",
                        job_id=self.job_id,
                    )
                )
                return
        elif failure.claimed:
            self.unclaimed_in_a_row = 0
            if failure.failure is not FailureClass.TRANSIENT:
                self.outage_since = None
        if failure.failure is FailureClass.TRANSIENT and failure.claimed:
            self.note_outage(now, failure.error)
        if self.stopped:
            return
        delay = 0.0
        if failure.failure in (FailureClass.TRANSIENT, FailureClass.DETERMINISTIC) and not failure.progressed:
            n = self.failures_in_a_row[index] = self.failures_in_a_row.get(index, 0) + 1
            # the slack less the poll that relaunches it: the turnaround the decision allowed
            slack = self.slack_s()
            if slack is not None:
                slack -= self.options.poll_interval_s
            delay = backoff_s(n, cap_s=self.options.backoff_cap_s, slack_s=slack)
            log.warning(
                "shard %05d: %s failure (%s); retrying in %.1fs",
                index,
                failure.failure.value,
                failure.error,
                delay,
            )
        else:
            self.failures_in_a_row.pop(index, None)
        self.requeue(index, now)
        self.not_before[index] = max(self.not_before.get(index, 0.0), now + delay)

    def note_outage(self, now: float, error: str) -> None:
        """An outage: ride it out for ``outage_window_s`` (never past the deadline), then give up."""
        if self.outage_since is None:
            self.outage_since = now
            log.warning("store or object store unreachable (%s): waiting it out", error)
        elif now - self.outage_since > self.options.outage_window_s:
            self.stop(
                StoreError(
                    f"the store or object store stayed unreachable for {now - self.outage_since:.0f}s "
                    f"(last error: {error}); the job is kept: rerun to resume it",
                    job_id=self.job_id,
                    failure=FailureClass.TRANSIENT.value,
                )
            )

    def stop(self, error: Exception) -> None:
        if self.stop_error is None:
            self.stop_error = error
        self.stopped = True

    def slack_s(self) -> float | None:
        """The job's slack now (docs/design.md §5), or None when it cannot be read."""
        try:
            view = read_job_view(
                self.raw_store, self.job_id, now=self.clock.now(), parallelism=self.options.workers
            )
        except Exception:
            return None
        return view.slack_s

    def watch_held_elsewhere(self, now: float) -> None:
        """Shards another attempt holds: drop them once it finished them, retry once it let go."""
        if not self.held_elsewhere or now < self.next_watch:
            return
        self.next_watch = now + max(0.2, self.options.poll_interval_s)
        for index in list(self.held_elsewhere):
            shard = self.store.get_shard(self.job_id, index)
            if shard.state in TERMINAL_SHARD_STATES:
                self.held_elsewhere.discard(index)
                with contextlib.suppress(ValueError):
                    self.pending.remove(index)
                self.not_before.pop(index, None)
            elif shard.state is not ShardState.LEASED:
                self.held_elsewhere.discard(index)
                self.not_before.pop(index, None)

    def requeue(self, index: int, now: float) -> None:
        shard = self.store.get_shard(self.job_id, index)
        if shard.state in TERMINAL_SHARD_STATES:
            return
        if shard.state is ShardState.LEASED and shard.lease_expires_at:
            # another attempt (say, a worker of a killed earlier run) still holds a live
            # lease: relaunching before it expires would only be refused again
            self.not_before[index] = now + max(0.0, shard.lease_expires_at - self.store.db_time())
        if index not in self.pending:
            self.pending.append(index)

    def _fence_dead(self, proc: WorkerProcess, failure: FailureClass, reason: str) -> bool:
        return fence_dead_worker(self.store, proc, failure=failure, reason=reason)


class _DurableStore:
    """The runner's store: a call that fails because the store is unreachable waits it out.

    Backs off (jittered, capped) and tries again while the run's outage window lasts and the
    deadline has not passed (docs/design.md §6.6, §10); anything else is raised at once.
    """

    def __init__(self, store: ManifestStore, run: LocalRun) -> None:
        self._store = store
        self._run = run

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            n = 0
            while True:
                try:
                    return attr(*args, **kwargs)
                except StoreError as exc:
                    if classify_exception(exc) is not FailureClass.TRANSIENT:
                        raise
                    n += 1
                    waited = time.monotonic() - started
                    if (
                        waited > self._run.options.outage_window_s
                        or self._run.clock.now() >= self._run.deadline
                    ):
                        raise
                    delay = backoff_s(n, base_s=0.2, cap_s=5.0)
                    log.warning("store unreachable (%s); retrying %s in %.1fs", exc, name, delay)
                    time.sleep(delay)

        return call


def _read_message(path: str) -> TryFailure | None:
    """The worker's termination message (one JSON line), or None when it wrote none."""
    if not path:
        return None
    try:
        raw = open(path, "rb").read()  # noqa: SIM115 - tiny file, read once
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot read the termination message %s: %s", path, exc)
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    try:
        import orjson

        return TryFailure.from_dict(orjson.loads(raw))
    except Exception:
        return None


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
        item.signalled = True
        item.proc.signal(signal.SIGTERM)
    stop_by = time.monotonic() + grace_s
    for item in running.values():
        try:
            item.proc.popen.wait(timeout=max(0.0, stop_by - time.monotonic()))
        except Exception:
            item.proc.signal(signal.SIGKILL)
            item.proc.popen.wait()
        if item.proc.popen.returncode is not None and item.proc.popen.returncode < 0:
            with contextlib.suppress(Exception):  # the lease expires by itself otherwise
                fence_dead_worker(
                    store,
                    item.proc,
                    failure=FailureClass.PREEMPTED,
                    reason=f"worker pid {item.proc.pid} stopped by the runner",
                )
    running.clear()


def _open_log(path: str | None) -> IO[bytes]:
    return open(path or os.devnull, "ab")  # noqa: SIM115 - closed by LocalRun.work_until_done
