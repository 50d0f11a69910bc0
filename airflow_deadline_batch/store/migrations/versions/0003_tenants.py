"""Tenants, the usage ledger, pool capacity and tenant quotas (docs/tenants.md).

``adb_jobs.tenant`` names the team a job belongs to; jobs recorded before this revision belong to
``default``. ``adb_usage`` is the settled usage of every attempt (one row per attempt, written once
by the finalizer). ``adb_pool_capacity`` and ``adb_tenant_quotas`` hold what the
``deadline-batch capacity`` and ``deadline-batch quota`` commands set; both start empty, and
empty means admission behaves as before (each job judged alone).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool) -> sa.Column[dt.datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("adb_jobs") as batch:
        batch.add_column(sa.Column("tenant", sa.String(63), nullable=False, server_default="default"))
    op.create_index("ix_adb_jobs_tenant_created_at", "adb_jobs", ["tenant", "created_at"])
    op.create_table(
        "adb_usage",
        sa.Column("attempt_id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("pool", sa.String(128), nullable=True),
        sa.Column("pool_kind", sa.String(32), nullable=True),
        sa.Column("price_per_gpu_hour", sa.Double(), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("committed_records", sa.Integer(), nullable=False),
        sa.Column("superseded_records", sa.Integer(), nullable=False),
        sa.Column("gpu_seconds", sa.Double(), nullable=False),
        sa.Column("cost", sa.Double(), nullable=False),
        _ts("started_at", False),
        _ts("ended_at", True),
        _ts("settled_at", False),
        sa.PrimaryKeyConstraint("attempt_id", name="pk_adb_usage"),
    )
    op.create_index("ix_adb_usage_job_id", "adb_usage", ["job_id"])
    op.create_index("ix_adb_usage_tenant_started_at", "adb_usage", ["tenant", "started_at"])
    op.create_table(
        "adb_pool_capacity",
        sa.Column("pool", sa.String(128), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        _ts("updated_at", False),
        sa.PrimaryKeyConstraint("pool", name="pk_adb_pool_capacity"),
    )
    op.create_table(
        "adb_tenant_quotas",
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("spot_gpus", sa.Integer(), nullable=True),
        sa.Column("on_demand_gpus", sa.Integer(), nullable=True),
        sa.Column("budget", sa.Double(), nullable=True),
        sa.Column("budget_period_s", sa.Double(), nullable=True),
        _ts("updated_at", False),
        sa.PrimaryKeyConstraint("tenant", name="pk_adb_tenant_quotas"),
    )


def downgrade() -> None:
    op.drop_table("adb_tenant_quotas")
    op.drop_table("adb_pool_capacity")
    op.drop_index("ix_adb_usage_tenant_started_at", table_name="adb_usage")
    op.drop_index("ix_adb_usage_job_id", table_name="adb_usage")
    op.drop_table("adb_usage")
    op.drop_index("ix_adb_jobs_tenant_created_at", table_name="adb_jobs")
    with op.batch_alter_table("adb_jobs") as batch:
        batch.drop_column("tenant")
