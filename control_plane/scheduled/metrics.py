"""The scheduled jobs on /metrics: runs by outcome and the last success per job, and the
certificate check's days to expiry. Nothing while this instance runs no jobs (a follower)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from control_plane.scheduled.certificates import JOB as CERTIFICATES
from control_plane.scheduled.certificates import ExpiryReport
from control_plane.scheduled.scheduler import ScheduledJobs


def scheduled_metrics(jobs: ScheduledJobs | None) -> Iterator[Metric]:
    if jobs is None:
        return
    runs = CounterMetricFamily(
        "fleet_scheduled_job_runs",
        "Runs of the leader's scheduled jobs, by outcome.",
        labels=["job", "outcome"],
    )
    for (job, outcome), n in sorted(jobs.counts.items()):
        runs.add_metric([job, outcome], n)
    yield runs
    last = GaugeMetricFamily(
        "fleet_scheduled_job_last_success_timestamp_seconds",
        "Unix time of each scheduled job's last successful run (on this leader).",
        labels=["job"],
    )
    for info in jobs.jobs():
        if info.last_success_at is not None:
            last.add_metric([info.id], info.last_success_at.timestamp())
    yield last
    report = jobs.results.get(CERTIFICATES.id)
    if isinstance(report, ExpiryReport):
        expiry = GaugeMetricFamily(
            "fleet_control_plane_certificate_expires_in_days",
            "Days until each certificate the control plane can see expires (negative: expired).",
            labels=["certificate"],
        )
        for c in report.certificates:
            expiry.add_metric([c.certificate], c.days_left)
        yield expiry


__all__ = ["scheduled_metrics"]
