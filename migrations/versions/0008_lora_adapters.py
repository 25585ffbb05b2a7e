"""deployments.adapters, max_adapters (multi-LoRA catalog); usage_records.adapter.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 13:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("adapters", sa.JSON(), nullable=False, server_default="[]"))
        batch_op.add_column(sa.Column("max_adapters", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("adapter", sa.String(63), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_column("adapter")
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_column("max_adapters")
        batch_op.drop_column("adapters")
