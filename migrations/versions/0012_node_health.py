"""Node health: nodes (each node's state as its agent reports it, and the operator's latest
cordon or uncordon) and node_faults (every fault observed, stored once by fault_id)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations.batch import create_indexes, drop_table

revision, down_revision = "0012", "0011"

NODE_INDEXES = ("cluster", "state")
FAULT_INDEXES = ("cluster", "node", "kind", "at")


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("cluster", sa.String(63), nullable=False),
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("gpus_withheld", sa.JSON(), nullable=False),
        sa.Column("cordoned_by", sa.String(16), nullable=False),
        sa.Column("faults", sa.Integer(), nullable=False),
        sa.Column("nvml", sa.Text(), nullable=False),
        sa.Column("pool", sa.String(63), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("action", sa.String(16), nullable=True),
        sa.Column("action_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("action_reason", sa.Text(), nullable=False),
        sa.Column("action_by", sa.String(200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("cluster", "node", name="uq_nodes_cluster_node"),
    )
    create_indexes("nodes", *NODE_INDEXES)
    op.create_table(
        "node_faults",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("fault_id", sa.String(64), nullable=False),
        sa.Column("cluster", sa.String(63), nullable=False),
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("replica_id", sa.String(128), nullable=True),
        sa.Column("deployment", sa.String(128), nullable=True),
        sa.Column("pool", sa.String(63), nullable=False),
        sa.Column("provider", sa.String(63), nullable=False),
        sa.Column("node_fault", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_faults")),
        sa.UniqueConstraint("fault_id", name="uq_node_faults_fault_id"),
    )
    create_indexes("node_faults", *FAULT_INDEXES)


def downgrade() -> None:
    drop_table("node_faults", *reversed(FAULT_INDEXES))
    drop_table("nodes", *reversed(NODE_INDEXES))
