"""`insert_once`: INSERT ... ON CONFLICT (key) DO NOTHING on SQLite and PostgreSQL, so a
message stored twice (a redelivery after a commit whose ack was lost) is one row."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


def insert_once(session: Session, model: type, values: dict[str, Any], key: str) -> bool:
    """Insert a row unless one with the same `key` column exists; True when inserted."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(model).values(**values).on_conflict_do_nothing(index_elements=[key])
    return bool(session.execute(stmt).rowcount)
