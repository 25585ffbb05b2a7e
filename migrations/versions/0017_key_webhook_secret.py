"""API keys: the version of the key's webhook signing secret (raised by a rotation; the
secret itself is derived, never stored)."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0017", "0016"


def upgrade() -> None:
    add_columns(
        "api_keys", sa.Column("webhook_secret_version", sa.Integer(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    drop_columns("api_keys", "webhook_secret_version")
