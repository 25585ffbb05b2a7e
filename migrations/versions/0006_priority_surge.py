"""deployments.priority, max_surge, max_unavailable: placement class and rollout surge budget."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0006", "0005"


def upgrade() -> None:
    add_columns(
        "deployments",
        sa.Column("priority", sa.String(16), nullable=False, server_default="standard"),
        sa.Column("max_surge", sa.String(16), nullable=False, server_default="25%"),
        sa.Column("max_unavailable", sa.String(16), nullable=False, server_default="25%"),
    )


def downgrade() -> None:
    drop_columns("deployments", "max_unavailable", "max_surge", "priority")
