"""What happened (events from agents, loops and API writes) and who changed what (audit)."""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Query
from sqlalchemy import select

from control_plane.api.deps import PagingDep, PrincipalDep, SessionDep, as_utc
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
    query = select(Event).order_by(Event.id.desc())
    if deployment is not None:
        query = query.where(Event.deployment == deployment)
    if cluster is not None:
        query = query.where(Event.cluster == cluster)
    if kind is not None:
        query = query.where(Event.kind == kind)
    if (after := _since(since)) is not None:
        query = query.where(Event.at > after)
    rows, total = page.apply(session, query)
    return Page(items=[event_out(r) for r in rows], total=total, limit=page.limit, offset=page.offset)


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
    query = select(AuditRecord).order_by(AuditRecord.id.desc())
    if resource_type is not None:
        query = query.where(AuditRecord.resource_type == resource_type)
    if resource_id is not None:
        query = query.where(AuditRecord.resource_id == resource_id)
    if action is not None:
        query = query.where(AuditRecord.action == action)
    if (after := _since(since)) is not None:
        query = query.where(AuditRecord.at > after)
    rows, total = page.apply(session, query)
    return Page(items=[audit_out(r) for r in rows], total=total, limit=page.limit, offset=page.offset)
