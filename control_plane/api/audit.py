"""Audit records and events for API writes, in the caller's transaction, so a change
and its record commit (or fail) together."""

from __future__ import annotations

from typing import Any

from fastapi.encoders import jsonable_encoder
from sqlalchemy.orm import Session

from control_plane.api.auth import Principal
from control_plane.db.models import AuditRecord, Event


def _plain(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    return jsonable_encoder(value)


def audit(
    session: Session,
    principal: Principal,
    action: str,
    resource_type: str,
    resource_id: str,
    before: Any = None,
    after: Any = None,
) -> None:
    session.add(
        AuditRecord(
            actor=principal.actor,
            action=action,
            resource_type=resource_type,
            resource_id=str(resource_id),
            before=_plain(before),
            after=_plain(after),
        )
    )


def event(
    session: Session,
    kind: str,
    message: str,
    *,
    deployment: str | None = None,
    cluster: str | None = None,
    replica_id: str | None = None,
) -> None:
    session.add(
        Event(kind=kind, message=message, deployment=deployment, cluster=cluster, replica_id=replica_id)
    )
