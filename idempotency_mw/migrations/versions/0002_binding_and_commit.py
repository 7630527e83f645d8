"""Bind records to the caller's credentials, and mark effects committed by a fenced commit.

Revision ID: 0002_binding_and_commit
Revises: 0001_idempotency_records
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_binding_and_commit"
down_revision = "0001_idempotency_records"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, with no default: adding them rewrites no row, and rows from 0001 read as
    # unbound and not committed.
    with op.batch_alter_table("idempotency_records") as table:
        table.add_column(sa.Column("caller_binding", sa.String(64), nullable=True))
        table.add_column(sa.Column("committed_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # A record settled as committed without a response has no 0001 equivalent that never runs
    # again: not replayable is the closest (a retry is told so, and never runs).
    op.execute("UPDATE idempotency_records SET status = 'unreplayable' WHERE status = 'committed'")
    with op.batch_alter_table("idempotency_records") as table:
        table.drop_column("committed_at")
        table.drop_column("caller_binding")
