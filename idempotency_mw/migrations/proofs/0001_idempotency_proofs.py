"""Create the idempotency_proofs table: fence()'s proof, for a store on another database.

Revision ID: 0001_idempotency_proofs
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001_idempotency_proofs"
down_revision = None
branch_labels = ("idempotency_mw_proofs",)
depends_on = None

_text = sa.String(255).with_variant(mysql.VARCHAR(255, collation="utf8mb4_bin"), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "idempotency_proofs",
        sa.Column("scope", _text, nullable=False),
        sa.Column("key", _text, nullable=False),
        sa.Column("token", sa.String(32), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "key", name="pk_idempotency_proofs"),
    )
    op.create_index("ix_idempotency_proofs_expires_at", "idempotency_proofs", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_proofs_expires_at", table_name="idempotency_proofs")
    op.drop_table("idempotency_proofs")
