"""Autoscaler memory: autoscaler_states (each autoscaled deployment's windows, burst memory
and cycles as the leader last stored them, so a new leader resumes from them)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0014", "0013"


def upgrade() -> None:
    op.create_table(
        "autoscaler_states",
        sa.Column("deployment_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("policy", sa.String(32), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("cycles", sa.Text(), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("saved_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_autoscaler_states_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("deployment_id", name=op.f("pk_autoscaler_states")),
    )


def downgrade() -> None:
    op.drop_table("autoscaler_states")
