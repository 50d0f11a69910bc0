"""The rows a placement decision reads, in one read transaction and only the columns it uses.

``operators.placement.read_job_view`` runs before every try of every shard. Reading the job, its
shards, commits and attempts and the pools' history through ``get_job`` / ``list_*`` /
``pool_history`` took five transactions and fourteen statements (each ``list_*`` re-reads the job
row to raise ``JobNotFound``), and turned every commit and attempt into a full row: the commit's
URI, digest and JSON counts, the attempt's error text, none of which the view reads.
:func:`read_placement_rows` reads the job once, then its shards, the seven commit columns of
``core.job_view.CommitFields`` and the attempt columns the view and the availability fold read, in
the ``list_*`` orders (a fold's sums and ties follow them), and the history of the named Spot pools
(:func:`store.pool_stats.spot_history`), all on one connection and one snapshot.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.core.calibration import PoolHistory
from airflow_deadline_batch.core.states import AttemptOutcome
from airflow_deadline_batch.store import pool_stats
from airflow_deadline_batch.store.rows import JobRow, ShardRow
from airflow_deadline_batch.store.schema import attempts, commits, shards

__all__ = ["AttemptFacts", "CommitFacts", "PlacementRows", "read_placement_rows"]


class CommitFacts(NamedTuple):
    """A commit's columns the job view reads (``core.job_view.CommitFields``)."""

    attempt_id: str
    pool: str | None
    records: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    committed_at: dt.datetime


class AttemptFacts(NamedTuple):
    """An attempt's columns the job view and the pools' availability read."""

    attempt_id: str
    shard_index: int
    pool: str | None
    started_at: dt.datetime
    ended_at: dt.datetime | None
    outcome: AttemptOutcome
    heartbeat_at: dt.datetime | None
    failure_class: str | None


@dataclass(frozen=True)
class PlacementRows:
    """What :func:`read_placement_rows` read: the job, its shards, commits and attempts, and history."""

    job: JobRow
    shards: list[ShardRow]
    commits: list[CommitFacts]
    attempts: list[AttemptFacts]
    #: earlier jobs' tries on each named Spot pool (:meth:`ManifestStore.pool_history`)
    history: dict[str, PoolHistory]


_COMMITS = sa.select(
    commits.c.attempt_id,
    commits.c.pool,
    commits.c.records,
    commits.c.prompt_tokens,
    commits.c.completion_tokens,
    commits.c.elapsed_s,
    commits.c.committed_at,
)
_ATTEMPTS = sa.select(
    attempts.c.attempt_id,
    attempts.c.shard_index,
    attempts.c.pool,
    attempts.c.started_at,
    attempts.c.ended_at,
    attempts.c.outcome,
    attempts.c.heartbeat_at,
    attempts.c.failure_class,
)


def read_placement_rows(
    conn: Connection,
    job: JobRow,
    spot_pools: Sequence[str],
    *,
    since: dt.datetime,
    limit: int = pool_stats.HISTORY_LIMIT,
) -> PlacementRows:
    """The rows of ``job`` (read already, on ``conn``) and the history of ``spot_pools`` since ``since``."""
    job_id = job.job_id
    shard_rows = conn.execute(
        sa.select(shards).where(shards.c.job_id == job_id).order_by(shards.c.shard_index)
    )
    commit_rows = conn.execute(
        _COMMITS.where(commits.c.job_id == job_id).order_by(commits.c.shard_index, commits.c.seq)
    )
    attempt_rows = conn.execute(
        _ATTEMPTS.where(attempts.c.job_id == job_id).order_by(
            attempts.c.started_at, attempts.c.shard_index, attempts.c.epoch
        )
    )
    return PlacementRows(
        job=job,
        shards=[ShardRow.from_row(r) for r in shard_rows],
        commits=[CommitFacts._make(r) for r in commit_rows],
        attempts=[
            AttemptFacts(a, s, p, started, ended, AttemptOutcome(o), beat, f)
            for a, s, p, started, ended, o, beat, f in attempt_rows
        ],
        history=(
            pool_stats.spot_history(conn, spot_pools, since=since, exclude_job=job_id, limit=limit)
            if spot_pools
            else {}
        ),
    )
