"""Rollouts: the persisted state of canary rollouts (one row per rollout).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 18:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("baseline_version", sa.Integer(), nullable=False),
        sa.Column("canary_version", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("phase_started_at", sa.Float(), nullable=False),
        sa.Column("window_started_at", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("last", sa.JSON(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_rollouts_deployment_id_deployments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
    )
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollouts_deployment_id"), ["deployment_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_rollouts_phase"), ["phase"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollouts_phase"))
        batch_op.drop_index(batch_op.f("ix_rollouts_deployment_id"))
    op.drop_table("rollouts")
