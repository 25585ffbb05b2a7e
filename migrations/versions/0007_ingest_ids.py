"""usage_records.record_id and events.event_id: unique message ids, so a JetStream
redelivery of a usage record or an agent event is stored once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision, down_revision = "0007", "0006"


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
