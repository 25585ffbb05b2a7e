"""deployment_versions.slo_ttft_s / slo_itl_s (the SLO-driven autoscaler's targets) and
deployments.variant_mix (its cheapest mix of GPU types, for the placer).
"""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0005", "0004"


def upgrade() -> None:
    add_columns(
        "deployment_versions",
        sa.Column("slo_ttft_s", sa.Float(), nullable=True),
        sa.Column("slo_itl_s", sa.Float(), nullable=True),
    )
    add_columns("deployments", sa.Column("variant_mix", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    drop_columns("deployments", "variant_mix")
    drop_columns("deployment_versions", "slo_itl_s", "slo_ttft_s")
