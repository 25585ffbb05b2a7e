"""The batch ALTERs the revisions share (SQLite needs batch mode to alter a table).

A released revision must keep producing the same schema, so these helpers never change
what they emit: a different shape of change is a new helper. Imported as `migrations.batch`
(alembic.ini puts the repository root on sys.path).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def add_columns(table: str, *columns: sa.Column) -> None:
    with op.batch_alter_table(table, schema=None) as batch_op:
        for column in columns:
            batch_op.add_column(column)


def drop_columns(table: str, *names: str) -> None:
    """Drops `names` in the order given (the reverse of their `add_columns`)."""
    with op.batch_alter_table(table, schema=None) as batch_op:
        for name in names:
            batch_op.drop_column(name)


def create_indexes(table: str, *columns: str, unique: bool = False) -> None:
    """One index `ix_<table>_<column>` per column."""
    with op.batch_alter_table(table, schema=None) as batch_op:
        for column in columns:
            batch_op.create_index(batch_op.f(f"ix_{table}_{column}"), [column], unique=unique)


def drop_table(table: str, *indexed: str) -> None:
    """Drops the indexes on `indexed` (in the order given), then the table."""
    if indexed:
        with op.batch_alter_table(table, schema=None) as batch_op:
            for column in indexed:
                batch_op.drop_index(batch_op.f(f"ix_{table}_{column}"))
    op.drop_table(table)


def drop_indexes(table: str, *columns: str) -> None:
    """Drops the indexes `create_indexes` made on `columns` (in the order given)."""
    with op.batch_alter_table(table, schema=None) as batch_op:
        for column in columns:
            batch_op.drop_index(batch_op.f(f"ix_{table}_{column}"))


def set_nullable(table: str, column: str, type_: sa.types.TypeEngine, nullable: bool) -> None:
    """Allow (or forbid) NULL in one existing column of type `type_`."""
    with op.batch_alter_table(table, schema=None) as batch_op:
        batch_op.alter_column(column, existing_type=type_, nullable=nullable)
