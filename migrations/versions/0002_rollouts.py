"""Rollouts: the persisted state of canary rollouts (one row per rollout)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.batch import create_indexes, drop_table

revision, down_revision = "0002", "0001"


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
    create_indexes("rollouts", "deployment_id", "phase")


def downgrade() -> None:
    drop_table("rollouts", "phase", "deployment_id")
