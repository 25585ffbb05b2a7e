"""deployments.adapters, max_adapters (multi-LoRA catalog); usage_records.adapter."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0008", "0007"


def upgrade() -> None:
    add_columns(
        "deployments",
        sa.Column("adapters", sa.JSON(), nullable=False, server_default="[]"),
        sa.Column("max_adapters", sa.Integer(), nullable=False, server_default="0"),
    )
    add_columns("usage_records", sa.Column("adapter", sa.String(63), nullable=True))


def downgrade() -> None:
    drop_columns("usage_records", "adapter")
    drop_columns("deployments", "max_adapters", "adapters")
