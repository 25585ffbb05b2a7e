"""The scheduler: jobs start and stop with it, each run is recorded by outcome (a refused,
fenced write is a failure like any other, and the scheduler goes on), the list shows
triggers and next runs, and /metrics and GET /v1/control-plane/jobs show them."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from apscheduler.triggers.interval import IntervalTrigger
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from control_plane.api.app import build_app
from control_plane.api.routers.keys import make_key
from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.ha import LEASE_NAME
from control_plane.ha.fencing import fenced_sessions
from control_plane.scheduled import JobInfo, ScheduledJob, retention, start_scheduled_jobs
from control_plane.scheduled.certificates import CertificateExpiry, ExpiryReport
from control_plane.scheduled.scheduler import JOBS
from control_plane.settings import Settings
from tests import polling


class Fenced(Exception):
    """A failing job's exception (the real `Fenced`: the fencing test below)."""


def _job(job_id: str, calls: list, fail: bool = False, at_start: bool = True) -> ScheduledJob:
    async def run(ctx):
        calls.append(job_id)
        if fail:
            raise Fenced("epoch 3 < 4")
        return f"{job_id} done"

    return ScheduledJob(job_id, lambda s: IntervalTrigger(hours=1), run, run_at_start=at_start)


def _ctx(tmp_path, sessions=None) -> ControlPlaneContext:
    return ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions)


async def test_runs_are_recorded_by_outcome_and_a_failure_does_not_stop_the_rest(tmp_path) -> None:
    calls: list[str] = []
    jobs = start_scheduled_jobs(
        _ctx(tmp_path),
        [_job("good", calls), _job("fenced", calls, fail=True), _job("later", calls, at_start=False)],
    )
    try:
        await asyncio.to_thread(
            polling.wait_for, lambda: {"good", "fenced"} <= set(calls), 10, "the first runs"
        )
        await asyncio.sleep(0.05)
        info = {j.id: j for j in jobs.jobs()}
        assert info["good"].last_outcome == "ok" and info["good"].last_summary == "good done"
        assert info["fenced"].last_outcome == "error" and "Fenced: epoch 3 < 4" in info["fenced"].last_error
        assert info["fenced"].last_success_at is None
        assert info["later"].runs == 0 and info["later"].last_outcome is None
        now = datetime.now(timezone.utc)
        for j in info.values():
            assert j.trigger.startswith("interval[")
            assert now < j.next_run_at <= now + timedelta(hours=1, seconds=1)
        # the fenced job runs again on its next fire, counted again
        await jobs.run_now("fenced")
        assert jobs.counts == {
            ("good", "ok"): 1, ("good", "error"): 0,
            ("fenced", "ok"): 0, ("fenced", "error"): 2,
            ("later", "ok"): 0, ("later", "error"): 0,
        }  # fmt: skip
    finally:
        await jobs.stop()
    assert not jobs.scheduler.running
    assert all(j.next_run_at is None for j in jobs.jobs())


async def test_stop_cancels_a_run_in_flight(tmp_path) -> None:
    started = asyncio.Event()

    async def slow(ctx):
        started.set()
        await asyncio.sleep(60)

    jobs = start_scheduled_jobs(
        _ctx(tmp_path), [ScheduledJob("slow", lambda s: IntervalTrigger(hours=1), slow, run_at_start=True)]
    )
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.wait_for(jobs.stop(), 5)
    assert jobs._running == set()


async def test_the_real_jobs_are_listed_with_their_next_runs(tmp_path, db) -> None:
    jobs = start_scheduled_jobs(_ctx(tmp_path, db))
    try:
        listed = jobs.jobs()
        assert [j.id for j in listed] == ["retention", "certificate-expiry", "budget-period", "stale-state"]
        assert all(isinstance(j, JobInfo) and j.next_run_at is not None for j in listed)
        # the certificate check runs at start: its figures are on /metrics from the beginning
        await asyncio.to_thread(
            polling.wait_for, lambda: jobs.info["certificate-expiry"].runs == 1, 10, "the certificate check"
        )
        assert jobs.info["certificate-expiry"].last_outcome == "ok"
        assert isinstance(jobs.results["certificate-expiry"], ExpiryReport)
        for job in ("retention", "stale-state", "budget-period"):
            assert (await jobs.run_now(job)).last_outcome == "ok", jobs.info[job].last_error
    finally:
        await jobs.stop()


async def test_a_stale_leaders_job_is_refused_by_fencing_and_recorded_as_failed(tmp_path, db) -> None:
    """The lease moved to epoch 5; this leader's context is fenced at epoch 4: its retention
    run deletes nothing and is counted as an error, the scheduler goes on."""
    with db() as s:
        s.add(m.ControlPlaneLease(name=LEASE_NAME, holder="successor", epoch=5, version=9, lease_s=15))
        s.add(m.Event(kind="t", at=datetime.now(timezone.utc) - timedelta(days=400)))
        s.commit()
    ctx = _ctx(tmp_path, fenced_sessions(db, LEASE_NAME, 4))
    jobs = start_scheduled_jobs(ctx, [retention.JOB])
    try:
        info = await jobs.run_now("retention")
    finally:
        await jobs.stop()
    assert info.last_outcome == "error" and info.last_error.startswith("Fenced")
    assert jobs.counts[("retention", "error")] == 1
    with db() as s:
        assert s.scalar(select(func.count()).select_from(m.Event)) == 1


def _client(app, sessions) -> TestClient:
    row, secret = make_key("tester", ["read"], None, {})
    with sessions() as s:
        s.add(row)
        s.commit()
    return TestClient(app, headers={"Authorization": f"Bearer {secret}"})


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_and_the_job_list_on_the_leader(tmp_path, sessions) -> None:
    calls: list[str] = []
    jobs = start_scheduled_jobs(
        _ctx(tmp_path, sessions), [_job("good", calls), _job("bad", calls, fail=True)]
    )
    try:
        await asyncio.to_thread(polling.wait_for, lambda: len(calls) == 2, 10, "the first runs")
        await asyncio.sleep(0.05)
        jobs.results["certificate-expiry"] = ExpiryReport(
            certificates=[
                CertificateExpiry(
                    certificate="pki/ca.pem",
                    subject="CN=ca",
                    not_after=datetime.now(timezone.utc),
                    days_left=12.5,
                )
            ],
            expiring=["pki/ca.pem"],
            unreadable=[],
        )
        app = build_app(_ctx(tmp_path, sessions), run_loops=False)
        with _client(app, sessions) as api:
            app.state.loops = SimpleNamespace(scheduled=jobs)  # what a leader's lifespan sets
            samples = _samples(api.get("/metrics").text)
            body = api.get("/v1/control-plane/jobs").json()
    finally:
        await jobs.stop()
    assert samples[("fleet_scheduled_job_runs_total", (("job", "good"), ("outcome", "ok")))] == 1
    assert samples[("fleet_scheduled_job_runs_total", (("job", "bad"), ("outcome", "error")))] == 1
    assert samples[("fleet_scheduled_job_runs_total", (("job", "bad"), ("outcome", "ok")))] == 0
    last = samples[("fleet_scheduled_job_last_success_timestamp_seconds", (("job", "good"),))]
    assert abs(last - datetime.now(timezone.utc).timestamp()) < 60
    assert ("fleet_scheduled_job_last_success_timestamp_seconds", (("job", "bad"),)) not in samples
    assert (
        samples[("fleet_control_plane_certificate_expires_in_days", (("certificate", "pki/ca.pem"),))] == 12.5
    )
    assert body["running"] is True
    assert [(j["id"], j["last_outcome"]) for j in body["jobs"]] == [("good", "ok"), ("bad", "error")]


def test_a_follower_lists_the_planned_jobs_and_needs_a_token(tmp_path, sessions) -> None:
    app = build_app(_ctx(tmp_path, sessions), run_loops=False)
    assert TestClient(app).get("/v1/control-plane/jobs").status_code == 401
    with _client(app, sessions) as api:
        body = api.get("/v1/control-plane/jobs").json()
        metrics = api.get("/metrics").text
    assert body["running"] is False
    assert [j["id"] for j in body["jobs"]] == [j.id for j in JOBS]
    assert all(j["next_run_at"] and j["last_run_at"] is None for j in body["jobs"])
    assert "fleet_scheduled_job_runs_total" not in metrics
