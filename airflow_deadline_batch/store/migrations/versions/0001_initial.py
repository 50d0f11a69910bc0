"""Initial manifest store schema: jobs, shards, attempts, commits.

Revision ID: 0001
Revises:
Create Date: 2026-01-01
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _ts(name: str, nullable: bool) -> sa.Column[dt.datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "adb_jobs",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("state", sa.String(32), nullable=False),
        _ts("created_at", False),
        _ts("updated_at", False),
        _ts("deadline", False),
        sa.Column("input_uri", sa.Text(), nullable=False),
        sa.Column("input_sha256", sa.String(64), nullable=False),
        sa.Column("input_lines", sa.Integer(), nullable=False),
        sa.Column("input_total_lines", sa.Integer(), nullable=False),
        sa.Column("output_uri", sa.Text(), nullable=False),
        sa.Column("config", _JSON, nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("admission", _JSON, nullable=True),
        sa.Column("manifest_uri", sa.Text(), nullable=True),
        sa.Column("manifest_sha256", sa.String(64), nullable=True),
        _ts("completed_at", True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("job_id", name="pk_adb_jobs"),
        sa.UniqueConstraint("idempotency_key", name="uq_adb_jobs_idempotency_key"),
    )
    op.create_table(
        "adb_shards",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("lease_attempt_id", sa.String(64), nullable=True),
        sa.Column("lease_expires_at", sa.Double(), nullable=True),
        sa.Column("lease_ttl_s", sa.Double(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("byte_start", sa.BigInteger(), nullable=False),
        sa.Column("byte_end", sa.BigInteger(), nullable=False),
        sa.Column("first_line", sa.Integer(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("excluded_lines", _JSON, nullable=False),
        sa.Column("input_sha256", sa.String(64), nullable=False),
        sa.Column("est_work_s", sa.Double(), nullable=False),
        sa.Column("num_microbatches", sa.Integer(), nullable=False),
        sa.Column("cursor", sa.Integer(), nullable=False),
        sa.Column("last_pool", sa.String(128), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        _ts("updated_at", False),
        sa.PrimaryKeyConstraint("job_id", "shard_index", name="pk_adb_shards"),
        sa.ForeignKeyConstraint(
            ["job_id"], ["adb_jobs.job_id"], name="fk_adb_shards_job_id_adb_jobs", ondelete="CASCADE"
        ),
    )
    op.create_table(
        "adb_attempts",
        sa.Column("attempt_id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(255), nullable=False),
        sa.Column("pool", sa.String(128), nullable=True),
        _ts("started_at", False),
        _ts("ended_at", True),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        _ts("heartbeat_at", True),
        sa.PrimaryKeyConstraint("attempt_id", name="pk_adb_attempts"),
        sa.ForeignKeyConstraint(
            ["job_id", "shard_index"],
            ["adb_shards.job_id", "adb_shards.shard_index"],
            name="fk_adb_attempts_job_id_adb_shards",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_adb_attempts_job_id_shard_index", "adb_attempts", ["job_id", "shard_index"])
    op.create_table(
        "adb_commits",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("seq", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("attempt_id", sa.String(64), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("counts", _JSON, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("elapsed_s", sa.Double(), nullable=False),
        sa.Column("model_digest", sa.String(128), nullable=True),
        sa.Column("pool", sa.String(128), nullable=True),
        _ts("committed_at", False),
        sa.PrimaryKeyConstraint("job_id", "shard_index", "seq", name="pk_adb_commits"),
    )


def downgrade() -> None:
    op.drop_table("adb_commits")
    op.drop_index("ix_adb_attempts_job_id_shard_index", table_name="adb_attempts")
    op.drop_table("adb_attempts")
    op.drop_table("adb_shards")
    op.drop_table("adb_jobs")
