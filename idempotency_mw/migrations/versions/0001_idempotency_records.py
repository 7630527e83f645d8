"""Create the idempotency_records table.

Revision ID: 0001_idempotency_records
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001_idempotency_records"
down_revision = None
branch_labels = ("idempotency_mw",)
depends_on = None

_text = sa.String(255).with_variant(mysql.VARCHAR(255, collation="utf8mb4_bin"), "mysql", "mariadb")
_bytes = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "idempotency_records",
        sa.Column("scope", _text, nullable=False),
        sa.Column("key", _text, nullable=False),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("token", sa.String(32), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("response_headers", _bytes, nullable=True),
        sa.Column("result_payload", _bytes, nullable=True),
        sa.Column("caller_binding", sa.String(64), nullable=False),
        sa.Column("committed_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("scope", "key", name="pk_idempotency_records"),
    )
    op.create_index("ix_idempotency_records_expires_at", "idempotency_records", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_records_expires_at", table_name="idempotency_records")
    op.drop_table("idempotency_records")
