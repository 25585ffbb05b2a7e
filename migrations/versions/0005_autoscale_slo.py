"""deployment_versions.slo_ttft_s / slo_itl_s (the SLO-driven autoscaler's targets) and
deployments.variant_mix (its cheapest mix of GPU types, for the placer).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 10:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("deployment_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("slo_ttft_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("slo_itl_s", sa.Float(), nullable=True))
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("variant_mix", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_column("variant_mix")
    with op.batch_alter_table("deployment_versions", schema=None) as batch_op:
        batch_op.drop_column("slo_itl_s")
        batch_op.drop_column("slo_ttft_s")
