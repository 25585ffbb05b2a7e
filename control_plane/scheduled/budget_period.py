"""The budget month's rollover on the calendar: at 00:00 UTC on the first of each month,
one budget pass (`control_plane.loops.budgets`) stores every team's state for the new
month and wakes the key loop, so keys refused for a spent hard budget are served again at
the boundary. The budget loop itself stays on its interval: spend grows with traffic, not
with the calendar, and its pass also covers a boundary this job missed (a leader change at
midnight) within `budget_interval_s`.

Quotas have no calendar period here: per-minute and per-day token and request limits are
sliding windows that gateways enforce (docs/quotas.md), and quota shares follow a usage
window (`control_plane.loops.usage`)."""

from __future__ import annotations

import asyncio
import time
from datetime import timezone

from apscheduler.triggers.cron import CronTrigger
from pydantic import BaseModel

from control_plane.context import ControlPlaneContext
from control_plane.cost.budget_store import evaluate_budgets, exhausted_teams
from control_plane.scheduled.job import ScheduledJob


class Rolled(BaseModel):
    budgets: int
    exhausted: list[str]

    def __str__(self) -> str:
        return f"{self.budgets} budgets in the new month; hard budgets spent: {', '.join(self.exhausted) or 'none'}"


def roll(ctx: ControlPlaneContext, now: float) -> Rolled:
    """The budget loop's pass (`evaluate_budgets`), at the month's first second."""
    with ctx.sessions() as session:
        outcomes = evaluate_budgets(session, now)
        session.commit()
        return Rolled(budgets=len(outcomes), exhausted=sorted(exhausted_teams(session, now)))


async def run(ctx: ControlPlaneContext) -> Rolled:
    rolled = await asyncio.to_thread(roll, ctx, time.time())
    ctx.keys_changed.set()  # republish keys now: last month's refusals end at the boundary
    return rolled


JOB = ScheduledJob(
    id="budget-period",
    trigger=lambda s: CronTrigger(day=1, hour=0, minute=0, second=1, timezone=timezone.utc),
    run=run,
)

__all__ = ["JOB", "Rolled"]
