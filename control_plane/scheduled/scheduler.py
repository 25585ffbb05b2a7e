"""The leader's calendar: the scheduled jobs on APScheduler's AsyncIOScheduler, in the
loops' event loop and with the loops' (fenced) context. Started by
`control_plane.loops.start_loops` and stopped with the loops, so a follower, or a leader
that lost its lease, runs none.

Every run is counted by outcome; a failure (a `Fenced` write from a stale leader, a
database error) is logged and counted, never raised into the scheduler. Jobs are
registered afresh on every start, from the trigger alone: a fire time that passed while
no leader ran (a takeover at that moment) is not replayed, which every job tolerates
(each catches up on its next run, or another loop covers it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from datetime import datetime, timezone

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from control_plane.context import ControlPlaneContext
from control_plane.scheduled import budget_period, certificates, retention, stale_state
from control_plane.scheduled.job import JobInfo, ScheduledJob
from control_plane.settings import Settings

log = logging.getLogger(__name__)

JOBS: tuple[ScheduledJob, ...] = (retention.JOB, certificates.JOB, budget_period.JOB, stale_state.JOB)
OUTCOMES = ("ok", "error")
# A fire time this late (the event loop was busy) still runs; later ones wait for the next.
MISFIRE_GRACE_S = 300


class ScheduledJobs:
    def __init__(self, ctx: ControlPlaneContext, jobs: Iterable[ScheduledJob] = JOBS) -> None:
        self.ctx = ctx
        self.specs = {job.id: job for job in jobs}
        self.info = {job_id: JobInfo(id=job_id, trigger="") for job_id in self.specs}
        self.counts = {(job_id, outcome): 0 for job_id in self.specs for outcome in OUTCOMES}
        self.results: dict[str, object] = {}  # each job's last result (`certificates`: /metrics)
        self.scheduler = AsyncIOScheduler(timezone=timezone.utc, event_loop=asyncio.get_running_loop())
        self._running: set[asyncio.Task] = set()

    def start(self) -> ScheduledJobs:
        now = datetime.now(timezone.utc)
        for job in self.specs.values():
            trigger = job.trigger(self.ctx.settings)
            self.info[job.id].trigger = str(trigger)
            extra = {"next_run_time": now} if job.run_at_start else {}
            self.scheduler.add_job(
                self.run_now, trigger, args=[job.id], id=job.id, name=job.id,
                coalesce=True, max_instances=1, misfire_grace_time=MISFIRE_GRACE_S, **extra,
            )  # fmt: skip
        self.scheduler.start()
        return self

    async def stop(self) -> None:
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)  # scheduled on the event loop (call_soon_threadsafe)
            await asyncio.sleep(0)
        for task in list(self._running):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def run_now(self, job_id: str) -> JobInfo:
        """One run of the job, recorded like a scheduled one (tests, and the scheduler's)."""
        job, info = self.specs[job_id], self.info[job_id]
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        info.last_run_at = datetime.now(timezone.utc)
        try:
            result = await job.run(self.ctx)
        except Exception as err:  # Fenced included: a stale leader's write, refused
            log.exception("scheduled job %s failed", job_id)
            info.last_outcome, info.last_error = "error", f"{type(err).__name__}: {err}"[:500]
        else:
            self.results[job_id] = result
            info.last_outcome, info.last_error = "ok", None
            info.last_success_at = datetime.now(timezone.utc)
            info.last_summary = str(result)
            log.info("scheduled job %s: %s", job_id, info.last_summary)
        finally:
            if task is not None:
                self._running.discard(task)
        info.runs += 1
        self.counts[(job_id, info.last_outcome)] += 1
        return info

    def jobs(self) -> list[JobInfo]:
        out = []
        for job_id, info in self.info.items():
            job = self.scheduler.get_job(job_id) if self.scheduler.running else None
            out.append(info.model_copy(update={"next_run_at": getattr(job, "next_run_time", None)}))
        return out


def start_scheduled_jobs(ctx: ControlPlaneContext, jobs: Iterable[ScheduledJob] = JOBS) -> ScheduledJobs:
    """Start the jobs on the running event loop; `await jobs.stop()` ends them."""
    return ScheduledJobs(ctx, jobs).start()


def planned_jobs(settings: Settings, now: datetime | None = None) -> list[JobInfo]:
    """The jobs as any instance can describe them (a follower runs none): triggers and next
    fire times from the calendar, no run history."""
    now = now or datetime.now(timezone.utc)
    out = []
    for job in JOBS:
        trigger = job.trigger(settings)
        out.append(
            JobInfo(id=job.id, trigger=str(trigger), next_run_at=trigger.get_next_fire_time(None, now))
        )
    return out


__all__ = ["JOBS", "JobInfo", "ScheduledJobs", "planned_jobs", "start_scheduled_jobs"]
