"""What the jobs page and the job page show, read from the store through the ONE job view.

Every number comes from the job view exactly as :func:`operators.placement.read_job_view` builds it
(:func:`operators.placement.job_view_of` over rows read once per page: predicted finish, slack,
records, work) or from the store's rows (shards, attempts, commits); cost and redone work are
:func:`metrics.attempt_totals`, the same values the ``deadline_batch.cost`` and
``deadline_batch.redone_work_s`` gauges send. Nothing here re-implements a formula:

* **History** (the burn-down and slack-over-time series) is the same :func:`core.job_view.build_job_view`
  evaluated at past instants over the rows as they stood then (:func:`rows_as_of`): commits up to
  that instant, each shard's cursor as the number of its microbatches committed by then, the Spot
  tries finished by then. At most :data:`MAX_POINTS` instants, from one read of each table; fewer
  for a job of many rows (:func:`history_points`), so that a page view stays bounded.
* **Spread** of the predicted finish: the earliest and latest finish the view predicted over the
  last :data:`SPREAD_POINTS` instants of the history (how much the prediction has moved lately),
  none of them earlier than now.
* **Projected cost**: cost so far plus the expected GPU-seconds of work left at the price per second
  the job has paid so far (the reference pool's price before any try ran).

Error samples are the one part read from object storage: at most :data:`SAMPLE_OBJECTS` committed
objects with errored records, :data:`SAMPLE_BYTES` each, at most :data:`SAMPLE_LINES` lines of
:data:`SAMPLE_LINE_CHARS`, so a page view stays bounded.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.ids import submitted_key
from airflow_deadline_batch.core.job_view import (
    JobView,
    build_job_view,
    pool_named,
    reference_pool,
)
from airflow_deadline_batch.core.pools import PoolKind
from airflow_deadline_batch.core.states import (
    UNRUN_ATTEMPT_OUTCOMES,
    JobState,
    ShardState,
    is_preemption,
)
from airflow_deadline_batch.metrics import attempt_totals
from airflow_deadline_batch.operators.placement import job_view_of

if TYPE_CHECKING:
    from airflow_deadline_batch.store import AttemptRow, CommitRow, JobRow, JobRows, ManifestStore, ShardRow

log = logging.getLogger(__name__)

#: instants of the history (burn-down and slack series) at most
MAX_POINTS = 120
#: rows (shards, commits, tries) the history's instants look through together at most: each
#: instant replays the view over every row, so a job of 100,000 commits gets fewer instants
#: instead of a page that takes longer than its refresh
HISTORY_ROW_BUDGET = 600_000
#: instants of the history at least, however many rows (the chart's shape)
MIN_POINTS = 12
#: the last instants whose predicted finishes give the prediction's spread
SPREAD_POINTS = 10
#: committed objects read for the error sample, and bytes read from each
SAMPLE_OBJECTS = 3
SAMPLE_BYTES = 64 * 1024
#: error lines shown at most, and characters of each (an engine's message can be the whole prompt)
SAMPLE_LINES = 10
SAMPLE_LINE_CHARS = 500


@dataclasses.dataclass(frozen=True, kw_only=True)
class DagRunRef:
    """The Airflow task that planned a job, from its default idempotency key ``dag/run/task``."""

    dag_id: str
    run_id: str
    task_id: str


def planned_by(idempotency_key: str | None) -> DagRunRef | None:
    """The DAG run and task of ``DeadlineBatchOperator``'s default key; None for any other key.

    DAG and task IDs cannot contain ``/`` (Airflow's ``KEY_REGEX``); a run ID can, so the key splits
    at its first and last slash.
    """
    if not idempotency_key:
        return None
    idempotency_key = submitted_key(idempotency_key)  # a rejected job's key carries a mark
    if idempotency_key.count("/") < 2:
        return None
    dag_id, _, rest = idempotency_key.partition("/")
    run_id, _, task_id = rest.rpartition("/")
    if not dag_id or not run_id or not task_id:
        return None
    return DagRunRef(dag_id=dag_id, run_id=run_id, task_id=task_id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostSummary:
    """What the job's tries cost (``metrics.attempt_totals``) and how it splits between capacities."""

    so_far: float
    projected: float
    spot_share: float | None
    on_demand_share: float | None
    redone_work_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSummary:
    """One row of the jobs list."""

    job_id: str
    tenant: str
    planned_by: DagRunRef | None
    state: JobState
    deadline: dt.datetime
    predicted_finish: dt.datetime
    slack_s: float
    committed_records: int
    total_records: int
    cost: CostSummary
    stopped: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistoryPoint:
    """The job view at one past instant: records left, predicted finish and slack then."""

    at: dt.datetime
    remaining_records: int
    predicted_finish: dt.datetime
    slack_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardLine:
    shard_index: int
    state: ShardState
    pool: str | None
    capacity: str | None
    attempts: int
    preemptions: int
    cursor: int
    num_microbatches: int
    records: int
    last_error: str | None
    #: the tail race: a live racing lease holds the shard beside its lease, on ``racing_on``
    racing: bool = False
    racing_on: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorSample:
    """Errored records: the count from commits, codes and lines from a bounded sample of objects."""

    errored_records: int
    codes: Mapping[str, int]
    lines: tuple[str, ...]
    objects_read: int
    unavailable: str | None = None
    #: failed tries by failure class (``core.failures``), with the latest message of each class
    try_failures: Mapping[str, int] = dataclasses.field(default_factory=dict)
    try_messages: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobPage:
    """Everything the job page shows."""

    summary: JobSummary
    started_at: dt.datetime
    now: dt.datetime
    history: tuple[HistoryPoint, ...]
    finish_spread: tuple[dt.datetime, dt.datetime]
    shards: tuple[ShardLine, ...]
    shards_by_state_pool: Mapping[tuple[str, str], int]
    preemptions: int
    errors: ErrorSample
    manifest_uri: str | None
    #: the published manifest's outcome counts (cancelled and expired records included); None
    #: before publication or when the manifest cannot be read from here
    outcomes: Mapping[str, int] | None = None
    error: str | None
    #: workers holding a shard now: every leased shard's, and each live racer beside one
    running_workers: int = 0


# -- cost --------------------------------------------------------------------------------------


def cost_summary(view: JobView, attempts: Sequence[AttemptRow], commits: Sequence[CommitRow]) -> CostSummary:
    """Cost so far and projected, the Spot / on-demand share of GPU time, redone work."""
    totals = attempt_totals(view, attempts, commits)
    seconds = {PoolKind.SPOT: 0.0, PoolKind.ON_DEMAND: 0.0}
    for attempt in attempts:
        pool = pool_named(attempt.pool, view.pools)
        if pool is None or attempt.outcome in UNRUN_ATTEMPT_OUTCOMES:
            continue
        ended = ensure_aware(attempt.ended_at, "ended_at") if attempt.ended_at else view.now
        seconds[pool.kind] += max(
            0.0, (ended - ensure_aware(attempt.started_at, "started_at")).total_seconds()
        )
    ran_s = seconds[PoolKind.SPOT] + seconds[PoolKind.ON_DEMAND]
    price_per_s = totals.cost / ran_s if ran_s > 0 else reference_pool(view.pools).price_per_gpu_hour / 3600
    remaining = 0.0 if view.stopped else view.remaining_work_s
    return CostSummary(
        so_far=totals.cost,
        projected=totals.cost + remaining * price_per_s,
        spot_share=seconds[PoolKind.SPOT] / ran_s if ran_s > 0 else None,
        on_demand_share=seconds[PoolKind.ON_DEMAND] / ran_s if ran_s > 0 else None,
        redone_work_s=totals.redone_work_s,
    )


def summarize(job: JobRow, view: JobView, cost: CostSummary) -> JobSummary:
    return JobSummary(
        job_id=job.job_id,
        tenant=job.tenant,
        planned_by=planned_by(job.idempotency_key),
        state=view.state,
        deadline=view.deadline,
        predicted_finish=view.predicted_finish,
        slack_s=view.slack_s,
        committed_records=view.committed_records,
        total_records=view.total_records,
        cost=cost,
        stopped=view.stopped,
    )


def summary_of_rows(job: JobRow, rows: JobRows, *, now: dt.datetime) -> JobSummary:
    """One row of the jobs list, from the job's shards, commits and attempts (a list reads them for
    all its jobs at once: ``ManifestStore.rows_of_jobs``)."""
    view = job_view_of(job, rows.shards, rows.commits, rows.attempts, now=now)
    return summarize(job, view, cost_summary(view, rows.attempts, rows.commits))


def read_job_summary(store: ManifestStore, job: JobRow, *, now: dt.datetime) -> JobSummary:
    """One row of the jobs list: the job's shards, commits and attempts in one read."""
    return summary_of_rows(job, store.rows_of_jobs([job.job_id])[job.job_id], now=now)


# -- history -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ShardAt:
    """A shard as it stood at a past instant (the fields ``build_job_view`` reads)."""

    shard_index: int
    state: ShardState
    est_work_s: float
    num_microbatches: int
    cursor: int
    last_pool: str | None


def rows_as_of(
    at: dt.datetime,
    shards: Sequence[ShardRow],
    commits: Sequence[CommitRow],
    attempts: Sequence[AttemptRow],
) -> tuple[list[_ShardAt], list[CommitRow], list[AttemptRow]]:
    """Shards, commits and finished tries as they stood at ``at`` (commits are append-only)."""
    done = [c for c in commits if c.committed_at <= at]
    cursors = Counter(c.shard_index for c in done if c.shard_index >= 0)
    shards_then = []
    for shard in shards:
        cursor = min(cursors.get(shard.shard_index, 0), shard.num_microbatches)
        finished = shard.num_microbatches > 0 and cursor >= shard.num_microbatches
        shards_then.append(
            _ShardAt(
                shard_index=shard.shard_index,
                state=ShardState.SUCCEEDED if finished else ShardState.PENDING,
                est_work_s=shard.est_work_s,
                num_microbatches=shard.num_microbatches,
                cursor=cursor,
                last_pool=None,
            )
        )
    tries = [a for a in attempts if a.ended_at is not None and a.ended_at <= at]
    return shards_then, done, tries


def history_points(rows: int) -> int:
    """Instants of the history for a job of ``rows`` rows: :data:`MAX_POINTS` within the budget."""
    return min(MAX_POINTS, max(MIN_POINTS, HISTORY_ROW_BUDGET // max(rows, 1)))


def sample_instants(
    start: dt.datetime, end: dt.datetime, commits: Iterable[CommitRow], points: int | None = None
) -> list[dt.datetime]:
    """The job's start, each distinct commit instant, and ``end``; evenly thinned to ``points``
    (default :data:`MAX_POINTS`)."""
    points = MAX_POINTS if points is None else points
    stamps = sorted({start, end, *(c.committed_at for c in commits if start <= c.committed_at <= end)})
    if len(stamps) <= points:
        return stamps
    step = (len(stamps) - 1) / (points - 1)
    return sorted({stamps[round(i * step)] for i in range(points)})


def job_history(
    job: JobRow,
    view: JobView,
    shards: Sequence[ShardRow],
    commits: Sequence[CommitRow],
    attempts: Sequence[AttemptRow],
) -> tuple[HistoryPoint, ...]:
    """The job view at each sampled instant from the job's start to now (or its completion)."""
    end = view.completed_at or view.now
    running = dataclasses.replace(job, state=JobState.RUNNING, completed_at=None)
    points = []
    instants = history_points(len(shards) + len(commits) + len(attempts))
    for at in sample_instants(view.started_at, end, commits, instants):
        if at == end:
            then = view
        else:
            shards_then, commits_then, tries_then = rows_as_of(at, shards, commits, attempts)
            then = build_job_view(
                running,
                shards_then,
                commits_then,
                now=at,
                pools=view.pools,
                parallelism=view.parallelism,
                attempts=tries_then,
            )
        points.append(
            HistoryPoint(
                at=at,
                remaining_records=max(0, then.total_records - then.committed_records),
                predicted_finish=then.predicted_finish,
                slack_s=then.slack_s,
            )
        )
    return tuple(points)


def finish_spread(view: JobView, history: Sequence[HistoryPoint]) -> tuple[dt.datetime, dt.datetime]:
    """Earliest and latest predicted finish over the last :data:`SPREAD_POINTS` instants."""
    if view.finished:
        return view.predicted_finish, view.predicted_finish
    # an earlier prediction of a finish that is already past says only "not before now"
    recent = [max(p.predicted_finish, view.now) for p in history[-SPREAD_POINTS:]]
    recent.append(view.predicted_finish)
    return min(recent), max(recent)


# -- shards and errors ---------------------------------------------------------------------------


def shard_lines(
    view: JobView, shards: Sequence[ShardRow], attempts: Sequence[AttemptRow]
) -> tuple[ShardLine, ...]:
    preempted = Counter(a.shard_index for a in attempts if is_preemption(a.outcome, a.failure_class))
    pool_of = {a.attempt_id: a.pool for a in attempts}
    out = []
    for shard in sorted(shards, key=lambda s: s.shard_index):
        pool = pool_named(shard.last_pool, view.pools)
        racing = races_now(shard, view.now)
        out.append(
            ShardLine(
                shard_index=shard.shard_index,
                state=shard.state,
                pool=shard.last_pool,
                capacity=pool.kind.value if pool else None,
                attempts=shard.attempts,
                preemptions=preempted.get(shard.shard_index, 0),
                cursor=shard.cursor,
                num_microbatches=shard.num_microbatches,
                records=shard.records,
                last_error=shard.last_error,
                racing=racing,
                racing_on=pool_of.get(shard.race_attempt_id or "") if racing else None,
            )
        )
    return tuple(out)


def races_now(shard: ShardRow, now: dt.datetime) -> bool:
    """Whether a live racing lease (the tail race) holds the leased ``shard`` beside its lease.

    The lease's expiry is on the database clock; the page's ``now`` stands in for it (a display).
    """
    return (
        shard.state is ShardState.LEASED
        and shard.race_attempt_id is not None
        and (shard.race_expires_at or 0.0) > now.timestamp()
    )


def running_workers(lines: Iterable[ShardLine]) -> int:
    """Workers holding a shard: one per leased shard, one more per live racer."""
    return sum((line.state is ShardState.LEASED) + line.racing for line in lines)


def by_state_and_pool(lines: Iterable[ShardLine]) -> dict[tuple[str, str], int]:
    counts: Counter[tuple[str, str]] = Counter((line.state.value, line.pool or "-") for line in lines)
    return dict(sorted(counts.items()))


def read_error_sample(commits: Sequence[CommitRow], attempts: Sequence[AttemptRow]) -> ErrorSample:
    """Errored records from commits; codes and lines from the first bytes of a few errored objects."""
    from airflow_deadline_batch.storage import open_uri

    errored = sum(int((c.counts or {}).get("errored", 0)) for c in commits)
    classes = Counter(a.failure_class for a in attempts if a.failure_class)
    messages = {
        a.failure_class: a.error or ""
        for a in sorted(attempts, key=lambda a: a.started_at)
        if a.failure_class
    }
    with_errors = [c for c in commits if int((c.counts or {}).get("errored", 0)) > 0]
    codes: Counter[str] = Counter()
    lines: list[str] = []
    read = 0
    unavailable = None
    for commit in sorted(with_errors, key=lambda c: (c.shard_index, c.seq))[:SAMPLE_OBJECTS]:
        try:
            storage, key = open_uri(commit.uri)
            data = storage.read_range(key, 0, SAMPLE_BYTES)
        except Exception as exc:  # the page still shows the counts from the store
            unavailable = f"could not read {commit.uri}: {exc}"
            log.warning("error sample: %s", unavailable)
            break
        read += 1
        for raw in data.splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # the last line cut by the byte limit
            error = record.get("error") if isinstance(record, dict) else None
            if not isinstance(error, dict):
                continue
            codes[str(error.get("code"))] += 1
            if len(lines) < SAMPLE_LINES:
                line = f"line {record.get('line')}: {error.get('code')}: {error.get('message')}"
                lines.append(line if len(line) <= SAMPLE_LINE_CHARS else line[: SAMPLE_LINE_CHARS - 1] + "…")
    return ErrorSample(
        errored_records=errored,
        codes=dict(codes.most_common()),
        lines=tuple(lines),
        objects_read=read,
        unavailable=unavailable,
        try_failures=dict(classes.most_common()),
        try_messages=messages,
    )


# -- the two pages -------------------------------------------------------------------------------


def read_job_page(store: ManifestStore, job_id: str, *, now: dt.datetime) -> JobPage:
    """One job's page: the job view, its history, shards, cost, errors (one read of each table)."""
    job = store.get_job(job_id)
    shards = store.list_shards(job_id)
    commits = store.list_commits(job_id)
    attempts = store.list_attempts(job_id)
    view = job_view_of(job, shards, commits, attempts, now=now)
    cost = cost_summary(view, attempts, commits)
    history = job_history(job, view, shards, commits, attempts)
    lines = shard_lines(view, shards, attempts)
    return JobPage(
        summary=summarize(job, view, cost),
        started_at=view.started_at,
        now=view.now,
        history=history,
        finish_spread=finish_spread(view, history),
        shards=lines,
        shards_by_state_pool=by_state_and_pool(lines),
        preemptions=view.spot_tries.preemptions,
        errors=read_error_sample(commits, attempts),
        manifest_uri=job.manifest_uri,
        outcomes=published_outcomes(job.manifest_uri),
        error=job.error,
        running_workers=running_workers(lines),
    )


#: the largest manifest the page reads for its outcome counts
MANIFEST_MAX_BYTES = 64 * 1024 * 1024


def published_outcomes(manifest_uri: str | None) -> Mapping[str, int] | None:
    """The published manifest's ``outcomes`` (every line's terminal status, counted); None if unread.

    The store counts committed outcomes only; the ``expired`` and ``cancelled`` outcomes that
    finalization writes for unfinished records are in the manifest.
    """
    if not manifest_uri:
        return None
    try:
        counts = _manifest_outcomes(manifest_uri)
    except Exception:  # object storage unreachable from the api-server: the page shows the rest
        log.warning("cannot read the outcomes of %s", manifest_uri, exc_info=True)
        return None
    return None if counts is None else dict(counts)


@functools.lru_cache(maxsize=512)
def _manifest_outcomes(manifest_uri: str) -> Mapping[str, int] | None:
    """A published manifest's outcome counts, read once per api-server process; None for one
    larger than :data:`MANIFEST_MAX_BYTES`.

    A published manifest is immutable (docs/design.md), so the page refreshing every few
    seconds need not read it again, nor a manifest too large to count again (it stays too
    large); a read that fails raises and is not cached.
    """
    from airflow_deadline_batch.storage import open_uri

    storage, key = open_uri(manifest_uri)
    if storage.size(key) > MANIFEST_MAX_BYTES:
        log.warning(
            "%s is larger than %d bytes: the job page shows no outcome counts",
            manifest_uri,
            MANIFEST_MAX_BYTES,
        )
        return None
    manifest = json.loads(storage.read_range(key, 0, MANIFEST_MAX_BYTES))
    return {str(k): int(v) for k, v in manifest["outcomes"].items()}


def plain_summary(summary: JobSummary) -> dict[str, Any]:
    """A :class:`JobSummary` as JSON values (the API's jobs list)."""
    return {
        "job_id": summary.job_id,
        "dag_id": summary.planned_by.dag_id if summary.planned_by else None,
        "run_id": summary.planned_by.run_id if summary.planned_by else None,
        "task_id": summary.planned_by.task_id if summary.planned_by else None,
        "state": summary.state.value,
        "deadline": summary.deadline.isoformat(),
        "predicted_finish": summary.predicted_finish.isoformat(),
        "slack_s": summary.slack_s,
        "committed_records": summary.committed_records,
        "total_records": summary.total_records,
        "cost": dataclasses.asdict(summary.cost),
    }
