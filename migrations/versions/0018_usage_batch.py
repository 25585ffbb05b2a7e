"""Usage records of batch and async work: `batch` marks a record booked for a batch line or
an async request (charged to the key as any request; listed apart in usage)."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, drop_columns

revision, down_revision = "0018", "0017"


def upgrade() -> None:
    add_columns("usage_records", sa.Column("batch", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    drop_columns("usage_records", "batch")
