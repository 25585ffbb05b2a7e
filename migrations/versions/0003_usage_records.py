"""Usage records from gateways and each key's per-cluster shares of its budget."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0003", "0002"


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cluster", sa.String(length=63), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("latency_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
    )
    for column in ("at", "cluster", "key_id", "deployment"):
        op.create_index(op.f(f"ix_usage_records_{column}"), "usage_records", [column], unique=False)
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("shares", sa.JSON(), server_default="{}", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("shares")
    for column in ("deployment", "key_id", "cluster", "at"):
        op.drop_index(op.f(f"ix_usage_records_{column}"), table_name="usage_records")
    op.drop_table("usage_records")
