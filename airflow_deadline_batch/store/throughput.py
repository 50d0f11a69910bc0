"""Read-only queries of what earlier jobs measured of a pool's speed: a new job's rates.

:func:`measured_rates` folds the committed microbatches of earlier jobs of one model (the job
config's ``engine`` and ``model``) on each named pool into a :class:`MeasuredRate`: tokens
(prompt + completion) over the seconds the microbatches took, which is per GPU, since one worker
holds one GPU. That is the unit of :mod:`core.calibration`, so planning compares it with the
pool's declared rates blended at the same share of completion tokens
(``service.planning.rate_pools``). No schema of its own: it reads ``adb_commits`` joined to
``adb_jobs``. The read is bounded by age (``since``) and by the ``limit`` newest commits per pool,
so its cost does not grow with the store's history; it runs once per plan and per ``capacity
list``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_deadline_batch.store.schema import commits, jobs

#: how far back earlier jobs' microbatches count (drivers, engines and pools change)
HISTORY_DAYS = 30.0
#: the newest committed microbatches read per pool and model
HISTORY_LIMIT = 500


@dataclass(frozen=True, kw_only=True)
class MeasuredRate:
    """Earlier jobs' committed microbatches of one model on one pool, summed."""

    pool: str
    commits: int = 0
    jobs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per GPU-second over all the microbatches (None: nothing measured)."""
        return self.tokens / self.busy_s if self.busy_s > 0 and self.tokens > 0 else None

    @property
    def completion_share(self) -> float | None:
        return self.completion_tokens / self.tokens if self.tokens else None

    def to_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "commits": self.commits,
            "jobs": self.jobs,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "busy_s": self.busy_s,
            "tokens_per_s": self.tokens_per_s,
        }


def model_key(engine: str | None, model: str | None) -> str:
    """How a model is named in rates: ``engine`` or ``engine:model``."""
    return f"{engine or '?'}:{model}" if model else (engine or "?")


def measured_rates(
    conn: Connection,
    pools: Sequence[str],
    *,
    engine: str,
    model: str | None,
    since: dt.datetime,
    exclude_job: str | None = None,
    limit: int = HISTORY_LIMIT,
) -> dict[str, MeasuredRate]:
    """Each named pool's committed microbatches of one model since ``since`` (the newest ``limit``)."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    model_col = jobs.c.config["model"].as_string()
    out: dict[str, MeasuredRate] = {}
    for pool in dict.fromkeys(pools):
        query = (
            sa.select(
                commits.c.job_id, commits.c.prompt_tokens, commits.c.completion_tokens, commits.c.elapsed_s
            )
            .select_from(commits.join(jobs, jobs.c.job_id == commits.c.job_id))
            .where(
                commits.c.pool == pool,
                commits.c.shard_index >= 0,  # -1 is the planner's validation errors: no work
                commits.c.elapsed_s > 0,
                commits.c.committed_at >= since,
                jobs.c.config["engine"].as_string() == engine,
                model_col.is_(None) if model is None else model_col == model,
            )
            .order_by(commits.c.committed_at.desc())
            .limit(limit)
        )
        if exclude_job is not None:
            query = query.where(commits.c.job_id != exclude_job)
        count = prompt = completion = 0
        busy = 0.0
        seen: set[str] = set()
        for job_id, p, c, elapsed in conn.execute(query):
            count += 1
            prompt += max(0, int(p))
            completion += max(0, int(c))
            busy += float(elapsed)
            seen.add(job_id)
        out[pool] = MeasuredRate(
            pool=pool,
            commits=count,
            jobs=len(seen),
            prompt_tokens=prompt,
            completion_tokens=completion,
            busy_s=busy,
        )
    return out


def models_seen(
    conn: Connection, pool: str, *, since: dt.datetime, limit: int = HISTORY_LIMIT
) -> list[tuple[str, str | None]]:
    """The (engine, model) pairs of the newest ``limit`` commits on ``pool`` since ``since``."""
    newest = (
        sa.select(commits.c.job_id)
        .where(commits.c.pool == pool, commits.c.shard_index >= 0, commits.c.committed_at >= since)
        .order_by(commits.c.committed_at.desc())
        .limit(limit)
        .subquery()
    )
    query = (
        sa.select(jobs.c.config["engine"].as_string(), jobs.c.config["model"].as_string())
        .where(jobs.c.job_id.in_(sa.select(newest.c.job_id)))
        .distinct()
    )
    return sorted(
        {(str(e), m) for e, m in conn.execute(query) if e is not None}, key=lambda em: (em[0], em[1] or "")
    )
