"""Control-plane HA: control_plane_lease (one leader lease per name, its holder, fencing
epoch and change version) and control_plane_members (every process, heartbeating)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.batch import create_indexes, drop_table

revision, down_revision = "0013", "0012"

MEMBER_INDEXES = ("last_seen",)


def upgrade() -> None:
    op.create_table(
        "control_plane_lease",
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("lease_s", sa.Float(), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_control_plane_lease")),
    )
    op.create_table(
        "control_plane_members",
        sa.Column("id", sa.String(200), nullable=False),
        sa.Column("url", sa.String(500), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_control_plane_members")),
    )
    create_indexes("control_plane_members", *MEMBER_INDEXES)


def downgrade() -> None:
    drop_table("control_plane_members", *reversed(MEMBER_INDEXES))
    drop_table("control_plane_lease")
