"""The control plane's control loops, started by the server's lifespan:

- reconcile: on every API write (`ctx.changed`), every `reconcile_interval_s`, and after
  a heartbeat that changed capacity or replica states: place (`placement`), write the
  assignments, publish `fleet_desired`, `fleet_routes` and `fleet_keys`;
- heartbeats: `fleet.v1.heartbeat.*` (core NATS) into the database, batched (the latest
  heartbeat per cluster, every `FLUSH_S`), each in its own savepoint;
- events: the `FLEET_EVENTS` stream through a durable consumer (`durable`), acknowledged
  after the commit, stored once by event id; a bad message is counted (`control_plane.counters`) and skipped;
- failover: a cluster silent for `missed_heartbeats * heartbeat_interval_s` becomes
  unhealthy, which the next reconcile turns into re-placement and dropped routes;
- budgets: every `budget_interval_s`, each team budget against its month-to-date dollars
  (`control_plane.loops.budgets`);
- scheduled jobs: the calendar-driven work (retention, certificate expiry, the budget
  month's rollover, stale state) on APScheduler (`control_plane.scheduled`).

Decisions live in plain functions (`plan`, `ingest`, `placement`); this module is the
asyncio plumbing around them. Database work runs in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime

from control_plane.context import ControlPlaneContext
from control_plane.counters import ReconcileStats, Rejections
from control_plane.db.models import utcnow
from control_plane.inbox import Inbox
from control_plane.loops.autoscale import AutoscaleLoop, start_autoscale_loop
from control_plane.loops.budgets import start_budget_loop
from control_plane.loops.durable import DurableConsumer
from control_plane.loops.ingest import (
    deaf_for,
    mark_silent_unhealthy,
    store_event_batch,
    write_heartbeats,
)
from control_plane.loops.keys import start_key_loop
from control_plane.loops.publish import KvPublisher
from control_plane.loops.reconcile import ReconcileOutcome, reconcile_once
from control_plane.loops.usage import UsageLoop
from control_plane.nats_loop import NatsLoop
from control_plane.placement import Unplaced, get_placer
from control_plane.placement.quotas import parse_quotas
from control_plane.rollouts.loop import RolloutLoop, start_rollout_loop
from control_plane.scheduled import ScheduledJobs, start_scheduled_jobs
from fleet_base import protocol

log = logging.getLogger(__name__)

FLUSH_S = 0.1  # heartbeats and events are written at most this often


class Loops(NatsLoop):
    def __init__(self, ctx: ControlPlaneContext, placer: str | None = None) -> None:
        super().__init__(ctx)
        self.placer = get_placer(placer or ctx.settings.placer)
        self.placer.quotas = parse_quotas(getattr(ctx.settings, "gpu_quotas", "") or "")
        buckets = (protocol.BUCKET_DESIRED, protocol.BUCKET_ROUTES)  # keys: control_plane.loops.keys
        self.publisher = (
            KvPublisher(ctx.nats, buckets, ctx.epoch, on_newer_epoch=ctx.saw_epoch)
            if ctx.nats is not None
            else None
        )
        self.last: ReconcileOutcome | None = None
        self.reconciles = 0
        self.stats = ReconcileStats()  # read by GET /metrics
        self._nodes: dict[str, int] = {}
        self._reported: dict[tuple[str, int], Unplaced] = {}
        self._heartbeats: dict[str, protocol.Heartbeat] = {}
        # when each cluster's last heartbeat arrived (liveness), before its database write
        self._heard: dict[str, datetime] = {}
        self.rejections = Rejections()  # read by GET /metrics
        self.inbox = Inbox(ctx, self.rejections)  # heartbeats, decoded once for every loop
        self.inbox.receive("heartbeat", self._take_heartbeat)
        self._inbox = asyncio.Event()
        self._listening_since: datetime | None = None
        self._stopping = False
        self.rollouts: RolloutLoop | None = None
        self.autoscale: AutoscaleLoop | None = None  # its last decisions: GET /metrics
        self.scheduled: ScheduledJobs | None = None  # GET /metrics, GET /v1/control-plane/jobs
        self.children: list = []  # other loops started with these (objects with `async stop()`)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> Loops:
        """Started whole or not at all: a failure (or a cancel) stops what had started."""
        try:
            return await self._start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop()
            raise

    async def _start(self) -> Loops:
        await self.inbox.start()
        self.usage = await UsageLoop(self.ctx, rejections=self.rejections).start()
        self._spawn(self._reconcile_loop(), name="cp-reconcile")
        self._spawn(self._ingest_loop(), name="cp-ingest")
        if self.ctx.nats is not None:
            self.events = DurableConsumer(
                self.ctx.nats,
                protocol.STREAM_EVENTS,
                protocol.EVENTS_WILDCARD,
                "control-plane-events",
                lambda batch: store_event_batch(self.ctx.sessions, batch, self.rejections),
                ack_wait_s=self.ctx.settings.ingest_ack_wait_s,
            )
            self._spawn(self.events.run(), name="cp-events")
        self._spawn(self._failover_loop(), name="cp-failover")
        await self._listen()
        self.ctx.kick()
        return self

    async def stop(self) -> None:
        self._stopping = True
        if getattr(self, "usage", None) is not None:
            await self.usage.stop()
        for child in self.children:
            with contextlib.suppress(Exception):
                await child.stop()
        await self.inbox.stop()
        await self._close()

    async def _on_connected(self) -> None:
        """Every (re)connect (after subscribing on a new connection): start the silence
        clock, re-read the buckets and republish whatever differs."""
        self._listening_since = utcnow()
        if self.publisher is not None:
            self.publisher.invalidate()
        self.ctx.kick()

    # ----------------------------------------------------------------- reconcile

    async def reconcile_now(self) -> ReconcileOutcome:
        began = time.perf_counter()
        try:
            outcome = await asyncio.to_thread(
                reconcile_once,
                self.ctx.sessions,
                self.placer,
                self._nodes,
                self._reported,
                self.last.solved if self.last is not None else None,
                self.ctx.settings.unreachable_hold_s,
            )
        except Exception:
            self.stats.fail()
            raise
        self.stats.observe(time.perf_counter() - began)
        self.reconciles += 1
        self.last = outcome
        if outcome.changed:
            r = outcome.result
            log.info("placement: %d added, %d removed, %d kept", len(r.added), len(r.removed), len(r.kept))
        if self.publisher is not None:
            await self.publisher.publish(outcome.wanted)
        return outcome

    async def _reconcile_loop(self) -> None:
        interval = self.ctx.settings.reconcile_interval_s
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.changed.wait(), interval)
            self.ctx.changed.clear()
            try:
                await self.reconcile_now()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile failed; retrying")
                await asyncio.sleep(min(1.0, interval))

    # ----------------------------------------------------------------- heartbeats and events

    async def _on_heartbeat(self, msg) -> None:
        """A raw heartbeat message, through the inbox (decoded and checked once)."""
        await self.inbox.deliver("heartbeat", msg.subject, msg.data)

    def _take_heartbeat(self, hb: protocol.Heartbeat) -> None:
        self._heartbeats[hb.cluster] = hb
        self._heard[hb.cluster] = utcnow()
        self.ctx.saw_epoch(hb.fence_epoch, f"agent {hb.cluster}")
        if self.publisher is not None:
            self.publisher.raise_floor(protocol.BUCKET_DESIRED, hb.cluster, hb.desired_generation)
        self._inbox.set()

    def _write_inbox(self, heartbeats: list[protocol.Heartbeat]) -> bool:
        return write_heartbeats(self.ctx.sessions, heartbeats, utcnow(), self.rejections)

    async def _ingest_loop(self) -> None:
        while not self._stopping:
            await self._inbox.wait()
            self._inbox.clear()
            heartbeats, self._heartbeats = list(self._heartbeats.values()), {}
            try:
                if await asyncio.to_thread(self._write_inbox, heartbeats):
                    self.ctx.kick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("recording %d heartbeats failed", len(heartbeats))
            await asyncio.sleep(FLUSH_S)

    # ----------------------------------------------------------------- failover

    def _mark_silent(self, since: datetime, limit_s: float, heard: dict[str, datetime]) -> list[str]:
        with self.ctx.sessions() as session:
            marked = mark_silent_unhealthy(session, since, utcnow(), limit_s, heard)
            session.commit()
            return marked

    async def _failover_loop(self) -> None:
        settings = self.ctx.settings
        limit_s = settings.missed_heartbeats * settings.heartbeat_interval_s
        tick_s = max(0.05, settings.heartbeat_interval_s / 2)
        while not self._stopping:
            asleep = time.monotonic()
            await asyncio.sleep(tick_s)
            slept_s = time.monotonic() - asleep
            link = self.ctx.nats
            if link is None or not link.is_connected or self._listening_since is None:
                continue  # we cannot hear anyone: nobody is silent
            if deaf_for(slept_s, tick_s, settings.heartbeat_interval_s):
                self._listening_since = utcnow()
                log.warning("this control plane stood still for %.1fs: liveness counts from now", slept_s)
                continue
            try:
                heard = dict(self._heard)  # copied here: heartbeats land on this loop
                marked = await asyncio.to_thread(self._mark_silent, self._listening_since, limit_s, heard)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("failover check failed")
                continue
            if marked:
                log.warning("clusters unhealthy (no heartbeat for %.1fs): %s", limit_s, ", ".join(marked))
                self.ctx.kick()


async def start_loops(ctx: ControlPlaneContext) -> Loops:
    """Start the control loops; `await loops.stop()` ends them. All or nothing: when a part
    fails to start (or the start is cancelled), the parts already started are stopped and
    the error is raised, so a leader never runs half its loops or leaks the rest."""
    loops = await Loops(ctx).start()
    try:
        loops.rollouts = await start_rollout_loop(ctx, rejections=loops.rejections)
        loops.children.append(loops.rollouts)
        loops.autoscale = await start_autoscale_loop(ctx, inbox=loops.inbox)
        loops.children.append(loops.autoscale)
        loops.children.append(await start_key_loop(ctx))
        loops.children.append(await start_budget_loop(ctx))
        loops.scheduled = start_scheduled_jobs(ctx)
        loops.children.append(loops.scheduled)
    except BaseException:
        with contextlib.suppress(Exception):
            await loops.stop()
        raise
    return loops


__all__ = ["Loops", "start_loops"]
