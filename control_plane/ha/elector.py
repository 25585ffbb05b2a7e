"""The elector: one asyncio task per control-plane process that, every `leader_retry_s`,
reads the lease and acquires or renews it by `election.Candidate`'s decision, then
heartbeats this member in the background (database work on threads of its own, each call
bounded). On winning it starts the control loops, in a task of their own, with a fenced
copy of the context; it stops them when it cannot renew within the renew deadline (a
watchdog, so a hung database call cannot delay it), when a renew is refused, or when a
fenced commit raises `Fenced`; on a clean shutdown it releases the lease so a successor
takes over at once.

The database lost its history (a fresh one, a restore from an older backup) while NATS and
the agents kept theirs: the leader's epoch is then below one on the wire, its publishers
are fenced and agents refuse it, and the fleet freezes. Every acquire goes through the
database, so an epoch on the wire above the database's cannot be a live successor's:
`raise_floor` takes the lease above it (compare-and-set on the epoch held) and restarts the
loops under the new epoch. Where the database's epoch has moved on, a successor leads: demote.

Kicks: `ctx.kick()` on an instance that does not lead publishes `ControlPlaneKick` on core
NATS; every instance listens, and the leader kicks its own loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from control_plane.context import ControlPlaneContext
from control_plane.counters import ReconcileStats
from control_plane.db.models import utcnow
from control_plane.ha import LEASE_NAME
from control_plane.ha.election import Action, Candidate, LeaseRecord
from control_plane.ha.fencing import Fenced, fenced_sessions
from control_plane.ha.lease_store import LeaseStore
from fleet_base import protocol

log = logging.getLogger(__name__)

RENEW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A clean shutdown gives the loops as long as before election existed.
SHUTDOWN_STOP_S = 10.0
START_ROUNDS = 3  # rounds `start` tries before serving as a follower

LoopStarter = Callable[[ControlPlaneContext], Awaitable[object | None]]


def new_member_id() -> str:
    """Unique per process, readable: host, pid, and a random suffix (pids are reused)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Elector:
    def __init__(
        self,
        ctx: ControlPlaneContext,
        start_loops: LoopStarter,
        *,
        url: str = "",
        member_id: str | None = None,
        on_loops: Callable[[object | None], None] = lambda _loops: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        settings = ctx.settings
        self.ctx = ctx
        self.member_id = member_id or new_member_id()
        self.url = url
        self.started_at: datetime = utcnow()
        lease_s, deadline_s, retry_s = (
            settings.leader_lease_s,
            settings.leader_renew_deadline_s,
            settings.leader_retry_s,
        )
        # A lease write or fenced commit sits idle at most the slack between the renew deadline
        # and the lease: a paused holder's row lock is gone before any successor may acquire.
        self.hold_timeout_s = lease_s - deadline_s
        self.store = LeaseStore(
            ctx.sessions, LEASE_NAME, lock_timeout_s=min(retry_s, 1.0), hold_timeout_s=self.hold_timeout_s
        )
        # Every database call of the election is bounded (a timed-out call counts as failed),
        # on threads of its own so it never queues behind the loops' threads.
        self.call_timeout_s = min(deadline_s / 2, max(2 * retry_s, 1.0))
        self._db_threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="cp-elector-db")
        self.candidate = Candidate(self.member_id, settings.leader_lease_s, settings.leader_renew_deadline_s)
        self.lease_s = settings.leader_lease_s
        self.retry_s = settings.leader_retry_s
        # Loops get half the slack between the renew deadline and the lease to stop in.
        self.stop_timeout_s = max(0.1, (settings.leader_lease_s - settings.leader_renew_deadline_s) / 2)
        self.loops: object | None = None
        self.leader_changes = 0  # times this process became leader
        self.renew_stats = ReconcileStats(buckets=RENEW_BUCKETS)  # acquire and renew round trips
        self.last_record: LeaseRecord | None = None
        self.last_demotion: str | None = None  # why this instance last stopped leading
        self.floor_raises = 0  # times the lease was raised above an epoch seen on the wire
        self._start_loops = start_loops
        self._on_loops = on_loops
        self._clock = clock
        self._transition = asyncio.Lock()
        self._raising = asyncio.Lock()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._subscribed: set[int] = set()
        self._stopping = False
        self._starting: asyncio.Task | None = None  # the loops of our term, being started
        self._start_failures = 0  # in a row; the backoff before standing again grows with it
        self._hold_off_until = 0.0  # local time before which we do not acquire (after a failed start)
        self._fenced_epoch = 0  # the last term a fenced commit ended
        self._beating: asyncio.Task | None = None  # the member heartbeat in flight

    # ----------------------------------------------------------------- state

    @property
    def is_leader(self) -> bool:
        return self.loops is not None and self.candidate.believes_leading(self._clock())

    @property
    def epoch(self) -> int:
        """Ours while leading, else 0 (the last epoch seen is `last_record.epoch`)."""
        return self.candidate.epoch if self.candidate.leading else 0

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> Elector:
        """One completed election round before returning: a lone instance on a fresh (or
        released) lease leads before the API serves. A round whose database call failed (a
        loaded machine) is retried a few times."""
        self._event_loop = asyncio.get_running_loop()
        self.ctx.on_kick = self._forward_kick
        if self.ctx.nats is not None:
            self.ctx.nats.on_connect(self._subscribe_kicks)
            if self.ctx.nats.is_connected:
                await self._subscribe_kicks()
        for _ in range(START_ROUNDS):
            if await self.step():
                break
        self._tasks = [
            asyncio.create_task(self._run(), name="cp-elector"),
            asyncio.create_task(self._watchdog(), name="cp-elector-watchdog"),
        ]
        if self._starting is not None:  # renews and the watchdog run meanwhile
            await asyncio.wait({self._starting})
        if self._beating is not None:  # listed as a member before serving, unless the database is stuck
            await asyncio.wait({self._beating}, timeout=self.call_timeout_s)
        return self

    async def stop(self) -> None:
        """Stop the loops, release the lease (a successor need not wait it out), leave."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        epoch = self.candidate.epoch if self.candidate.leading else 0
        await self.demote("shutting down", timeout_s=SHUTDOWN_STOP_S)
        if self.ctx.on_kick == self._forward_kick:
            self.ctx.on_kick = None
        off_connect = getattr(self.ctx.nats, "off_connect", None)
        if off_connect is not None:
            off_connect(self._subscribe_kicks)
        if self._beating is not None:  # must not write our row again after we leave
            await asyncio.wait({self._beating}, timeout=5)
        with contextlib.suppress(Exception):
            if epoch:
                await self._db(self.store.release, self.member_id, epoch)
            await self._db(self.store.leave, self.member_id)
        self._db_threads.shutdown(wait=False)

    # ----------------------------------------------------------------- election

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.retry_s)
            self._wake.clear()
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("election round failed")

    async def step(self) -> bool:
        """One round: read, then acquire or renew as the policy decides; the member
        heartbeat follows in a task of its own, never in the renew's way. False where a
        database call failed or a lease was won too late to lead by (`start` retries)."""
        started = self._clock()
        try:
            record = await self._db(self.store.read)
        except Exception as err:
            log.warning("lease unreadable (%r); the watchdog stops the loops at the renew deadline", err)
            self._beat()
            return False
        self.last_record = record
        # A change is dated by the end of the read that saw it (a follower must not count the
        # read's own duration as the holder's silence); a leader's renew counts from `started`.
        decision = self.candidate.observe(record, self._clock())
        if decision.action == Action.acquire and self._clock() < self._hold_off_until:
            return True  # our last start of the loops failed: others first, us again after the backoff
        done = True
        if decision.action == Action.acquire:
            done = await self._acquire(record, started, decision.reason)
        elif decision.action == Action.renew:
            await self._renew(started)
        self._beat()
        return done

    def _beat(self) -> None:
        """One member heartbeat at a time, in the background (a slow one is not repeated)."""
        if self._stopping or (self._beating is not None and not self._beating.done()):
            return
        self._beating = asyncio.create_task(self._heartbeat(), name="cp-member-heartbeat")

    async def _db(self, call: Callable, *args):
        """`call(*args)` on the election's threads, bounded by `call_timeout_s` (a thread
        cannot be cancelled: a late answer is dropped, and its lock waits are bounded)."""
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(
            loop.run_in_executor(self._db_threads, call, *args), self.call_timeout_s
        )

    async def _heartbeat(self) -> None:
        """Members long unseen are forgotten by the leader's scheduled job (scheduled.stale_state)."""
        try:
            # Unbounded on purpose: the task lasts as long as its thread, so a stuck heartbeat
            # holds one of the election's threads, never all of them.
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(
                self._db_threads, self.store.heartbeat, self.member_id, self.url, self.started_at
            )
        except Exception as err:
            log.warning("member heartbeat failed: %s", err)

    async def _acquire(self, seen: LeaseRecord | None, started: float, reason: str) -> bool:
        """False where the database call failed (it may still have written the lease)."""
        try:
            won = await self._db(self.store.acquire, self.member_id, seen, self.lease_s)
        except Exception as err:
            log.warning("acquiring the lease failed: %r", err)
            return False
        if won is None:
            return True  # someone else moved it first
        self.renew_stats.observe(self._clock() - started)
        self.last_record = won
        async with self._transition:
            if self.candidate.leading or self._starting is not None:
                await self._end_term()  # a term of ours we had given up on: its loops are done
            if not self.candidate.acquired(won, started, self._clock()):
                log.warning("the lease of epoch %d was won too late to lead by it", won.epoch)
                return False
            log.warning("leading the control plane: epoch %d (%s)", won.epoch, reason)
            self._begin_term(won.epoch)
        return True

    async def _renew(self, started: float) -> None:
        epoch = self.candidate.epoch
        try:
            renewed = await self._db(self.store.renew, self.member_id, epoch)
        except Exception as err:
            log.warning("renewing the lease failed: %r", err)
            return  # the watchdog demotes at the deadline unless a later renew succeeds
        if renewed is None:  # unless the epoch was raised meanwhile (`raise_floor`)
            await self.demote(f"lost the lease of epoch {epoch}", epoch=epoch)
            return
        if self.candidate.must_stop(self._clock()):
            return  # answered too late: the watchdog demotes
        self.renew_stats.observe(self._clock() - started)
        self.last_record = renewed
        self.candidate.renewed(renewed, started)

    async def _watchdog(self) -> None:
        while not self._stopping:
            deadline = self.candidate.deadline()
            if deadline is None:
                await asyncio.sleep(self.retry_s / 4)
                continue
            await asyncio.sleep(max(0.0, deadline - self._clock()))
            if self.candidate.must_stop(self._clock()):
                await self.demote("could not renew within the renew deadline")

    # ----------------------------------------------------------------- loops

    def _begin_term(self, epoch: int, new_term: bool = True) -> None:
        """Start the loops in a task of their own: renews and the watchdog go on meanwhile
        (a rollout replay may take a while), and a demotion cancels the start."""
        self._starting = asyncio.create_task(self._lead(epoch, new_term), name=f"cp-start-loops-{epoch}")

    async def _lead(self, epoch: int, new_term: bool = True) -> None:
        """The `_starting` task of a term: start the loops (a cancel makes `start_loops` stop
        whatever it had started), then run them if the term still holds."""
        fenced = fenced_sessions(
            self.ctx.sessions, LEASE_NAME, epoch, on_fenced=self._fenced, hold_timeout_s=self.hold_timeout_s
        )
        leader_ctx = dataclasses.replace(
            self.ctx, sessions=fenced, epoch=epoch, on_wire_epoch=self._saw_wire_epoch
        )
        try:
            loops = await self._start_loops(leader_ctx)
        except Exception as err:
            await self._start_failed(epoch, err)
            return
        try:
            async with self._transition:
                if self._starting is asyncio.current_task():
                    self._starting = None
                if self.candidate.leading and self.candidate.epoch == epoch:
                    self.loops = loops if loops is not None else _NoLoops()  # loops deliberately off
                    self._start_failures = 0
                    self.leader_changes += new_term  # a raised epoch is the same leader
                    self._on_loops(loops)
                    self.ctx.kick()
                    return
        except asyncio.CancelledError:
            await self._stop(loops)  # demoted while taking the lock
            raise
        await self._stop(loops)  # demoted while starting

    async def _start_failed(self, epoch: int, err: Exception) -> None:
        """Leading without the loops helps nobody: step down, release the lease so another
        instance takes over at once, and stand again only after a backoff."""
        if self._starting is asyncio.current_task():
            self._starting = None  # done: the demotion must not cancel this task
        self._start_failures += 1
        backoff = min(self.lease_s * 4, self.retry_s * 2**self._start_failures)
        self._hold_off_until = self._clock() + backoff
        log.error(
            "starting the control loops of epoch %d failed (%s: %s); releasing the lease, standing again in %.1fs",
            epoch,
            type(err).__name__,
            err,
            backoff,
            exc_info=err,
        )
        if self.candidate.leading and self.candidate.epoch == epoch:
            await self.demote(f"the control loops failed to start: {err}", epoch=epoch)
            with contextlib.suppress(Exception):
                await self._db(self.store.release, self.member_id, epoch)

    async def demote(self, reason: str, timeout_s: float | None = None, epoch: int | None = None) -> None:
        """Stop leading; with `epoch`, only if we still lead by that epoch (a refusal from
        the loops of a term we already left, e.g. raised, must not end the new one)."""
        async with self._transition:
            if epoch is not None and self.candidate.epoch != epoch:
                return
            await self._demote(reason, timeout_s)
        self._wake.set()  # observe again at once (a successor, or a new term of ours)

    async def _demote(self, reason: str, timeout_s: float | None = None) -> None:
        """`demote` under the transition lock."""
        if not self.candidate.leading and self.loops is None and self._starting is None:
            return
        log.warning("no longer leading (epoch %d): %s", self.candidate.epoch, reason)
        self.last_demotion = reason
        self.candidate.lost()
        await self._end_term(timeout_s)

    async def _end_term(self, timeout_s: float | None = None) -> None:
        """Cancel a start in progress (it stops what it had started), then stop the loops."""
        starting, self._starting = self._starting, None
        if starting is not None and starting is not asyncio.current_task():
            starting.cancel()
            await asyncio.wait({starting}, timeout=timeout_s or self.stop_timeout_s)
        await self._stop_loops(timeout_s)

    # ----------------------------------------------------------------- epochs on the wire

    def _saw_wire_epoch(self, epoch: int, where: str) -> None:
        """From the loops (any thread): an epoch above ours seen on the wire."""
        loop = self._event_loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self.raise_floor(epoch, where)))

    async def raise_floor(self, wire_epoch: int, where: str) -> bool:
        """Lead again above `wire_epoch` if the database's lease is still ours and below it
        (it lost its history); demote if it moved on (a successor). True when raised. The
        database call runs outside the transition lock, so the watchdog is never held up."""
        async with self._raising:  # one at a time: a second sighting finds the epoch raised
            epoch = self.candidate.epoch
            if not self.candidate.leading or wire_epoch <= epoch:
                return False  # not leading, or already above it (a raise, or a late report)
            started = self._clock()
            try:
                raised = await asyncio.to_thread(self.store.raise_epoch, self.member_id, epoch, wire_epoch)
            except Exception as err:
                log.warning("raising the lease above epoch %d failed: %s", wire_epoch, err)
                return False  # the next sighting retries; the watchdog still guards the term
            starting = self._starting
            if starting is not None:  # the old term's loops end whole, not cut mid-start
                await asyncio.wait({starting})
            async with self._transition:
                if self.candidate.epoch != epoch:
                    return False  # demoted meanwhile: a raised lease of ours is taken anew
                if raised is None:
                    await self._demote(
                        f"epoch {wire_epoch} seen on the wire ({where}) while the lease of epoch "
                        f"{epoch} is no longer ours: a successor leads"
                    )
                    self._wake.set()
                    return False
                self.last_record = raised
                self.floor_raises += 1
                log.warning(
                    "epoch %d seen on the wire (%s) is above the database's lease epoch %d: the "
                    "database lost its history; leading again under epoch %d",
                    wire_epoch,
                    where,
                    epoch,
                    raised.epoch,
                )
                await self._end_term()  # fenced for good under the old epoch
                if not self.candidate.acquired(raised, started, self._clock()):
                    log.warning("the lease of epoch %d was raised too late to lead by it", raised.epoch)
                    return False
                self._begin_term(raised.epoch, new_term=False)
                return True

    async def _stop_loops(self, timeout_s: float | None = None) -> None:
        loops, self.loops = self.loops, None
        self._on_loops(None)
        await self._stop(loops, timeout_s)

    async def _stop(self, loops: object | None, timeout_s: float | None = None) -> None:
        stop = getattr(loops, "stop", None)
        if stop is None:
            return
        timeout_s = timeout_s or self.stop_timeout_s
        try:
            await asyncio.wait_for(stop(), timeout_s)
        except Exception:
            log.exception("stopping the control loops took over %.1fs or failed", timeout_s)

    def _fenced(self, refused: Fenced) -> None:
        """From a loop's thread: demote at once, whatever the loop does with the error."""
        loop = self._event_loop
        if loop is None or loop.is_closed():
            return
        if refused.epoch == self._fenced_epoch:
            return  # that term is already being ended: once per term, not per refused commit
        self._fenced_epoch = refused.epoch
        log.warning("%s", refused)
        loop.call_soon_threadsafe(lambda: loop.create_task(self.demote(str(refused), epoch=refused.epoch)))

    # ----------------------------------------------------------------- kicks

    def _forward_kick(self) -> None:
        """`ctx.kick()`: a follower tells the leader (from the event loop or any thread)."""
        link, loop = self.ctx.nats, self._event_loop
        if self.loops is not None or link is None or loop is None or loop.is_closed():
            return
        message = protocol.ControlPlaneKick(member=self.member_id)
        publish = link.publish(protocol.CONTROL_PLANE_KICK_SUBJECT, message)
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            loop.create_task(publish)
        else:
            asyncio.run_coroutine_threadsafe(publish, loop)

    async def _subscribe_kicks(self) -> None:
        link = self.ctx.nats
        if link is None or link.nc is None or id(link.nc) in self._subscribed:
            return
        self._subscribed.add(id(link.nc))
        await link.subscribe(protocol.CONTROL_PLANE_KICK_SUBJECT, self._on_kick_message)

    async def _on_kick_message(self, msg) -> None:
        if self.loops is None:
            return
        try:
            kick = protocol.ControlPlaneKick.from_bytes(msg.data)
        except Exception:
            return
        if kick.member != self.member_id:
            self.ctx.changed.set()
            self.ctx.keys_changed.set()


class _NoLoops:
    """Leading without control loops (deliberately: the loops module is absent): the API
    still records desired state, and `is_leader` still says who holds the lease."""

    async def stop(self) -> None:
        return None
