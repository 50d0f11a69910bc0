"""One view of a running job: stopped or not, work left, measured rates, predicted finish, slack.

:func:`build_job_view` turns the store's rows (anything with the fields of the protocols below;
``store.rows`` has them) into a frozen :class:`JobView`. The CLI's ``status``, the local runner,
the shard operators (through ``operators.placement.decide_for_try``), the completeness sensor and
the deadline-risk notifier all read a job through it, so they agree on every number:

* **Stopped**: a job in a terminal state (:data:`core.states.TERMINAL_JOB_STATES`) runs no shard.
* **Work**: each shard's estimated GPU-seconds (the planner's, at the reference pool's nominal
  rates: Spot first, docs/design.md §5) times the share of its microbatches not yet committed
  (a succeeded shard has none left), counted from commits only (docs/design.md §4.5, invariant 4).
* **Rates**: :func:`core.calibration.calibrate` folds every committed microbatch (tokens, seconds,
  pool) into per-pool rates. Estimated work is converted to expected seconds by the *slowdown*
  (nominal rate ÷ learned rate) of the reference pool, or, before it has run anything, of the
  pool measured longest (the job's model is fixed; pools of one job run the same engine).
* **Predicted finish and slack**: one formula, :func:`core.placement.od_need_s`: a changeover (the
  slowest pool's startup plus its queue wait: what a relaunch costs), the work left spread over
  the job's workers, and one shard of list-scheduling imbalance. The job's slack is the slack the
  placement of its largest unfinished shard sees, the smallest any of its shards sees.
* **Observed preemptions** (docs/design.md §5): the finished attempts on Spot pools, oldest end
  first, folded into :class:`core.calibration.SpotTries` for the job and for each shard: the
  preemption rate per Spot-hour (shrunk to the declared rate) gives the expected Spot run, and the
  tries preempted (:func:`core.states.is_preemption`: ``preempted``, ``abandoned``, ``lost_lease``,
  unless their class says they crashed) without a commit of their own make the preemption storm
  the placement escalates on. A crashed Spot try is Spot time without a preemption.

**Efficiency factor: 1.0 on calibrated rates.** A measured rate is end to end already (a
microbatch's elapsed time includes everything its worker did for it), so discounting it again
would count the overhead twice; before the first commit the pool's nominal rate is what the
planner priced the work at. Admission's ``AdmissionPolicy.efficiency`` (docs/design.md §5) is a
different quantity: the margin a plan that has not run yet must keep, with its recovery reserve.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from airflow_deadline_batch.core.calibration import (
    Calibration,
    PoolEstimate,
    RateSample,
    SpotTries,
    SpotTry,
    calibrate,
)
from airflow_deadline_batch.core.clock import UTC, ensure_aware
from airflow_deadline_batch.core.placement import JobSnapshot, od_need_s
from airflow_deadline_batch.core.pools import PoolKind, PoolSpec
from airflow_deadline_batch.core.states import (
    TERMINAL_JOB_STATES,
    UNRUN_ATTEMPT_OUTCOMES,
    AttemptOutcome,
    JobState,
    ShardState,
    is_preemption,
)
from airflow_deadline_batch.core.tenants import DEFAULT_TENANT

__all__ = [
    "AttemptFields",
    "CommitFields",
    "FinishedSpotTry",
    "JobFields",
    "JobView",
    "PoolRate",
    "ShardFields",
    "as_utc",
    "build_job_view",
    "changeover_s",
    "finished_spot_tries",
    "is_stopped",
    "pool_index",
    "pool_named",
    "reference_pool",
    "shard_done_fraction",
    "spot_tries",
]


class JobFields(Protocol):
    """The job row fields the view reads (``store.rows.JobRow`` has them)."""

    @property
    def job_id(self) -> str: ...
    @property
    def state(self) -> JobState: ...
    @property
    def deadline(self) -> dt.datetime: ...
    @property
    def created_at(self) -> dt.datetime: ...
    @property
    def completed_at(self) -> dt.datetime | None: ...
    @property
    def input_lines(self) -> int: ...
    @property
    def config(self) -> Mapping[str, Any]: ...


class ShardFields(Protocol):
    """The shard row fields the view reads (``store.rows.ShardRow`` has them)."""

    @property
    def shard_index(self) -> int: ...
    @property
    def state(self) -> ShardState: ...
    @property
    def est_work_s(self) -> float: ...
    @property
    def num_microbatches(self) -> int: ...
    @property
    def cursor(self) -> int: ...
    @property
    def last_pool(self) -> str | None: ...


class CommitFields(Protocol):
    """The commit row fields the view reads (``store.rows.CommitRow`` has them)."""

    @property
    def records(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def elapsed_s(self) -> float: ...
    @property
    def pool(self) -> str | None: ...
    @property
    def committed_at(self) -> dt.datetime: ...
    @property
    def attempt_id(self) -> str: ...


class AttemptFields(Protocol):
    """The attempt row fields the view reads (``store.rows.AttemptRow`` has them)."""

    @property
    def attempt_id(self) -> str: ...
    @property
    def shard_index(self) -> int: ...
    @property
    def pool(self) -> str | None: ...
    @property
    def started_at(self) -> dt.datetime: ...
    @property
    def ended_at(self) -> dt.datetime | None: ...
    @property
    def outcome(self) -> AttemptOutcome: ...
    @property
    def failure_class(self) -> str | None: ...


def is_stopped(state: JobState | str) -> bool:
    """Whether a job in ``state`` will run no shard any more (terminal: completed, partial, ...)."""
    return JobState(state) in TERMINAL_JOB_STATES


def shard_done_fraction(shard: ShardFields) -> float:
    """Share of a shard's work committed: its committed microbatches, all of it once succeeded."""
    if shard.state is ShardState.SUCCEEDED or shard.num_microbatches == 0:
        return 1.0
    return min(shard.cursor, shard.num_microbatches) / shard.num_microbatches


def changeover_s(pools: Iterable[PoolSpec], seen: Mapping[str, float] | None = None) -> float:
    """What a (re)launch costs in wall time: the slowest pool's startup plus its queue wait, or
    the longest start its tries were seen to take (``seen``, :func:`startup_seen_s`) when longer.

    ``seen`` is keyed by the attempts' pools, resolved as every other pool of the view (by name,
    else by kind: :func:`pool_index`); a pool the job no longer has counts for nothing."""
    pools = tuple(pools)
    worst = {p.name: p.startup_seconds + p.queue_wait_seconds for p in pools}
    if seen:
        index = pool_index(pools)
        for name, start in seen.items():
            pool = index.get(name)
            if pool is not None and start > worst[pool.name]:
                worst[pool.name] = start
    return max(worst.values(), default=0.0)


def startup_seen_s(attempts: Iterable[AttemptFields], commits: Iterable[CommitFields]) -> dict[str, float]:
    """The longest start the job's tries were seen to take, by pool: from a try's claim to its
    first commit, less that microbatch's own time (``elapsed_s``).

    That is the worker's start after its claim (the model's load, the engine's warm-up, the
    input's read): part of a changeover that a pool's declared ``startup_seconds`` must cover. A
    declaration below it is wrong, and a placement that trusted it would escalate too late, so
    :func:`changeover_s` takes the longer. Tries that never committed tell nothing here.
    """
    attempts = list(attempts)
    if not attempts:
        return {}
    first: dict[str, CommitFields] = {}
    for commit in commits:
        earlier = first.get(commit.attempt_id)
        if earlier is None or commit.committed_at < earlier.committed_at:
            first[commit.attempt_id] = commit
    out: dict[str, float] = {}
    for attempt in attempts:
        head = first.get(attempt.attempt_id)
        if head is None or attempt.pool is None:
            continue
        took = as_utc(head.committed_at, "committed_at") - as_utc(attempt.started_at, "started_at")
        start = took.total_seconds() - max(0.0, head.elapsed_s)
        if start > out.get(attempt.pool, 0.0):
            out[attempt.pool] = start
    return out


def reference_pool(pools: Sequence[PoolSpec]) -> PoolSpec:
    """The pool whose nominal rates the planner priced the work at: the first Spot pool, else the first."""
    return next((p for p in pools if p.kind is PoolKind.SPOT), pools[0])


def pool_named(name: str | None, pools: Sequence[PoolSpec]) -> PoolSpec | None:
    """The pool a worker recorded (by name, or by kind: ``spot`` / ``on_demand``); None if unknown."""
    if not name:
        return None
    for pool in pools:
        if pool.name == name:
            return pool
    return next((p for p in pools if p.kind.value == name), None)


@dataclass(frozen=True, kw_only=True)
class PoolRate:
    """One pool's rate for the job's model: nominal, learned, and how much was measured."""

    pool: str
    kind: PoolKind
    nominal_tokens_per_s: float
    tokens_per_s: float
    microbatches: int
    busy_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "kind": self.kind.value,
            "nominal_tokens_per_s": round(self.nominal_tokens_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "measured": self.microbatches > 0,
            "microbatches": self.microbatches,
            "busy_s": round(self.busy_s, 3),
        }


@dataclass(frozen=True, kw_only=True)
class JobView:
    """A job at one instant, in expected wall-clock seconds on calibrated rates (see the module doc)."""

    job_id: str
    state: JobState
    now: dt.datetime
    deadline: dt.datetime
    started_at: dt.datetime
    completed_at: dt.datetime | None
    parallelism: int
    pools: tuple[PoolSpec, ...]
    calibration: Calibration
    #: expected seconds per estimated second of work (the calibrated slowdown, 1.0 before data)
    work_scale: float
    #: expected seconds of each shard's work not committed yet, by shard index
    shard_work_s: Mapping[int, float]
    #: expected seconds of the work committed so far
    committed_work_s: float
    #: shards leased by an attempt on an on-demand pool (workers of the job on on-demand now)
    on_demand_shards: frozenset[int]
    #: pool kind of each shard's last try, by shard index (None: never tried or unknown pool)
    last_kinds: Mapping[int, PoolKind | None]
    total_records: int
    committed_records: int
    #: the job's finished Spot tries (observed preemption rate, fruitless streak)
    spot_tries: SpotTries = SpotTries()
    #: the same per shard (only shards with a finished Spot try)
    shard_spot_tries: Mapping[int, SpotTries] = field(default_factory=dict)
    #: shards leased by an attempt on a Spot pool (workers of the job on Spot now)
    spot_shards: frozenset[int] = frozenset()
    #: the team the job belongs to (core.tenants)
    tenant: str = DEFAULT_TENANT
    #: the longest start each pool's tries were seen to take (:func:`startup_seen_s`)
    startup_seen_s: Mapping[str, float] = field(default_factory=dict)
    #: seconds from a try's end to the next try's decision, for the one deciding
    #: (:attr:`core.placement.JobSnapshot.turnaround_s`; 0: none known)
    turnaround_s: float = 0.0

    @property
    def stopped(self) -> bool:
        return is_stopped(self.state)

    @property
    def finished(self) -> bool:
        return self.completed_at is not None

    @property
    def remaining_work_s(self) -> float:
        """Expected GPU-seconds of the work not committed yet (the whole job, on one worker)."""
        return sum(self.shard_work_s.values())

    @property
    def changeover_s(self) -> float:
        return changeover_s(self.pools, self.startup_seen_s)

    def snapshot(self, shard_index: int | None = None, *, running: bool = False) -> JobSnapshot:
        """The placement inputs for one shard (by default the largest unfinished one)."""
        if shard_index is None:
            shard_index = max(self.shard_work_s, key=lambda i: self.shard_work_s[i], default=-1)
        spot = [p for p in self.pools if p.kind is PoolKind.SPOT]
        remaining = self.remaining_work_s
        shard_tries = self.shard_spot_tries.get(shard_index, SpotTries())
        fruitless = max(self.spot_tries.fruitless, shard_tries.fruitless)
        ends = [e for e in (self.spot_tries.fruitless_end_s, shard_tries.fruitless_end_s) if e is not None]
        age = self.now.timestamp() - max(ends) if ends else None
        return JobSnapshot(
            now=self.now,
            deadline=self.deadline,
            remaining_work_s=remaining,
            shard_work_s=self.shard_work_s.get(shard_index, 0.0),
            parallelism=self.parallelism,
            changeover_s=self.changeover_s,
            notice_s=max((p.preemption_notice_seconds for p in spot), default=0.0),
            spot_preemptions_per_hour=self.spot_tries.preemptions_per_hour,
            spot_mean_run_s=self.spot_tries.mean_run_s,
            spot_fruitless_tries=fruitless,
            spot_fruitless_age_s=None if age is None else max(0.0, age),
            spot_workers=len(self.spot_shards - {shard_index}),
            spot_available=bool(spot),
            previous_pool=self.last_kinds.get(shard_index),
            on_demand_workers=len(self.on_demand_shards - {shard_index}),
            running=running,
            started_at=self.started_at,
            total_work_s=self.committed_work_s + remaining,
            turnaround_s=self.turnaround_s,
        )

    @property
    def predicted_finish(self) -> dt.datetime:
        """When the job ends: its completion time once finished, else now plus :func:`od_need_s`."""
        if self.completed_at is not None:
            return self.completed_at
        return self.now + dt.timedelta(seconds=od_need_s(self.snapshot()))

    @property
    def slack_s(self) -> float:
        """Deadline minus predicted finish (negative: predicted late)."""
        return (self.deadline - self.predicted_finish).total_seconds()

    def rates(self) -> list[PoolRate]:
        """Each pool's nominal and learned rate, in the order of the job's pools."""
        out = []
        for pool in self.pools:
            est = self.calibration.estimate(pool.name)
            out.append(
                PoolRate(
                    pool=pool.name,
                    kind=pool.kind,
                    nominal_tokens_per_s=est.prior_tokens_per_s,
                    tokens_per_s=est.tokens_per_s,
                    microbatches=est.samples,
                    busy_s=est.busy_s,
                )
            )
        return out


def _work_scale(calibration: Calibration, pools: Sequence[PoolSpec]) -> float:
    """The reference pool's slowdown, or the slowdown of the pool measured longest before it has run."""
    ref = calibration.estimate(reference_pool(pools).name)
    if ref.measured:
        return ref.slowdown
    measured: list[PoolEstimate] = [e for e in calibration.pools.values() if e.measured]
    if not measured:
        return 1.0
    return max(measured, key=lambda e: e.busy_s).slowdown


def pool_index(pools: Sequence[PoolSpec]) -> dict[str, PoolSpec]:
    """:func:`pool_named` as one dictionary lookup: each name, then each kind's value, to its first pool.

    ``pool_index(pools).get(name) if name else None`` is ``pool_named(name, pools)``; the view
    resolves every shard's, commit's and attempt's pool through it.
    """
    index: dict[str, PoolSpec] = {}
    for pool in reversed(pools):
        index[pool.kind.value] = pool
    for pool in reversed(pools):
        index[pool.name] = pool
    return index


def as_utc(value: dt.datetime, name: str) -> dt.datetime:
    """:func:`ensure_aware`, without the conversion for a value in UTC already (every store row's)."""
    return value if value.tzinfo is UTC else ensure_aware(value, name)


def _samples(commits: Iterable[CommitFields], index: Mapping[str, PoolSpec]) -> list[RateSample]:
    out = []
    for commit in sorted(commits, key=lambda c: c.committed_at):
        pool = index.get(commit.pool) if commit.pool else None
        if pool is None:
            continue  # the validation object, or a pool the job no longer has: nothing to learn
        out.append(
            RateSample(
                pool=pool.name,
                records=commit.records,
                prompt_tokens=commit.prompt_tokens,
                completion_tokens=commit.completion_tokens,
                elapsed_s=commit.elapsed_s,
            )
        )
    return out


class FinishedSpotTry(NamedTuple):
    """One finished try of the job on a Spot pool, as :meth:`SpotTries.observe` folds it."""

    shard_index: int
    #: the Spot pool's name (the attempt's pool resolved by :func:`pool_named`)
    pool: str
    #: (ended_s, duration_s, preempted, commits)
    fold: SpotTry


def finished_spot_tries(
    attempts: Iterable[AttemptFields],
    commits: Iterable[CommitFields],
    pools: Sequence[PoolSpec],
) -> list[FinishedSpotTry]:
    """The job's finished tries on its Spot pools that ran a worker, oldest end first.

    A try is on Spot when its pool (by name or kind) is a Spot pool of the job; its progress is
    the number of commits recorded under its attempt ID.
    """
    index = pool_index(pools)
    finished = []
    for attempt in attempts:
        pool = index.get(attempt.pool) if attempt.pool else None
        if attempt.ended_at is None or pool is None or pool.kind is not PoolKind.SPOT:
            continue
        if attempt.outcome in UNRUN_ATTEMPT_OUTCOMES:
            continue  # no worker ran: no Spot time, no preemption (availability evidence only)
        finished.append((as_utc(attempt.ended_at, "ended_at"), attempt, pool.name))
    if not finished:
        return []
    per_attempt = Counter(commit.attempt_id for commit in commits)
    finished.sort(key=lambda item: item[0])
    return [
        FinishedSpotTry(
            attempt.shard_index,
            pool_name,
            (
                ended.timestamp(),
                (ended - as_utc(attempt.started_at, "started_at")).total_seconds(),
                is_preemption(attempt.outcome, attempt.failure_class),
                per_attempt[attempt.attempt_id],
            ),
        )
        for ended, attempt, pool_name in finished
    ]


def spot_tries(
    attempts: Iterable[AttemptFields],
    commits: Iterable[CommitFields],
    pools: Sequence[PoolSpec],
    *,
    finished: Sequence[FinishedSpotTry] | None = None,
) -> tuple[SpotTries, Mapping[int, SpotTries]]:
    """The job's and each shard's finished Spot tries folded into :class:`SpotTries` (oldest end first).

    The tries are :func:`finished_spot_tries` (``finished``: those, read already). The declared
    rate of the job's Spot pools is the prior of the observed rate.
    """
    declared = max((p.preemptions_per_hour for p in pools if p.kind is PoolKind.SPOT), default=0.0)
    prior = SpotTries(prior_per_hour=declared)
    if finished is None:
        finished = finished_spot_tries(attempts, commits, pools)
    by_shard: dict[int, list[SpotTry]] = {}
    for one in finished:
        by_shard.setdefault(one.shard_index, []).append(one.fold)
    return prior.observe_all(one.fold for one in finished), _ShardSpotTries(prior, by_shard)


class _ShardSpotTries(Mapping[int, SpotTries]):
    """Each shard's finished Spot tries by shard index, folded when first read (a decision reads
    one shard's; folding every shard's on every decision grew with the job's shards)."""

    __slots__ = ("_folded", "_prior", "_tries")

    def __init__(self, prior: SpotTries, tries: dict[int, list[SpotTry]]) -> None:
        self._prior = prior
        self._tries = tries
        self._folded: dict[int, SpotTries] = {}

    def __getitem__(self, index: int) -> SpotTries:
        folded = self._folded.get(index)
        if folded is None:
            folded = self._folded[index] = self._prior.observe_all(self._tries[index])
        return folded

    def __iter__(self) -> Iterator[int]:
        return iter(self._tries)

    def __len__(self) -> int:
        return len(self._tries)

    def __repr__(self) -> str:
        return repr(dict(self))


def build_job_view(
    job: JobFields,
    shards: Iterable[ShardFields],
    commits: Iterable[CommitFields],
    *,
    now: dt.datetime,
    pools: Sequence[PoolSpec] | None = None,
    parallelism: int | None = None,
    attempts: Iterable[AttemptFields] = (),
    tenant: str = DEFAULT_TENANT,
    finished: Sequence[FinishedSpotTry] | None = None,
) -> JobView:
    """The :class:`JobView` of ``job`` at ``now`` from its shards, commits and attempts (pure).

    ``pools`` default to the pools the job was planned with, ``parallelism`` to its ``workers``;
    without ``attempts`` nothing is known of preemptions but the pools' declared rates. ``tenant``
    is the job row's (the protocol leaves it out so that rows of older fakes still fit).
    ``finished``: the job's :func:`finished_spot_tries`, where the caller has found them already.
    """
    if pools is None:
        pools = tuple(PoolSpec.from_dict(p) for p in job.config.get("pools") or ())
    pools = tuple(pools)
    if not pools:
        raise ValueError(f"job {job.job_id} has no pools: plan it with pools or pass them")
    index = pool_index(pools)
    commits = list(commits)
    calibration = calibrate(pools, _samples(commits, index))
    scale = _work_scale(calibration, pools)
    shard_work: dict[int, float] = {}
    last_kinds: dict[int, PoolKind | None] = {}
    on_demand: set[int] = set()
    on_spot: set[int] = set()
    committed = 0.0
    for shard in shards:
        done = shard_done_fraction(shard)
        work = max(0.0, float(shard.est_work_s)) * scale
        committed += work * done
        if done < 1.0:
            shard_work[shard.shard_index] = work * (1.0 - done)
        last = index.get(shard.last_pool) if shard.last_pool else None
        last_kinds[shard.shard_index] = last.kind if last is not None else None
        if shard.state is ShardState.LEASED and last is not None:
            (on_demand if last.kind is PoolKind.ON_DEMAND else on_spot).add(shard.shard_index)
    attempts = list(attempts)
    job_tries, shard_tries = spot_tries(attempts, commits, pools, finished=finished)
    return JobView(
        job_id=job.job_id,
        state=JobState(job.state),
        now=ensure_aware(now, "now"),
        deadline=job.deadline,
        started_at=job.created_at,
        completed_at=job.completed_at,
        parallelism=max(1, int(parallelism or job.config.get("workers") or 1)),
        pools=pools,
        calibration=calibration,
        work_scale=scale,
        shard_work_s=shard_work,
        committed_work_s=committed,
        on_demand_shards=frozenset(on_demand),
        last_kinds=last_kinds,
        total_records=job.input_lines,
        committed_records=sum(c.records for c in commits),
        spot_tries=job_tries,
        shard_spot_tries=shard_tries,
        spot_shards=frozenset(on_spot),
        tenant=tenant,
        startup_seen_s=startup_seen_s(attempts, commits),
    )
