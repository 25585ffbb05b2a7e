"""Cost accounting: api_keys.team, usage_records.ttft_s (prefill time), the replica ledger (replica_intervals: one row per
replica lifetime on a pool, its price copied at start) and team_budgets."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.batch import add_columns, create_indexes, drop_columns, drop_indexes, drop_table

revision, down_revision = "0011", "0010"

INTERVAL_INDEXES = ("replica_id", "deployment", "cluster", "started_at", "ended_at")


def upgrade() -> None:
    add_columns("api_keys", sa.Column("team", sa.String(63), nullable=True))
    create_indexes("api_keys", "team")
    add_columns("usage_records", sa.Column("ttft_s", sa.Float(), nullable=True))
    op.create_table(
        "replica_intervals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("replica_id", sa.String(63), nullable=False),
        sa.Column("deployment", sa.String(63), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("cluster", sa.String(63), nullable=False),
        sa.Column("pool", sa.String(63), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("hourly_price", sa.Float(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replica_intervals")),
    )
    create_indexes("replica_intervals", *INTERVAL_INDEXES)
    op.create_table(
        "team_budgets",
        sa.Column("team", sa.String(63), nullable=False),
        sa.Column("monthly_dollars", sa.Float(), nullable=False),
        sa.Column("thresholds", sa.JSON(), nullable=False),
        sa.Column("hard", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("alerted", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("team", name=op.f("pk_team_budgets")),
    )


def downgrade() -> None:
    op.drop_table("team_budgets")
    drop_table("replica_intervals", *reversed(INTERVAL_INDEXES))
    drop_columns("usage_records", "ttft_s")
    drop_indexes("api_keys", "team")
    drop_columns("api_keys", "team")
