"""`GET /v1/control-plane`: the instances on this database, the lease's holder and epoch,
and whether the answering instance leads (every instance answers the same list)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from control_plane.api.schemas import ControlPlaneMemberOut, ControlPlaneOut
from control_plane.ha.lease_store import LeaseStore

router = APIRouter(prefix="/v1/control-plane", tags=["control-plane"])


def _view(store: LeaseStore, is_leader: bool) -> ControlPlaneOut:
    lease = store.read()
    leader = lease.holder if lease is not None else None
    members = [
        ControlPlaneMemberOut(
            id=m.id, url=m.url, is_leader=m.id == leader, last_seen=m.last_seen, started_at=m.started_at
        )
        for m in store.members()
    ]
    return ControlPlaneOut(
        leader=leader, epoch=lease.epoch if lease is not None else 0, members=members, is_leader=is_leader
    )


@router.get("", response_model=ControlPlaneOut)
async def control_plane_members(request: Request) -> ControlPlaneOut:
    """Authenticated by the router's dependency; takes only the request, so the console
    calls this same function for its card."""
    elector = getattr(request.app.state, "elector", None)
    is_leader = bool(elector is not None and elector.is_leader)  # read on the event loop, where it changes
    return await asyncio.to_thread(_view, LeaseStore(request.app.state.ctx.sessions), is_leader)
