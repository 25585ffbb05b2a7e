"""The leader's scheduled jobs (`control_plane.scheduled`), for `fleetctl status` and the
console. The leader answers with its run history and next fire times; a follower, which
runs none, with the jobs' triggers and next fire times from the calendar (`running`
false)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from control_plane.scheduled import JobInfo, planned_jobs

router = APIRouter(prefix="/v1/control-plane", tags=["control-plane"])


class ScheduledJobsOut(BaseModel):
    running: bool  # whether this instance runs the jobs (it leads)
    jobs: list[JobInfo]


def scheduled_jobs_out(app_state) -> ScheduledJobsOut:
    """The answering instance's view of the jobs (also for other control-plane views)."""
    scheduled = getattr(getattr(app_state, "loops", None), "scheduled", None)
    if scheduled is not None:
        return ScheduledJobsOut(running=True, jobs=scheduled.jobs())
    return ScheduledJobsOut(running=False, jobs=planned_jobs(app_state.ctx.settings))


@router.get("/jobs", response_model=ScheduledJobsOut)
async def list_jobs(request: Request) -> ScheduledJobsOut:
    return scheduled_jobs_out(request.app.state)
