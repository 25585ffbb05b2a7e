"""Shadow traffic: a rollout's shadow phase (rollouts.shadow_*), and the shadow fields of
usage records (a copy is stored as shadow usage, never charged to its key)."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, create_indexes, drop_columns, drop_indexes

revision, down_revision = "0010", "0009"


def upgrade() -> None:
    add_columns(
        "rollouts",
        sa.Column("shadow_share", sa.Float(), nullable=True),
        sa.Column("shadow_duration_s", sa.Float(), nullable=True),
        sa.Column("shadow_phase", sa.String(16), nullable=True),
        sa.Column("shadow_reason", sa.Text(), nullable=False, server_default=""),
        sa.Column("shadow_stats", sa.JSON(), nullable=True),
    )
    add_columns(
        "usage_records",
        sa.Column("shadow", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("shadow_of", sa.String(64), nullable=True),
        sa.Column("itl_s", sa.Float(), nullable=True),
        sa.Column("greedy_match", sa.Boolean(), nullable=True),
        sa.Column("first_diff_token", sa.Integer(), nullable=True),
    )
    create_indexes("usage_records", "shadow")


def downgrade() -> None:
    drop_indexes("usage_records", "shadow")
    drop_columns("usage_records", "first_diff_token", "greedy_match", "itl_s", "shadow_of", "shadow")
    drop_columns(
        "rollouts", "shadow_stats", "shadow_reason", "shadow_phase", "shadow_duration_s", "shadow_share"
    )
