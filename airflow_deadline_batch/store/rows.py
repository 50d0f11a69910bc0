"""Frozen records the manifest store takes (``New*``) and returns (``*Row``, ``Lease``, ``Progress``)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_deadline_batch.core.clock import ensure_aware
from airflow_deadline_batch.core.ids import shard_id
from airflow_deadline_batch.core.states import AttemptOutcome, JobState, ShardState
from airflow_deadline_batch.core.tenants import DEFAULT_TENANT, check_tenant

#: the most GPUs a pool's ``capacity`` row holds (a 32-bit INTEGER column on PostgreSQL)
MAX_POOL_GPUS = 2**31 - 1
#: the longest pool name a ``capacity`` row holds (its VARCHAR(128) column, as the attempts' pool)
MAX_POOL_NAME = 128

#: defaults when a job's config omits them
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_LEASE_TTL_S = 60.0
#: the planner's validation-errors object is recorded as this commit
VALIDATION_SHARD_INDEX = -1
VALIDATION_ATTEMPT_ID = "plan"


def _mapping(row: Any) -> Mapping[str, Any]:
    """The column mapping of a SQLAlchemy ``Row`` (or ``row`` itself when it is a mapping already)."""
    mapping: Mapping[str, Any] = row._mapping if hasattr(row, "_mapping") else row
    return mapping


@dataclass(frozen=True, kw_only=True)
class NewJob:
    """A job to create; ``state`` is ``admitted``, or ``rejected`` to record a refusal with no shards."""

    deadline: dt.datetime
    input_uri: str
    input_sha256: str
    input_lines: int
    input_total_lines: int
    output_uri: str
    config: Mapping[str, Any]
    admission: Mapping[str, Any] | None = None
    job_id: str | None = None
    idempotency_key: str | None = None
    state: JobState = JobState.ADMITTED
    tenant: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadline", ensure_aware(self.deadline, "deadline"))
        object.__setattr__(self, "tenant", check_tenant(self.tenant))
        object.__setattr__(self, "state", JobState(self.state))
        if self.state not in (JobState.ADMITTED, JobState.REJECTED):
            raise ValueError(f"a new job starts admitted or rejected, not {self.state.value}")
        if self.input_lines < 0 or self.input_total_lines < self.input_lines:
            raise ValueError("input_lines must be >= 0 and <= input_total_lines")


@dataclass(frozen=True, kw_only=True)
class NewShard:
    """One contiguous byte range of the input, cut on line boundaries by the planner."""

    shard_index: int
    byte_start: int
    byte_end: int
    first_line: int
    line_count: int
    records: int
    num_microbatches: int
    input_sha256: str
    est_work_s: float = 0.0
    excluded_lines: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "excluded_lines", tuple(int(n) for n in self.excluded_lines))
        if self.shard_index < 0:
            raise ValueError(f"shard_index must be >= 0, got {self.shard_index}")
        if self.byte_end < self.byte_start or self.num_microbatches < 0 or self.records < 0:
            raise ValueError(f"shard {self.shard_index}: inconsistent byte range, records or microbatches")


@dataclass(frozen=True, kw_only=True)
class NewCommit:
    """A committed output object; used by ``create_job`` for the planner's validation errors."""

    uri: str
    sha256: str
    records: int
    counts: Mapping[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    model_digest: str | None = None
    pool: str | None = None


@dataclass(frozen=True, kw_only=True)
class JobRow:
    job_id: str
    idempotency_key: str | None
    state: JobState
    created_at: dt.datetime
    updated_at: dt.datetime
    deadline: dt.datetime
    input_uri: str
    input_sha256: str
    input_lines: int
    input_total_lines: int
    output_uri: str
    config: Mapping[str, Any]
    admission: Mapping[str, Any] | None
    manifest_uri: str | None
    manifest_sha256: str | None
    completed_at: dt.datetime | None
    error: str | None
    tenant: str = DEFAULT_TENANT

    @classmethod
    def from_row(cls, row: Any) -> JobRow:
        m = _mapping(row)
        return cls(
            job_id=m["job_id"],
            idempotency_key=m["idempotency_key"],
            state=JobState(m["state"]),
            created_at=m["created_at"],
            updated_at=m["updated_at"],
            deadline=m["deadline"],
            input_uri=m["input_uri"],
            input_sha256=m["input_sha256"],
            input_lines=m["input_lines"],
            input_total_lines=m["input_total_lines"],
            output_uri=m["output_uri"],
            config=m["config"] or {},
            admission=m["admission"],
            manifest_uri=m["manifest_uri"],
            manifest_sha256=m["manifest_sha256"],
            completed_at=m["completed_at"],
            error=m["error"],
            tenant=m["tenant"],
        )

    @property
    def max_attempts(self) -> int:
        return int(self.config.get("max_attempts") or DEFAULT_MAX_ATTEMPTS)

    @property
    def lease_ttl_s(self) -> float:
        return float(self.config.get("lease_ttl_s") or DEFAULT_LEASE_TTL_S)


@dataclass(frozen=True, kw_only=True)
class ShardRow:
    job_id: str
    shard_index: int
    state: ShardState
    epoch: int
    lease_attempt_id: str | None
    lease_expires_at: float | None
    lease_ttl_s: float | None
    attempts: int
    #: tries that spent the max_attempts budget (deterministic failures without a commit)
    failures: int = 0
    byte_start: int
    byte_end: int
    first_line: int
    line_count: int
    records: int
    excluded_lines: tuple[int, ...]
    input_sha256: str
    est_work_s: float
    num_microbatches: int
    cursor: int
    last_pool: str | None
    last_error: str | None
    updated_at: dt.datetime
    #: the tail race: the speculative attempt beside the lease's, its epoch and expiry (DB clock)
    race_attempt_id: str | None = None
    race_epoch: int | None = None
    race_expires_at: float | None = None

    @classmethod
    def from_row(cls, row: Any) -> ShardRow:
        m = _mapping(row)
        return cls(
            job_id=m["job_id"],
            shard_index=m["shard_index"],
            state=ShardState(m["state"]),
            epoch=m["epoch"],
            lease_attempt_id=m["lease_attempt_id"],
            lease_expires_at=m["lease_expires_at"],
            lease_ttl_s=m["lease_ttl_s"],
            attempts=m["attempts"],
            failures=m.get("failures") or 0,
            byte_start=m["byte_start"],
            byte_end=m["byte_end"],
            first_line=m["first_line"],
            line_count=m["line_count"],
            records=m["records"],
            excluded_lines=tuple(m["excluded_lines"] or ()),
            input_sha256=m["input_sha256"],
            est_work_s=m["est_work_s"],
            num_microbatches=m["num_microbatches"],
            cursor=m["cursor"],
            last_pool=m["last_pool"],
            last_error=m["last_error"],
            updated_at=m["updated_at"],
            race_attempt_id=m.get("race_attempt_id"),
            race_epoch=m.get("race_epoch"),
            race_expires_at=m.get("race_expires_at"),
        )

    @property
    def shard_id(self) -> str:
        return shard_id(self.shard_index)


@dataclass(frozen=True, kw_only=True)
class AttemptRow:
    attempt_id: str
    job_id: str
    shard_index: int
    epoch: int
    worker: str
    pool: str | None
    started_at: dt.datetime
    ended_at: dt.datetime | None
    outcome: AttemptOutcome
    error: str | None
    heartbeat_at: dt.datetime | None
    #: core.failures.FailureClass value of a failed try (None: running, succeeded, unclassified)
    failure_class: str | None = None
    #: a speculative duplicate of a running attempt (the tail race)
    speculative: bool = False

    @classmethod
    def from_row(cls, row: Any) -> AttemptRow:
        m = _mapping(row)
        return cls(
            attempt_id=m["attempt_id"],
            job_id=m["job_id"],
            shard_index=m["shard_index"],
            epoch=m["epoch"],
            worker=m["worker"],
            pool=m["pool"],
            started_at=m["started_at"],
            ended_at=m["ended_at"],
            outcome=AttemptOutcome(m["outcome"]),
            error=m["error"],
            heartbeat_at=m["heartbeat_at"],
            failure_class=m.get("failure_class"),
            speculative=bool(m.get("speculative") or False),
        )


@dataclass(frozen=True, kw_only=True)
class CommitRow:
    job_id: str
    shard_index: int
    seq: int
    attempt_id: str
    epoch: int
    uri: str
    sha256: str
    records: int
    counts: Mapping[str, int]
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    model_digest: str | None
    pool: str | None
    committed_at: dt.datetime

    @classmethod
    def from_row(cls, row: Any) -> CommitRow:
        m = _mapping(row)
        return cls(
            job_id=m["job_id"],
            shard_index=m["shard_index"],
            seq=m["seq"],
            attempt_id=m["attempt_id"],
            epoch=m["epoch"],
            uri=m["uri"],
            sha256=m["sha256"],
            records=m["records"],
            counts=m["counts"] or {},
            prompt_tokens=m["prompt_tokens"],
            completion_tokens=m["completion_tokens"],
            elapsed_s=m["elapsed_s"],
            model_digest=m["model_digest"],
            pool=m["pool"],
            committed_at=m["committed_at"],
        )

    @property
    def shard_id(self) -> str:
        return shard_id(self.shard_index)


@dataclass(frozen=True, kw_only=True)
class JobRows:
    """One job's shards, commits and attempts, ordered as ``list_shards``, ``list_commits`` and
    ``list_attempts`` return them (``ManifestStore.rows_of_jobs``)."""

    shards: tuple[ShardRow, ...] = ()
    commits: tuple[CommitRow, ...] = ()
    attempts: tuple[AttemptRow, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Lease:
    """Proof that one attempt holds a shard: every write is conditioned on (attempt_id, epoch).

    ``expires_at`` is float seconds since the Unix epoch on the DATABASE clock; compare it only with
    :meth:`ManifestStore.db_time`, never with the local clock.
    """

    job_id: str
    shard_index: int
    attempt_id: str
    epoch: int
    expires_at: float
    cursor: int
    num_microbatches: int

    @property
    def shard_id(self) -> str:
        return shard_id(self.shard_index)


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A job's progress counted from COMMITS only (docs/design.md §4.5 invariant 4), never from attempts."""

    job_id: str
    state: JobState
    deadline: dt.datetime
    total_records: int
    committed_records: int
    succeeded: int
    errored: int
    shards_total: int
    shards_by_state: Mapping[str, int]
    attempts: int
    #: the tries that were preemptions (:func:`core.states.is_preemption`: not the crashes)
    preemptions: int
    committed_work_s: float
    remaining_work_s: float
    updated_at: dt.datetime
    #: why the job stopped, when it did (e.g. the configuration error a worker met)
    error: str | None = None

    @property
    def fraction(self) -> float:
        return self.committed_records / self.total_records if self.total_records else 1.0


@dataclass(frozen=True, kw_only=True)
class UsageRow:
    """One attempt's settled usage (``adb_usage``): kept whether or not its output was."""

    attempt_id: str
    job_id: str
    tenant: str
    shard_index: int
    pool: str | None
    pool_kind: str | None
    price_per_gpu_hour: float
    outcome: str
    prompt_tokens: int
    completion_tokens: int
    committed_records: int
    #: records of output objects the attempt wrote but never committed (superseded or fenced)
    superseded_records: int
    gpu_seconds: float
    cost: float
    started_at: dt.datetime
    ended_at: dt.datetime | None
    settled_at: dt.datetime | None = None

    @classmethod
    def from_row(cls, row: Any) -> UsageRow:
        m = _mapping(row)
        return cls(**{name: m[name] for name in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for key in ("started_at", "ended_at", "settled_at"):
            data[key] = None if data[key] is None else data[key].isoformat()
        return data


@dataclass(frozen=True, kw_only=True)
class PoolCapacityRow:
    """GPUs of a pool that every tenant's jobs share (``deadline-batch capacity set``)."""

    pool: str
    gpus: int
    updated_at: dt.datetime | None = None

    def __post_init__(self) -> None:
        if not self.pool:
            raise ValueError("pool name must not be empty")
        if len(self.pool) > MAX_POOL_NAME:
            raise ValueError(f"pool name must be at most {MAX_POOL_NAME} characters, got {len(self.pool)}")
        if self.gpus < 0:
            raise ValueError(f"pool {self.pool!r}: gpus must be >= 0, got {self.gpus}")
        if self.gpus > MAX_POOL_GPUS:
            raise ValueError(f"pool {self.pool!r}: gpus must be <= {MAX_POOL_GPUS}, got {self.gpus}")

    @classmethod
    def from_row(cls, row: Any) -> PoolCapacityRow:
        m = _mapping(row)
        return cls(pool=m["pool"], gpus=m["gpus"], updated_at=m["updated_at"])


@dataclass(frozen=True, kw_only=True)
class TenantQuotaRow:
    """A tenant's limits (``deadline-batch quota set``); None is no limit."""

    tenant: str
    spot_gpus: int | None = None
    on_demand_gpus: int | None = None
    budget: float | None = None
    budget_period_s: float | None = None
    updated_at: dt.datetime | None = None
    #: the tenant's weight in fair shares of managed pools (core.dispatch)
    weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant", check_tenant(self.tenant))
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"tenant {self.tenant}: weight must be a finite number > 0, got {self.weight}")
        for name in ("spot_gpus", "on_demand_gpus", "budget"):
            value = getattr(self, name)
            # `not value >= 0` also refuses NaN, which every comparison would otherwise let through
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"tenant {self.tenant}: {name} must be a finite number >= 0, got {value}")
            if name != "budget" and value is not None and value > MAX_POOL_GPUS:  # a 32-bit column
                raise ValueError(f"tenant {self.tenant}: {name} must be <= {MAX_POOL_GPUS}, got {value}")
        if self.budget is not None and not (self.budget_period_s or 0) > 0:
            raise ValueError(f"tenant {self.tenant}: a budget needs a period (budget_period_s > 0)")

    @classmethod
    def from_row(cls, row: Any) -> TenantQuotaRow:
        m = _mapping(row)
        return cls(**{name: m[name] for name in cls.__dataclass_fields__})

    def gpus_of_kind(self, kind: str) -> int | None:
        """The GPU limit for pools of ``kind`` (``spot`` / ``on_demand``), None when unlimited."""
        return self.spot_gpus if kind == "spot" else self.on_demand_gpus


@dataclass(frozen=True, kw_only=True)
class DispatchRow:
    """A shard waiting for (``granted_at`` None) or holding a slot of a managed pool (store/dispatch.py)."""

    job_id: str
    shard_index: int
    tenant: str
    pool: str
    #: database-clock epoch seconds
    latest_start: float
    requested_at: float
    expires_at: float
    granted_at: float | None = None
    grant_seq: int | None = None
    #: the run that posted the row (None: the caller named none)
    runner: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> DispatchRow:
        m = _mapping(row)
        return cls(**{name: m[name] for name in cls.__dataclass_fields__})

    @property
    def granted(self) -> bool:
        return self.granted_at is not None


@dataclass(frozen=True, kw_only=True)
class DispatchGrantRow:
    """One grant in the audit record: who got a slot, why, and the state the rule decided on.

    ``state["tenants"]`` maps each tenant that held or waited for a slot to its ``held`` slots,
    ``share``, ``weight``, ``waiting`` requests and ``best`` waiting request
    (``[latest_start, requested_at, job_id, shard_index]``) just before the grant.
    """

    seq: int
    pool: str
    tenant: str
    job_id: str
    shard_index: int
    latest_start: float
    requested_at: float
    granted_at: float
    reason: str
    slots: int
    state: Mapping[str, Any]
    released_at: float | None = None
    #: how the slot came back: ``released`` (the worker ended), ``withdrawn``, ``expired``
    release: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> DispatchGrantRow:
        m = _mapping(row)
        return cls(**{name: m[name] for name in cls.__dataclass_fields__})
