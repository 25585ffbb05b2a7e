"""deployments.priority, max_surge, max_unavailable: placement class and rollout surge budget.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 11:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("priority", sa.String(16), nullable=False, server_default="standard"))
        batch_op.add_column(sa.Column("max_surge", sa.String(16), nullable=False, server_default="25%"))
        batch_op.add_column(sa.Column("max_unavailable", sa.String(16), nullable=False, server_default="25%"))


def downgrade() -> None:
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_column("max_unavailable")
        batch_op.drop_column("max_surge")
        batch_op.drop_column("priority")
