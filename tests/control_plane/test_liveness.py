"""Liveness is judged from when a heartbeat arrived, not from when the database stored it:
a cluster whose heartbeats keep coming while their write waits (a busy SQLite writer, a slow
PostgreSQL, a starved thread pool) is not failed over, and one that really stops is. Nor is
it judged across a stall of the control plane's own loop: heartbeats sent meanwhile wait
unread, so the silence was ours."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from control_plane.context import ControlPlaneContext
from control_plane.counters import Rejections
from control_plane.db import models as m
from control_plane.loops import Loops
from control_plane.loops.ingest import deaf_for, write_heartbeats
from control_plane.settings import Settings
from fleet_base import protocol
from tests.control_plane.test_loops import heartbeat

INTERVAL_S = 0.2
MISSED = 5  # silent after 1 s


def _status(sessions) -> str:
    with sessions() as s:
        return s.get(m.Cluster, "east").status


def _unhealthy_events(sessions) -> int:
    with sessions() as s:
        return len(s.scalars(select(m.Event).where(m.Event.kind == "cluster_unhealthy")).all())


def _listening_loops(sessions, tmp_path) -> Loops:
    """The control plane's loops (not started), listening for a minute, with cluster east
    heart-beating just now."""
    settings = Settings(home=tmp_path, heartbeat_interval_s=INTERVAL_S, missed_heartbeats=MISSED)
    ctx = ControlPlaneContext(settings=settings, sessions=sessions)
    ctx.nats = SimpleNamespace(is_connected=True)  # type: ignore[assignment]
    loops = Loops(ctx)
    write_heartbeats(sessions, [heartbeat("east")], m.utcnow(), Rejections())
    loops._listening_since = m.utcnow() - timedelta(minutes=1)
    return loops


async def _fails_over_a_window_after(sessions, since: float) -> None:
    """East becomes unhealthy once, no sooner than a silence window after `since` (monotonic)."""
    while _status(sessions) != "unhealthy":
        assert time.monotonic() - since < 10 * INTERVAL_S * MISSED, "a silent cluster was never failed over"
        await asyncio.sleep(0.05)
    assert time.monotonic() - since >= INTERVAL_S * MISSED * 0.9
    assert _unhealthy_events(sessions) == 1


async def test_a_cluster_whose_heartbeat_writes_are_late_stays_healthy_and_one_that_stops_fails_over(
    sessions, tmp_path, monkeypatch
) -> None:
    loops = _listening_loops(sessions, tmp_path)

    writes_wait = threading.Event()
    write = loops._write_inbox

    def late_write(heartbeats: list[protocol.Heartbeat]) -> bool:
        writes_wait.wait(30)  # the database is busy for three failover windows
        return write(heartbeats)

    monkeypatch.setattr(loops, "_write_inbox", late_write)
    tasks = [asyncio.create_task(loops._ingest_loop()), asyncio.create_task(loops._failover_loop())]
    subject = protocol.heartbeat_subject("east")
    try:
        deadline = time.monotonic() + 3 * INTERVAL_S * MISSED
        while time.monotonic() < deadline:
            beat = protocol.Heartbeat(cluster="east")
            await loops._on_heartbeat(SimpleNamespace(subject=subject, data=beat.to_bytes()))
            await asyncio.sleep(INTERVAL_S)
        assert _status(sessions) == "healthy" and _unhealthy_events(sessions) == 0
        writes_wait.set()

        # Now it really stops: failed over within a window and a bit.
        await _fails_over_a_window_after(sessions, time.monotonic())
    finally:
        writes_wait.set()
        loops._stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize(
    ("slept_s", "asked_s", "interval_s", "deaf"),
    [
        (0.5, 0.5, 1.0, False),  # on time
        (1.4, 0.5, 1.0, False),  # late by less than a heartbeat: one may still have been read
        (1.6, 0.5, 1.0, True),  # late by more: a heartbeat went unread
        (6.0, 0.5, 1.0, True),  # the soak's stall: a 6 s pause of the whole process
        (0.29, 0.1, 0.2, False),
        (0.31, 0.1, 0.2, True),
    ],
)
def test_deaf_for_a_sleep_that_overran_by_more_than_a_heartbeat(
    slept_s: float, asked_s: float, interval_s: float, deaf: bool
) -> None:
    assert deaf_for(slept_s, asked_s, interval_s) is deaf


async def test_a_control_plane_that_stood_still_fails_no_cluster_over_and_still_fails_a_silent_one(
    sessions, tmp_path
) -> None:
    """The event loop stands still (a blocking call, as a long GC pause or a signal handler
    would) for longer than the silence limit. The heartbeats sent meanwhile have not been
    read: the cluster is not failed over when the loop resumes. If none comes after, it
    is failed over a full limit later."""
    loops = _listening_loops(sessions, tmp_path)
    task = asyncio.create_task(loops._failover_loop())
    try:
        await asyncio.sleep(2 * INTERVAL_S)
        assert _status(sessions) == "healthy"
        time.sleep(1.5 * INTERVAL_S * MISSED)  # the whole loop stands still
        resumed = time.monotonic()
        await asyncio.sleep(3 * INTERVAL_S)
        assert _status(sessions) == "healthy" and _unhealthy_events(sessions) == 0

        await _fails_over_a_window_after(sessions, resumed)
    finally:
        loops._stopping = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
