"""The elector in one process, on SQLite, with fake loops and short timings: a lone
instance leads at once, a clean shutdown hands over at once, a leader that cannot renew
stops its loops before the lease could expire, a fenced commit demotes at once, and a
follower's kick reaches the leader."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from control_plane.context import ControlPlaneContext
from control_plane.db.models import TeamBudget
from control_plane.ha.elector import Elector
from control_plane.ha.fencing import Fenced
from control_plane.ha.lease_store import LeaseStore
from control_plane.settings import Settings
from fleet_base import protocol

LEASE, DEADLINE, RETRY = 1.5, 1.0, 0.15


class FakeLoops:
    def __init__(self, ctx: ControlPlaneContext) -> None:
        self.ctx = ctx
        self.started_at = time.monotonic()
        self.stopped_at: float | None = None

    async def stop(self) -> None:
        self.stopped_at = time.monotonic()


class Started:
    """A `start_loops` that records every start."""

    def __init__(self) -> None:
        self.loops: list[FakeLoops] = []

    async def __call__(self, ctx: ControlPlaneContext) -> FakeLoops:
        self.loops.append(FakeLoops(ctx))
        return self.loops[-1]


def _ctx(sessions, nats=None) -> ControlPlaneContext:
    settings = Settings(leader_lease_s=LEASE, leader_renew_deadline_s=DEADLINE, leader_retry_s=RETRY)
    return ControlPlaneContext(settings=settings, sessions=sessions, nats=nats)


async def _until(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def _take(store: LeaseStore, lease_s: float) -> int:
    """The intruder takes the lease (its compare-and-set retried while a candidate moves
    it); the epoch it took."""
    won: list[int] = []

    def attempt() -> bool:
        record = store.acquire("intruder", store.read(), lease_s)
        if record is not None:
            won.append(record.epoch)
        return record is not None

    await _until(attempt)
    return won[0]


async def test_a_lone_instance_leads_at_once_with_a_fenced_context(sessions):
    ctx, started, seen = _ctx(sessions), Started(), []
    elector = await Elector(ctx, started, url="http://a", on_loops=seen.append).start()
    try:
        assert elector.is_leader and elector.epoch == 1 and elector.leader_changes == 1
        loops = started.loops[0]
        assert seen == [loops] and elector.loops is loops
        assert loops.ctx.epoch == 1 and loops.ctx.sessions is not ctx.sessions
        assert loops.ctx.changed is ctx.changed and loops.ctx.keys_changed is ctx.keys_changed
        assert [m.url for m in LeaseStore(sessions).members()] == ["http://a"]
        await asyncio.sleep(2 * LEASE)  # renews keep it
        assert elector.is_leader and elector.epoch == 1 and len(started.loops) == 1
    finally:
        await elector.stop()
    assert loops.stopped_at is not None and seen[-1] is None
    lease = LeaseStore(sessions).read()
    assert lease.holder is None and lease.epoch == 1  # released
    assert LeaseStore(sessions).members() == []


async def test_a_first_acquire_that_times_out_is_retried_before_start_returns(sessions):
    started, calls = Started(), []
    a = Elector(_ctx(sessions), started, member_id="a")
    real_acquire = a.store.acquire

    def slow_once(*args):
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(a.call_timeout_s + 0.2)  # written, but answered after the call's timeout
        return real_acquire(*args)

    a.store.acquire = slow_once
    await a.start()
    try:
        assert len(calls) == 2 and a.is_leader  # whichever write of the two won the lease
        assert a.leader_changes == 1 and len(started.loops) == 1
    finally:
        await a.stop()


async def test_a_clean_shutdown_hands_over_at_once_and_the_follower_waits_otherwise(sessions):
    a_loops, b_loops = Started(), Started()
    a = await Elector(_ctx(sessions), a_loops, member_id="a").start()
    b = await Elector(_ctx(sessions), b_loops, member_id="b").start()
    try:
        await asyncio.sleep(LEASE)
        assert a.is_leader and not b.is_leader and b.loops is None and b_loops.loops == []
        began = time.monotonic()
        await a.stop()
        await _until(lambda: b.is_leader)
        assert time.monotonic() - began < LEASE  # released: no waiting out the lease
        assert b.epoch == 2 and b_loops.loops[0].ctx.epoch == 2
    finally:
        await a.stop()
        await b.stop()


async def test_a_leader_that_cannot_renew_stops_before_its_lease_could_expire(sessions):
    started = Started()
    a = await Elector(_ctx(sessions), started, member_id="a").start()
    b_started = Started()
    b = await Elector(_ctx(sessions), b_started, member_id="b").start()
    try:
        real_store = a.store

        class Unreachable:
            def __getattr__(self, _name):
                def fail(*_args):
                    raise OSError("database unreachable")

                return fail

        a.store = Unreachable()
        # `is_leader` turns false at the renew deadline on the clock alone; the watchdog
        # that stops the loops may run a moment later on a loaded box.
        await _until(lambda: started.loops[0].stopped_at is not None)
        stopped = started.loops[0].stopped_at
        assert not a.is_leader and a.loops is None
        await _until(lambda: b.is_leader)  # b waited the lease out on its own clock
        assert b.epoch == 2
        assert stopped < b_started.loops[0].started_at  # a's loops stopped before b's started
        a.store = real_store
        await asyncio.sleep(3 * RETRY)
        assert not a.is_leader and b.is_leader  # a follows now
    finally:
        await a.stop()
        await b.stop()


async def test_a_fenced_commit_demotes_at_once(sessions):
    started = Started()
    a = await Elector(_ctx(sessions), started, member_id="a").start()
    try:
        a._tasks[0].cancel()  # no more election rounds: only the fenced commit or the watchdog can demote
        await a.step()  # a fresh renew: the watchdog's deadline is DEADLINE away
        store = LeaseStore(sessions)
        store.acquire("intruder", store.read(), 60.0)  # a takeover a does not know of yet
        leader_sessions = started.loops[0].ctx.sessions

        def write() -> None:
            with leader_sessions() as session:
                session.add(TeamBudget(team="fenced", monthly_dollars=1.0, thresholds=[1.0], alerted={}))
                session.commit()

        try:
            await asyncio.to_thread(write)
        except Fenced:
            pass
        else:
            raise AssertionError("the commit was not fenced")
        await _until(lambda: started.loops[0].stopped_at is not None)
        assert not a.is_leader and a.loops is None
        assert a.last_demotion.startswith("fenced")  # not the watchdog
        with sessions() as session:
            assert session.get(TeamBudget, "fenced") is None
    finally:
        await a.stop()


class FakeLink:
    """The parts of NatsLink the elector uses: core publish and subscribe, all on one bus."""

    def __init__(self, bus: list) -> None:
        self.bus = bus
        self.nc = object()
        self.is_connected = True
        self.published: list[str] = []
        bus.append(self)
        self.handlers: dict[str, object] = {}

    def on_connect(self, _callback) -> None:
        pass

    async def subscribe(self, subject: str, cb) -> None:
        self.handlers[subject] = cb

    async def publish(self, subject: str, message: protocol.Message) -> bool:
        self.published.append(subject)
        for link in self.bus:
            handler = link.handlers.get(subject)
            if handler is not None:
                await handler(SimpleNamespace(subject=subject, data=message.to_bytes()))
        return True


async def test_a_followers_kick_wakes_the_leader(sessions):
    bus: list = []
    leader_ctx, follower_ctx = _ctx(sessions, FakeLink(bus)), _ctx(sessions, FakeLink(bus))
    a = await Elector(leader_ctx, Started(), member_id="a").start()
    b = await Elector(follower_ctx, Started(), member_id="b").start()
    try:
        assert a.is_leader and not b.is_leader
        leader_ctx.changed.clear()
        leader_ctx.kick()  # the leader's own kicks stay local
        assert leader_ctx.nats.published == []
        leader_ctx.changed.clear()
        follower_ctx.kick()  # an API write on the follower
        await _until(lambda: leader_ctx.changed.is_set())
        assert follower_ctx.nats.published == [protocol.CONTROL_PLANE_KICK_SUBJECT]
    finally:
        await b.stop()
        await a.stop()


def test_no_cluster_identity_may_use_the_kick_subject():
    from fleet_base.subjects import permits

    for role in ("agent", "gateway"):
        allowed = permits(role, "c1")
        assert not allowed.may("publish", protocol.CONTROL_PLANE_KICK_SUBJECT)
        assert not allowed.may("subscribe", protocol.CONTROL_PLANE_KICK_SUBJECT)


async def test_a_kick_from_another_thread_is_forwarded_too(sessions):
    bus: list = []
    leader_ctx, follower_ctx = _ctx(sessions, FakeLink(bus)), _ctx(sessions, FakeLink(bus))
    a = await Elector(leader_ctx, Started(), member_id="a").start()
    b = await Elector(follower_ctx, Started(), member_id="b").start()
    try:
        leader_ctx.changed.clear()
        await asyncio.to_thread(follower_ctx.kick)
        await _until(lambda: leader_ctx.changed.is_set())
    finally:
        await b.stop()
        await a.stop()


def _fenced_write(leader_sessions) -> None:
    with leader_sessions() as session:
        session.add(TeamBudget(team="fenced", monthly_dollars=1.0, thresholds=[1.0], alerted={}))
        session.commit()


async def test_an_epoch_on_the_wire_above_a_fresh_databases_lease_is_led_above(sessions):
    """A fresh database gave epoch 1; a bucket holds 7: the leader takes 8 and restarts its
    loops under it; later sightings of 7 and the old term's fenced commits change nothing."""
    started = Started()
    a = await Elector(_ctx(sessions), started, member_id="a").start()
    try:
        assert a.epoch == 1
        started.loops[0].ctx.saw_epoch(7, "bucket fleet_desired")
        await _until(lambda: a.epoch == 8 and a.loops is not None and len(started.loops) == 2)
        assert started.loops[0].stopped_at is not None and started.loops[1].ctx.epoch == 8
        assert LeaseStore(sessions).read().holder == "a" and LeaseStore(sessions).read().epoch == 8
        assert a.floor_raises == 1 and a.leader_changes == 1 and a.last_record.epoch == 8
        assert not await a.raise_floor(7, "agent c1")  # a late report of the same floor
        started.loops[1].ctx.saw_epoch(8, "agent c1")  # our own epoch: nothing to do
        try:
            await asyncio.to_thread(_fenced_write, started.loops[0].ctx.sessions)
        except Fenced:
            pass
        else:
            raise AssertionError("the old term's commit was not fenced")
        await asyncio.sleep(2 * LEASE)  # renews keep epoch 8; the old term's refusal did not demote
        assert a.is_leader and a.epoch == 8 and len(started.loops) == 2 and a.floor_raises == 1
    finally:
        await a.stop()


async def test_an_epoch_on_the_wire_of_a_live_successor_demotes(sessions):
    """The database holds the wire's epoch (a successor with history acquired it): no raise."""
    from sqlalchemy import update

    from control_plane.db.models import ControlPlaneLease
    from control_plane.ha import LEASE_NAME

    started = Started()
    a = await Elector(_ctx(sessions), started, member_id="a").start()
    try:
        a._tasks[0].cancel()  # no election rounds: only the wire's epoch can demote
        await a.step()
        with sessions() as session:
            session.execute(
                update(ControlPlaneLease)
                .where(ControlPlaneLease.name == LEASE_NAME)
                .values(holder="b", epoch=9)
            )
            session.commit()
        started.loops[0].ctx.saw_epoch(9, "agent c1")
        await _until(lambda: started.loops[0].stopped_at is not None)
        assert not a.is_leader and a.loops is None and len(started.loops) == 1
        assert "epoch 9 seen on the wire (agent c1)" in a.last_demotion and "successor" in a.last_demotion
        assert a.floor_raises == 0
        lease = LeaseStore(sessions).read()
        assert (lease.holder, lease.epoch) == ("b", 9)
    finally:
        await a.stop()


async def test_loops_that_fail_to_start_release_the_lease_to_another_instance(sessions):
    attempts: list[float] = []

    async def broken(_ctx: ControlPlaneContext) -> FakeLoops:
        attempts.append(time.monotonic())
        raise RuntimeError("rollout replay failed")

    a = await Elector(_ctx(sessions), broken, member_id="a").start()
    b_started = Started()
    b = None
    try:
        assert not a.is_leader and a.loops is None and not a.candidate.leading
        assert "failed to start" in a.last_demotion
        lease = LeaseStore(sessions).read()
        assert lease.holder is None and lease.epoch == 1  # released: no waiting out the lease
        b = await Elector(_ctx(sessions), b_started, member_id="b").start()
        assert b.is_leader and b.epoch == 2  # at once
        await asyncio.sleep(4 * RETRY)
        assert len(attempts) == 1  # a backs off and then follows b
    finally:
        await a.stop()
        if b is not None:
            await b.stop()


async def test_a_failed_start_is_retried_after_a_backoff(sessions):
    attempts: list[float] = []
    started = Started()

    async def flaky(ctx: ControlPlaneContext) -> FakeLoops:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise RuntimeError("database blip")
        return await started(ctx)

    a = await Elector(_ctx(sessions), flaky, member_id="a").start()
    try:
        await _until(lambda: a.is_leader)
        assert len(attempts) == 2 and attempts[1] - attempts[0] >= 2 * RETRY  # backed off
        assert a.epoch == 2 and started.loops[0].ctx.epoch == 2
    finally:
        await a.stop()


async def test_renews_go_on_while_the_loops_start_and_a_demotion_cancels_the_start(sessions):
    release = asyncio.Event()
    cancelled: list[int] = []

    async def slow(ctx: ControlPlaneContext) -> FakeLoops:
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(ctx.epoch)
            raise
        return FakeLoops(ctx)

    store = LeaseStore(sessions)
    a = Elector(_ctx(sessions), slow, member_id="a")
    starting = asyncio.create_task(a.start())
    try:
        await _until(lambda: a.candidate.leading)
        first = a.candidate.epoch  # 1, or more where a first acquire timed out on a loaded machine
        await asyncio.sleep(2 * DEADLINE)  # longer than the renew deadline, still starting
        assert a.candidate.leading and a.candidate.epoch == first and store.read().version > 2
        release.set()
        await starting  # returns before leading where its one round's acquire timed out
        await _until(lambda: a.is_leader)
        assert a.epoch == first and a.leader_changes == 1

        release.clear()
        await a.demote("test: a new term")
        # Its lease soon runs out: a takes it over. a may first re-take its own stale lease
        # (a round already in flight): the intruder's compare-and-set then retries.
        taken = await _take(store, 0.5)
        await _until(lambda: a.candidate.leading and a.candidate.epoch == taken + 1)
        assert not a.is_leader  # starting
        await _take(store, 60.0)  # a's renew is refused: a demotes
        await _until(lambda: taken + 1 in cancelled)
        assert cancelled[-1] == taken + 1 and all(e > first for e in cancelled)
        assert not a.candidate.leading and a.loops is None and a._starting is None
    finally:
        release.set()
        await a.stop()


async def test_a_batch_of_fenced_commits_demotes_once_and_an_older_terms_refusal_not_at_all(sessions):
    started = Started()
    a = await Elector(_ctx(sessions), started, member_id="a").start()
    demotions: list[str] = []
    real_demote = a.demote

    async def counting(reason: str, timeout_s=None, epoch=None) -> None:
        demotions.append(reason)
        await real_demote(reason, timeout_s, epoch)

    a.demote = counting
    try:
        a._fenced(Fenced(0, 1))  # a refusal from a term before ours: ignored
        await asyncio.sleep(0.1)
        assert a.is_leader and a.epoch == 1
        for _ in range(5):
            a._fenced(Fenced(1, 2))  # one batch, five refused commits
        await _until(lambda: a.epoch == 2)  # term 1 ended; a took the stale lease of its own anew
        await asyncio.sleep(0.1)
        assert demotions == [str(Fenced(1, 2))] and started.loops[0].stopped_at is not None
    finally:
        await a.stop()


async def test_a_follower_dates_a_lease_change_by_the_end_of_the_read_that_saw_it(sessions):
    now = [100.0]
    store = LeaseStore(sessions)
    store.acquire("x", store.read(), 60.0)

    class SlowRead:
        def __init__(self, real: LeaseStore) -> None:
            self.real = real

        def read(self):
            record = self.real.read()
            now[0] += 5.0  # a slow read: the record was current at its end, not its start
            return record

        def __getattr__(self, name):
            return getattr(self.real, name)

    a = Elector(_ctx(sessions), Started(), member_id="a", clock=lambda: now[0])
    a.store = SlowRead(a.store)
    await a.step()
    assert not a.candidate.leading and a.candidate._seen_at == 105.0
    if a._beating is not None:
        await a._beating


async def test_a_stuck_member_heartbeat_does_not_hold_up_the_renew(sessions):
    import threading

    started = Started()
    a = await Elector(_ctx(sessions), started, member_id="a").start()
    stuck = threading.Event()
    try:
        real = a.store.heartbeat
        a.store.heartbeat = lambda *_args: stuck.wait(10)
        version = LeaseStore(sessions).read().version
        await asyncio.sleep(2 * LEASE)
        assert a.is_leader and a.epoch == 1 and len(started.loops) == 1
        assert LeaseStore(sessions).read().version > version + 3  # renewed all along
    finally:
        stuck.set()
        a.store.heartbeat = real
        await a.stop()
