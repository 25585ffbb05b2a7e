"""Usage records: one index on (deployment, at), for the reads that take one deployment's
records over a time range (the autoscaler's demand history at takeover, usage by
deployment): with an index per column the database scans every record of a busy
deployment's days to keep the range."""

from __future__ import annotations

from alembic import op

revision, down_revision = "0021", "0020"

NAME = "ix_usage_records_deployment_at"


def upgrade() -> None:
    op.create_index(NAME, "usage_records", ["deployment", "at"])


def downgrade() -> None:
    op.drop_index(NAME, table_name="usage_records")
