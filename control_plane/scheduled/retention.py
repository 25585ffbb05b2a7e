"""Retention: events, audit records and usage records past their configured age are
deleted, in bounded batches (`control_plane.db.prune`). Usage records of the current
calendar month (UTC) are always kept, whatever the retention: team budgets and cost
reports read the month to date from them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from apscheduler.triggers.cron import CronTrigger
from pydantic import BaseModel
from sqlalchemy.orm import Session

from control_plane.context import ControlPlaneContext
from control_plane.cost.budgets import month_start
from control_plane.db.models import AuditRecord, Event, UsageRecord
from control_plane.db.prune import prune_before
from control_plane.scheduled.job import ScheduledJob
from control_plane.settings import Settings

TABLES = {"events": Event, "audit": AuditRecord, "usage": UsageRecord}


class Pruned(BaseModel):
    cutoffs: dict[str, datetime]
    deleted: dict[str, int]

    def __str__(self) -> str:
        return ", ".join(f"{name}: {n} deleted" for name, n in self.deleted.items())


def retention_cutoffs(settings: Settings, now: datetime) -> dict[str, datetime]:
    """Per table, the time before which rows go."""
    month = datetime.fromtimestamp(month_start(now.timestamp()), timezone.utc)
    return {
        "events": now - timedelta(days=settings.retention_events_days),
        "audit": now - timedelta(days=settings.retention_audit_days),
        "usage": min(now - timedelta(days=settings.usage_retention_days), month),
    }


def prune_all(sessions: Callable[[], Session], settings: Settings, now: datetime) -> Pruned:
    cutoffs = retention_cutoffs(settings, now)
    deleted = {name: prune_before(sessions, TABLES[name], before) for name, before in cutoffs.items()}
    return Pruned(cutoffs=cutoffs, deleted=deleted)


async def run(ctx: ControlPlaneContext) -> Pruned:
    return await asyncio.to_thread(prune_all, ctx.sessions, ctx.settings, datetime.now(timezone.utc))


# Hourly: each run deletes about an hour's worth of rows, never a month's backlog at once.
JOB = ScheduledJob(id="retention", trigger=lambda s: CronTrigger(minute=17, timezone=timezone.utc), run=run)

__all__ = ["JOB", "Pruned", "prune_all", "retention_cutoffs"]
