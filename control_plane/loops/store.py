"""How a batch from a durable stream is stored: one transaction with a savepoint per
message, each row inserted once by its unique message id. A message that does not
decode, or whose row the database refuses, is counted and marked poison (terminated,
never redelivered); it never rolls back the rest. A database that is unavailable (locked
past its busy timeout, the connection lost: `control_plane.db.session.unavailable`) refuses
no row: the batch fails whole and is redelivered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError

from control_plane.counters import Rejections
from control_plane.db.once import insert_once
from control_plane.db.session import begin_write, unavailable
from control_plane.loops.durable import Received, Verdicts
from fleet_base.wire import Rejected

T = TypeVar("T")


def store_batch(
    sessions: Any,
    batch: list[Received],
    rejections: Rejections,
    *,
    pattern: str,
    decode: Callable[[str, bytes], T],
    table: Any,
    key: str,
    values: Callable[[T, int], dict[str, Any]],
    refused: tuple[type[BaseException], ...],
    keep: Callable[[T], bool] = lambda _: True,
) -> Verdicts:
    """Decode each message, skip those `keep` passes over, insert the rest into `table`
    (`values(message, stream sequence)`, unique on `key`); `refused`: the errors of an
    insert that make its message poison."""
    poison: set[int] = set()
    with sessions() as session:
        begin_write(session)
        for i, m in enumerate(batch):
            try:
                item = decode(m.subject, m.data)
            except Rejected as err:
                rejections.reject(pattern, err.reason, m.subject, err.detail)
                poison.add(i)
                continue
            if not keep(item):
                continue
            try:
                with session.begin_nested():
                    insert_once(session, table, values(item, m.seq), key)
            except OperationalError as err:
                if unavailable(err):
                    raise
                rejections.reject(pattern, "database", m.subject, err)
                poison.add(i)
            except refused as err:
                rejections.reject(pattern, "database", m.subject, err)
                poison.add(i)
        session.commit()
    return Verdicts(poison)
