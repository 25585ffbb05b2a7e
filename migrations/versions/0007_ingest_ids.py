"""usage_records.record_id and events.event_id: unique message ids, so a JetStream
redelivery of a usage record or an agent event is stored once.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 10:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("record_id", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint("uq_usage_records_record_id", ["record_id"])
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("event_id", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint("uq_events_event_id", ["event_id"])


def downgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_constraint("uq_events_event_id", type_="unique")
        batch_op.drop_column("event_id")
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_constraint("uq_usage_records_record_id", type_="unique")
        batch_op.drop_column("record_id")
