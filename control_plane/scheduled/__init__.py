"""Calendar-driven work, run by the leader on APScheduler (`scheduler`), one module per
job: `retention` (events, audit and usage records past their age), `certificates`
(days to expiry, events within the renewal window), `budget_period` (the budget month's
rollover at its boundary), `stale_state` (rows nobody refreshes any more). The
event-driven control loops are `control_plane.loops`; docs/architecture.md says which
work is which, and why."""

from control_plane.scheduled.job import JobInfo, ScheduledJob
from control_plane.scheduled.scheduler import ScheduledJobs, planned_jobs, start_scheduled_jobs

__all__ = ["JobInfo", "ScheduledJob", "ScheduledJobs", "planned_jobs", "start_scheduled_jobs"]
