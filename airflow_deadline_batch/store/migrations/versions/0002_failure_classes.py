"""Failure classes: the attempt's class, the shard's spent budget (docs/design.md §6.6).

``adb_attempts.failure_class`` records how a failed try was classified once (preempted, transient,
deterministic, configuration); ``adb_shards.failures`` counts the tries that spent the
``max_attempts`` budget (deterministic failures without a commit), which claims now compare
instead of every try.

Revision ID: 0002
Revises: 0001
Create Date: 2026-02-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adb_shards") as batch:
        batch.add_column(sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("adb_attempts") as batch:
        batch.add_column(sa.Column("failure_class", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adb_attempts") as batch:
        batch.drop_column("failure_class")
    with op.batch_alter_table("adb_shards") as batch:
        batch.drop_column("failures")
