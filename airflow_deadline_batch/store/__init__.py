"""The manifest store: durable jobs, shards, attempts, leases and fenced commits (SQLite or PostgreSQL)."""

from __future__ import annotations

from airflow_deadline_batch.store.leases import ACTIVE_JOB_STATES
from airflow_deadline_batch.store.manifest_store import ManifestStore
from airflow_deadline_batch.store.rows import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_ATTEMPTS,
    VALIDATION_ATTEMPT_ID,
    VALIDATION_SHARD_INDEX,
    AttemptRow,
    CommitRow,
    DispatchGrantRow,
    DispatchRow,
    JobRow,
    JobRows,
    Lease,
    NewCommit,
    NewJob,
    NewShard,
    PoolCapacityRow,
    Progress,
    ShardRow,
    TenantQuotaRow,
    UsageRow,
)
from airflow_deadline_batch.store.schema import db_epoch

__all__ = [
    "ACTIVE_JOB_STATES",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_MAX_ATTEMPTS",
    "VALIDATION_ATTEMPT_ID",
    "VALIDATION_SHARD_INDEX",
    "AttemptRow",
    "CommitRow",
    "DispatchGrantRow",
    "DispatchRow",
    "JobRow",
    "JobRows",
    "Lease",
    "ManifestStore",
    "NewCommit",
    "NewJob",
    "NewShard",
    "PoolCapacityRow",
    "Progress",
    "ShardRow",
    "TenantQuotaRow",
    "UsageRow",
    "db_epoch",
]
