"""Deleting old rows in bounded batches: each batch is its own short transaction, so
pruning a large backlog never holds a long lock nor one huge transaction (on PostgreSQL a
long delete would block the loops' writes; on SQLite, every writer)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

DEFAULT_BATCH = 5_000


def prune_before(
    sessions: Callable[[], Session],
    model: type,
    before: datetime,
    *,
    column: str = "at",
    batch: int = DEFAULT_BATCH,
) -> int:
    """Delete every row of `model` whose `column` is earlier than `before`, at most
    `batch` rows per transaction; the number deleted. The table's primary key is `id`."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    stamp, key = getattr(model, column), model.id
    total = 0
    while True:
        with sessions() as session:
            ids = select(key).where(stamp < before).order_by(key).limit(batch).scalar_subquery()
            n = int(session.execute(delete(model).where(key.in_(ids))).rowcount or 0)
            session.commit()
        total += n
        if n < batch:
            return total


__all__ = ["DEFAULT_BATCH", "prune_before"]
