"""Launch reservations: a tenant's GPU quota counts the workers a runner is starting.

``adb_launch_reservations`` holds one row per worker a runner started (or is starting) under its
tenant's GPU quota, taken in the same serialized transaction as the quota check and counted until
the worker's claim is visible (its lease counts from then on) or the worker exits; a runner that
dies stops renewing its rows and they expire (docs/tenants.md, "Quotas and budgets"). The table
starts empty.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adb_launch_reservations",
        sa.Column("reservation_id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("pool", sa.String(128), nullable=False),
        sa.Column("runner", sa.String(64), nullable=False),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("reserved_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("reservation_id", name="pk_adb_launch_reservations"),
    )
    op.create_index("ix_adb_launch_reservations_tenant", "adb_launch_reservations", ["tenant"])


def downgrade() -> None:
    op.drop_index("ix_adb_launch_reservations_tenant", table_name="adb_launch_reservations")
    op.drop_table("adb_launch_reservations")
