"""Deployment versions: `engine`, the server that runs the version's replicas (fleet, vllm,
sglang, llama.cpp); existing versions run Fleet's own engine."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0019", "0018"


def upgrade() -> None:
    add_columns(
        "deployment_versions",
        sa.Column("engine", sa.String(length=16), nullable=False, server_default="fleet"),
    )


def downgrade() -> None:
    drop_columns("deployment_versions", "engine")
