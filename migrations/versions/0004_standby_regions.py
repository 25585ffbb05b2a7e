"""deployment_versions.standby_regions: warm standby regions (active-passive)."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0004", "0003"


def upgrade() -> None:
    add_columns(
        "deployment_versions", sa.Column("standby_regions", sa.JSON(), nullable=False, server_default="[]")
    )


def downgrade() -> None:
    drop_columns("deployment_versions", "standby_regions")
