"""Fair, least-slack-first dispatch of managed pools' GPUs (docs/tenants.md, "Dispatch").

``adb_tenant_quotas.weight`` is a tenant's weight in the fair shares of a managed pool (1 for
every quota recorded before this revision). ``adb_dispatch`` holds one row per shard that waits
for, or holds, a slot of a pool with a ``capacity`` row; ``adb_dispatch_grants`` is the
append-only record of every grant and the state it was decided on. Both start empty, and a
store without ``capacity`` rows never writes them. Two indexes serve the history that planning
and placement read from earlier jobs: ``adb_commits (pool, committed_at)`` (measured rates) and
``adb_attempts (pool, ended_at)`` (Spot tries).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("adb_tenant_quotas") as batch:
        batch.add_column(sa.Column("weight", sa.Double(), nullable=False, server_default="1"))
    op.create_table(
        "adb_dispatch",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("pool", sa.String(128), nullable=False),
        sa.Column("latest_start", sa.Double(), nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("granted_at", sa.Double(), nullable=True),
        sa.Column("grant_seq", sa.Integer(), nullable=True),
        sa.Column("runner", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("job_id", "shard_index", name="pk_adb_dispatch"),
    )
    op.create_index("ix_adb_dispatch_pool", "adb_dispatch", ["pool"])
    op.create_table(
        "adb_dispatch_grants",
        sa.Column("seq", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("pool", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("shard_index", sa.Integer(), nullable=False),
        sa.Column("latest_start", sa.Double(), nullable=False),
        sa.Column("requested_at", sa.Double(), nullable=False),
        sa.Column("granted_at", sa.Double(), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("state", _JSON, nullable=False),
        sa.Column("released_at", sa.Double(), nullable=True),
        sa.Column("release", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("seq", name="pk_adb_dispatch_grants"),
    )
    op.create_index("ix_adb_dispatch_grants_job_id", "adb_dispatch_grants", ["job_id"])
    op.create_index("ix_adb_commits_pool_committed_at", "adb_commits", ["pool", "committed_at"])
    op.create_index("ix_adb_attempts_pool_ended_at", "adb_attempts", ["pool", "ended_at"])


def downgrade() -> None:
    op.drop_index("ix_adb_attempts_pool_ended_at", table_name="adb_attempts")
    op.drop_index("ix_adb_commits_pool_committed_at", table_name="adb_commits")
    op.drop_index("ix_adb_dispatch_grants_job_id", table_name="adb_dispatch_grants")
    op.drop_table("adb_dispatch_grants")
    op.drop_index("ix_adb_dispatch_pool", table_name="adb_dispatch")
    op.drop_table("adb_dispatch")
    with op.batch_alter_table("adb_tenant_quotas") as batch:
        batch.drop_column("weight")
