"""Usage records of pipeline hops: the pipeline, the step and the pipeline request a record
belongs to (so where each hop of a pipeline request ran can be read back)."""

from __future__ import annotations

import sqlalchemy as sa

from migrations.batch import add_columns, create_indexes, drop_columns, drop_indexes

revision, down_revision = "0016", "0015"


def upgrade() -> None:
    add_columns(
        "usage_records",
        sa.Column("pipeline", sa.String(63), nullable=True),
        sa.Column("pipeline_step", sa.String(63), nullable=True),
        sa.Column("pipeline_request", sa.String(128), nullable=True),
    )
    create_indexes("usage_records", "pipeline", "pipeline_request")


def downgrade() -> None:
    drop_indexes("usage_records", "pipeline_request", "pipeline")
    drop_columns("usage_records", "pipeline_request", "pipeline_step", "pipeline")
