"""What one scheduled job is: an id, when it fires (an APScheduler trigger built from the
settings), and its work. The work is a coroutine on the leader's context; what it returns
(a summary with `__str__`) is kept as the job's last result."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from apscheduler.triggers.base import BaseTrigger
from pydantic import BaseModel

from control_plane.context import ControlPlaneContext
from control_plane.settings import Settings


@dataclass(frozen=True)
class ScheduledJob:
    id: str
    trigger: Callable[[Settings], BaseTrigger]
    run: Callable[[ControlPlaneContext], Awaitable[object]]
    # Also run once as soon as the scheduler starts (a check whose figures /metrics shows).
    run_at_start: bool = False


class JobInfo(BaseModel):
    """A job as `GET /v1/control-plane/jobs` and `fleetctl status` show it."""

    id: str
    trigger: str
    next_run_at: datetime | None = None
    last_run_at: datetime | None = None
    last_success_at: datetime | None = None
    last_outcome: str | None = None  # "ok" | "error"; None: not run by this leader yet
    last_error: str | None = None
    last_summary: str | None = None
    runs: int = 0


__all__ = ["JobInfo", "ScheduledJob"]
