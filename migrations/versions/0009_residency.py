"""Data residency: clusters.jurisdiction, deployments.residency, api_keys.residency, and
where each usage record was processed (usage_records.region, jurisdiction)."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0009", "0008"


def upgrade() -> None:
    add_columns("clusters", sa.Column("jurisdiction", sa.String(32), nullable=False, server_default=""))
    add_columns("deployments", sa.Column("residency", sa.JSON(), nullable=True))
    add_columns("api_keys", sa.Column("residency", sa.JSON(), nullable=True))
    add_columns(
        "usage_records",
        sa.Column("region", sa.String(64), nullable=False, server_default=""),
        sa.Column("jurisdiction", sa.String(64), nullable=False, server_default=""),
    )


def downgrade() -> None:
    drop_columns("usage_records", "jurisdiction", "region")
    drop_columns("api_keys", "residency")
    drop_columns("deployments", "residency")
    drop_columns("clusters", "jurisdiction")
