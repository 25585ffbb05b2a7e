"""Pipelines: pipelines (deployments that serve one request together, placed in the same
clusters: the steps in call order as JSON [{name, deployment}], the end-to-end budget)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.batch import create_indexes, drop_table

revision, down_revision = "0015", "0014"


def upgrade() -> None:
    op.create_table(
        "pipelines",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("slo_e2e_s", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pipelines")),
    )
    create_indexes("pipelines", "name", unique=True)


def downgrade() -> None:
    drop_table("pipelines", "name")
