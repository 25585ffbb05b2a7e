"""What happened (events from agents, loops and API writes) and who changed what (audit)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.api.deps import Paging, PagingDep, PrincipalDep, SessionDep, as_utc, where_equal
from control_plane.api.errors import invalid
from control_plane.api.schemas import AuditOut, EventOut, Page
from control_plane.api.views import audit_out, event_out
from control_plane.db.models import AuditRecord, Event

router = APIRouter(tags=["events"])

SINCE = Query(None, description="ISO 8601 time or Unix seconds; only newer records")


def _since(value: datetime | float | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        try:
            return datetime.fromtimestamp(value, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            raise invalid("since", f"{value} is not a valid Unix time") from None
    return as_utc(value)


def _newest_first(
    session: Session,
    page: Paging,
    model: type[Event] | type[AuditRecord],
    out: Callable[[Any], BaseModel],
    since: datetime | float | None,
    **equal: str | None,
) -> Page:
    """One page of `model` rows, newest first: those whose columns equal the given filters
    (None: any) and newer than `since`."""
    query = where_equal(
        select(model).order_by(model.id.desc()), *((getattr(model, c), v) for c, v in equal.items())
    )
    if (after := _since(since)) is not None:
        query = query.where(model.at > after)
    rows, total = page.apply(session, query)
    return Page(items=[out(r) for r in rows], total=total, limit=page.limit, offset=page.offset)


@router.get("/v1/events", response_model=Page[EventOut])
def list_events(
    session: SessionDep,
    who: PrincipalDep,
    page: PagingDep,
    deployment: str | None = Query(None, max_length=63),
    cluster: str | None = Query(None, max_length=63),
    kind: str | None = Query(None, max_length=32),
    since: float | datetime | None = SINCE,
):
    return _newest_first(
        session, page, Event, event_out, since, deployment=deployment, cluster=cluster, kind=kind
    )


@router.get("/v1/audit", response_model=Page[AuditOut])
def list_audit(
    session: SessionDep,
    who: PrincipalDep,
    page: PagingDep,
    resource_type: str | None = Query(None, max_length=32),
    resource_id: str | None = Query(None, max_length=128),
    action: str | None = Query(None, max_length=64),
    since: float | datetime | None = SINCE,
):
    return _newest_first(
        session,
        page,
        AuditRecord,
        audit_out,
        since,
        resource_type=resource_type,
        resource_id=resource_id,
        action=action,
    )
