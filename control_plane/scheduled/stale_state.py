"""Expiry of state nobody refreshes any more. Each `Expiry` names a table, the column that
says when a row was last refreshed and the age (from the settings) past which it goes;
rows are deleted in bounded batches (by primary key `id`) (`control_plane.db.prune`). A new kind of stale state
is one more `Expiry` in `EXPIRIES`.

- nodes: a node no heartbeat has reported for `stale_node_days` (removed from its
  cluster, or its cluster deleted) is forgotten; a node still reported is refreshed by
  every heartbeat, and one that comes back is recorded again by its next one;
- control-plane members: an instance not seen for `stale_member_s` (it crashed without
  leaving) drops out of `GET /v1/control-plane` and `fleetctl status`; a live one
  refreshes its row every retry period, and one that comes back inserts it again.

API keys have no expiry in Fleet (they live until revoked; revoked keys stay for the
audit trail), so there is nothing of theirs to expire."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from apscheduler.triggers.cron import CronTrigger
from pydantic import BaseModel
from sqlalchemy.orm import Session

from control_plane.context import ControlPlaneContext
from control_plane.db.models import ControlPlaneMember, Node
from control_plane.db.prune import prune_before
from control_plane.scheduled.job import ScheduledJob
from control_plane.settings import Settings


@dataclass(frozen=True)
class Expiry:
    name: str
    model: type
    column: str
    max_age: Callable[[Settings], timedelta]


EXPIRIES: tuple[Expiry, ...] = (
    Expiry("nodes", Node, "updated_at", lambda s: timedelta(days=s.stale_node_days)),
    Expiry("members", ControlPlaneMember, "last_seen", lambda s: timedelta(seconds=s.stale_member_s)),
)


class Expired(BaseModel):
    deleted: dict[str, int]

    def __str__(self) -> str:
        return ", ".join(f"{name}: {n} expired" for name, n in self.deleted.items())


def expire_all(
    sessions: Callable[[], Session],
    settings: Settings,
    now: datetime,
    expiries: tuple[Expiry, ...] = EXPIRIES,
) -> Expired:
    return Expired(
        deleted={
            e.name: prune_before(sessions, e.model, now - e.max_age(settings), column=e.column)
            for e in expiries
        }
    )


async def run(ctx: ControlPlaneContext) -> Expired:
    return await asyncio.to_thread(expire_all, ctx.sessions, ctx.settings, datetime.now(timezone.utc))


# Hourly: a crashed member leaves the members list within about `stale_member_s` + 1 h.
JOB = ScheduledJob(id="stale-state", trigger=lambda s: CronTrigger(minute=23, timezone=timezone.utc), run=run)

__all__ = ["EXPIRIES", "JOB", "Expired", "Expiry", "expire_all"]
