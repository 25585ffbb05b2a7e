"""Per-request plumbing shared by the routers: a database session, the caller, paging,
and waking the control loops after a write."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from sqlalchemy import Select, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane.api.auth import Principal, authenticate
from control_plane.context import ControlPlaneContext

MAX_LIMIT = 1000


def get_ctx(request: Request) -> ControlPlaneContext:
    return request.app.state.ctx


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.ctx.sessions() as session:
        yield session


def kick(request: Request) -> None:
    """Wake the control loops. Routes run in the threadpool and asyncio.Event is not
    thread-safe, so the set happens on the event loop."""
    ctx: ControlPlaneContext = request.app.state.ctx
    loop = getattr(request.app.state, "loop", None)
    if loop is not None and loop.is_running():
        loop.call_soon_threadsafe(ctx.kick)
    else:
        ctx.kick()


@dataclass(frozen=True)
class Paging:
    limit: int
    offset: int

    def apply(self, session: Session, query: Select) -> tuple[list, int]:
        total = session.scalar(select(func.count()).select_from(query.order_by(None).subquery())) or 0
        rows = list(session.scalars(query.limit(self.limit).offset(self.offset)))
        return rows, total


def insert(session: Session, row: object, taken: Exception) -> None:
    """Add `row` and flush it; a unique key a concurrent writer took first raises `taken`
    (a 409) instead of a database error."""
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise taken from None


def where_equal(query: Select, *conditions: tuple[Any, object | None]) -> Select:
    """`query` narrowed to rows whose column equals each (column, value) given; a None
    value is a filter the caller left out."""
    for column, value in conditions:
        if value is not None:
            query = query.where(column == value)
    return query


def paging(
    limit: int = Query(100, ge=1, le=MAX_LIMIT, description="page size"),
    offset: int = Query(0, ge=0, le=10**9, description="items to skip"),
) -> Paging:
    return Paging(limit, offset)


def as_utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


SessionDep = Annotated[Session, Depends(get_session)]
PrincipalDep = Annotated[Principal, Depends(authenticate)]
PagingDep = Annotated[Paging, Depends(paging)]
