"""The tail race: one speculative attempt beside a shard's live lease (docs/internals.md, "Racing leases").

``adb_shards`` gains the racer's lease (``race_attempt_id``, ``race_epoch``, ``race_expires_at``,
``race_ttl_s``; all NULL when no racer), fenced like the primary lease by its own attempt ID and
epoch; ``adb_attempts.speculative`` marks the attempts started as racers (false for every
attempt recorded before this revision).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adb_shards") as batch:
        batch.add_column(sa.Column("race_attempt_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("race_epoch", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("race_expires_at", sa.Double(), nullable=True))
        batch.add_column(sa.Column("race_ttl_s", sa.Double(), nullable=True))
    with op.batch_alter_table("adb_attempts") as batch:
        batch.add_column(sa.Column("speculative", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("adb_attempts") as batch:
        batch.drop_column("speculative")
    with op.batch_alter_table("adb_shards") as batch:
        batch.drop_column("race_ttl_s")
        batch.drop_column("race_expires_at")
        batch.drop_column("race_epoch")
        batch.drop_column("race_attempt_id")
