"""Publishing to the KV buckets of a real nats-server: only changes are written, the
generation only goes up (across control-plane restarts and a NATS that lost its store),
unwanted keys are deleted."""

from __future__ import annotations

import shutil

import pytest

from control_plane.local.nats_server import NatsServer
from control_plane.loops.publish import KvPublisher, bucket_items
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.nats_io import NatsLink
from fleet_base.protocol import (
    BUCKET_DESIRED,
    BUCKET_KEYS,
    BUCKET_ROUTES,
    ClusterRoute,
    DesiredState,
    Heartbeat,
    PoolInventory,
    ReplicaSpec,
    RoutingTable,
    heartbeat_subject,
)
from tests.polling import eventually


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


async def connected(url: str) -> NatsLink:
    link = NatsLink(url, "test-publisher", max_backoff_s=0.5)
    link.start()
    assert await link.wait_connected(10)
    return link


def wanted(replicas=("r1",), route_clusters=("a",), keys=("k1",)) -> dict:
    return {
        BUCKET_DESIRED: {
            "a": DesiredState(
                cluster="a",
                replicas=[
                    ReplicaSpec(replica_id=r, deployment="chat", version=1, model="m") for r in replicas
                ],
            ),
            "b": DesiredState(cluster="b"),
        },
        BUCKET_ROUTES: {
            "chat": RoutingTable(
                deployment="chat", clusters=[ClusterRoute(cluster=c) for c in route_clusters]
            )
        },
        BUCKET_KEYS: {k: ApiKeyRecord(key_id=k, name=k, salt="s", hash="h", created_at=1.0) for k in keys},
    }


async def items(link: NatsLink, bucket: str) -> dict[str, bytes]:
    return (await bucket_items(link, bucket))[0]


async def read(link: NatsLink, bucket: str, model):
    return {k: model.from_bytes(v) for k, v in (await items(link, bucket)).items()}


async def test_only_changes_are_written_with_rising_generations(nats_server):
    link = await connected(nats_server.url)
    try:
        pub = KvPublisher(link)
        assert await pub.publish(wanted())
        assert pub.puts == 4
        desired = await read(link, BUCKET_DESIRED, DesiredState)
        assert {k: [r.replica_id for r in d.replicas] for k, d in desired.items()} == {"a": ["r1"], "b": []}
        gen = {k: d.generation for k, d in desired.items()}
        assert min(gen.values()) >= 1
        assert await pub.publish(wanted())
        assert pub.puts == 4  # nothing changed, nothing written

        route_gen = (await read(link, BUCKET_ROUTES, RoutingTable))["chat"].generation
        assert await pub.publish(wanted(replicas=("r1", "r2"), route_clusters=(), keys=()))
        assert pub.puts == 6 and pub.deletes == 1
        desired = await read(link, BUCKET_DESIRED, DesiredState)
        assert desired["a"].generation > gen["a"] and desired["b"].generation == gen["b"]
        assert (await read(link, BUCKET_ROUTES, RoutingTable))["chat"].generation > route_gen
        assert await items(link, BUCKET_KEYS) == {}
        gen = {k: d.generation for k, d in desired.items()}

        # A new control plane process (new publisher): same content, nothing written;
        # a change continues above every generation the bucket has seen.
        pub2 = KvPublisher(link)
        assert await pub2.publish(wanted(replicas=("r1", "r2"), route_clusters=(), keys=()))
        assert pub2.puts == 0
        assert await pub2.publish(wanted(replicas=("r3",), route_clusters=(), keys=()))
        assert (await read(link, BUCKET_DESIRED, DesiredState))["a"].generation > gen["a"]
        gen["a"] = (await read(link, BUCKET_DESIRED, DesiredState))["a"].generation

        # Keys someone else left behind (a deleted deployment) are removed, and a key
        # lost while no control plane ran comes back with a higher generation than before.
        await link.kv_put(BUCKET_ROUTES, "ghost", RoutingTable(deployment="ghost"))
        await link.kv_delete(BUCKET_DESIRED, "a")
        pub3 = KvPublisher(link)
        assert await pub3.publish(wanted(replicas=("r3",), route_clusters=(), keys=()))
        assert "ghost" not in await items(link, BUCKET_ROUTES)
        desired = await read(link, BUCKET_DESIRED, DesiredState)
        assert [r.replica_id for r in desired["a"].replicas] == ["r3"] and desired["a"].generation > gen["a"]
        assert desired["b"].generation == gen["b"]
    finally:
        await link.close()


async def test_a_nats_that_lost_its_store_is_refilled_without_lowering_generations(nats_server, tmp_path):
    link = await connected(nats_server.url)
    try:
        pub = KvPublisher(link)
        link.on_connect(_async(pub.invalidate))
        for n in range(3):
            assert await pub.publish(wanted(replicas=tuple(f"r{i}" for i in range(n + 1))))
        before = {k: d.generation for k, d in (await read(link, BUCKET_DESIRED, DesiredState)).items()}

        nats_server.kill()
        shutil.rmtree(nats_server.store_dir)
        assert not await pub.publish(wanted(replicas=("x",)))  # down: nothing, no exception
        nats_server.start()
        assert await link.wait_connected(10)
        # the buckets are re-created by the reconnect
        await eventually(
            lambda: pub.publish(wanted(replicas=("x",))), 30, "a publish after the reconnect", 0.1
        )
        desired = await read(link, BUCKET_DESIRED, DesiredState)
        assert set(desired) == {"a", "b"}
        assert [r.replica_id for r in desired["a"].replicas] == ["x"]
        assert desired["a"].generation > before["a"] and desired["b"].generation > before["b"]
        assert set(await items(link, BUCKET_KEYS)) == {"k1"}
    finally:
        await link.close()


def _async(fn):
    async def wrapper():
        fn()

    return wrapper


async def test_loops_in_process_republish_after_nats_loses_its_store_and_keep_hearing(nats_server, tmp_path):
    """start_loops wiring: a deployment reaches fleet_desired; NATS restarts empty; the
    loops' on_connect re-reads the buckets and writes everything again, and heartbeats
    are still heard on the reconnected link."""
    from control_plane.context import ControlPlaneContext
    from control_plane.db import models as m
    from control_plane.db.session import make_sessions, upgrade_to_head
    from control_plane.loops import start_loops
    from control_plane.settings import Settings

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    upgrade_to_head(url)
    sessions = make_sessions(url)
    with sessions() as s:
        d = m.Deployment(name="chat", replicas=1, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model="tiny")]
        s.add(d)
        s.commit()
    link = NatsLink(nats_server.url, "control-plane", max_backoff_s=0.5)
    ctx = ControlPlaneContext(
        settings=Settings(home=tmp_path, reconcile_interval_s=0.5), sessions=sessions, nats=link
    )
    link.start()
    loops = await start_loops(ctx)
    probe = await connected(nats_server.url)
    try:
        hb = Heartbeat(cluster="c1", pools=[PoolInventory(name="cpu", gpu_model="cpu", gpus_per_node=2)])

        async def chat_on_c1() -> DesiredState | None:
            await probe.publish(heartbeat_subject("c1"), hb)
            try:
                raw = await probe.kv_get(BUCKET_DESIRED, "c1")
            except Exception:  # the probe's own reconnect (timeouts, bucket not there yet)
                return None
            d = DesiredState.from_bytes(raw) if raw else None
            return d if d and [r.deployment for r in d.replicas] == ["chat"] else None

        first = await eventually(chat_on_c1, 30, "chat desired on c1", 0.2)

        nats_server.kill()
        shutil.rmtree(nats_server.store_dir)
        nats_server.start()
        again = await eventually(chat_on_c1, 30, "chat desired on c1 again", 0.2)
        assert again.replicas == first.replicas and again.generation > first.generation
        assert (await read(probe, BUCKET_ROUTES, RoutingTable))["chat"].clusters[0].cluster == "c1"

        with sessions() as s:  # heartbeats after the reconnect still land
            seen = s.get(m.Cluster, "c1").last_heartbeat_at
        hb2 = Heartbeat(cluster="c1", pools=hb.pools, queue_depth=7)

        async def heard() -> bool:
            """hb2 landed in the database; else publish it (again: the link may be reconnecting)."""
            with sessions() as s:
                c = s.get(m.Cluster, "c1")
                if c.last_heartbeat_at > seen and c.load.get("queue_depth") == 7:
                    return True
            await probe.publish(heartbeat_subject("c1"), hb2)
            return False

        await eventually(heard, 30, "heartbeats heard after the reconnect", 0.1)
    finally:
        await loops.stop()
        await probe.close()
        await link.close()
        sessions.kw["bind"].dispose()


async def test_bucket_items_lists_live_keys_without_the_keys_watcher(nats_server):
    """Many rounds of put/put/delete: nats-py's keys() sometimes answers "no keys" here."""
    link = await connected(nats_server.url)
    try:
        assert await bucket_items(link, BUCKET_ROUTES) == ({}, 0)
        for i in range(40):
            await link.kv_put(BUCKET_ROUTES, "b", RoutingTable(deployment="b", generation=i))
            await link.kv_put(BUCKET_ROUTES, "a", RoutingTable(deployment="a", generation=i))
            await link.kv_delete(BUCKET_ROUTES, "a")
            live, last_seq = await bucket_items(link, BUCKET_ROUTES)
            assert set(live) == {"b"} and last_seq == 3 * (i + 1)
            assert RoutingTable.from_bytes(live["b"]).generation == i
    finally:
        await link.close()


async def epochs(link: NatsLink) -> dict[str, dict[str, int]]:
    models = {BUCKET_DESIRED: DesiredState, BUCKET_ROUTES: RoutingTable, BUCKET_KEYS: ApiKeyRecord}
    return {b: {k: v.epoch for k, v in (await read(link, b, m)).items()} for b, m in models.items()}


async def test_every_value_carries_the_epoch_and_a_new_epoch_rewrites_every_key(nats_server):
    link = await connected(nats_server.url)
    try:
        old = KvPublisher(link, epoch=3)
        assert await old.publish(wanted())
        assert await epochs(link) == {
            BUCKET_DESIRED: {"a": 3, "b": 3},
            BUCKET_ROUTES: {"chat": 3},
            BUCKET_KEYS: {"k1": 3},
        }
        assert await old.publish(wanted()) and old.puts == 4  # unchanged: nothing written
        # its own writes (deletes included) do not make it re-read the buckets
        assert await old.publish(wanted(replicas=("r1", "r2"), keys=()))
        assert await old.publish(wanted(keys=("k1", "k2")))
        assert await old.publish(wanted())
        assert old.loads == 1 and old.conflicts == 0
        before = {k: d.generation for k, d in (await read(link, BUCKET_DESIRED, DesiredState)).items()}

        new = KvPublisher(link, epoch=4)  # same content, a new leader: every key again
        assert await new.publish(wanted())
        assert new.puts == 4
        assert {k for b in (await epochs(link)).values() for k in b.values()} == {4}
        after = await read(link, BUCKET_DESIRED, DesiredState)
        assert all(after[k].generation > before[k] for k in before)
        assert await new.publish(wanted()) and new.puts == 4
    finally:
        await link.close()


async def test_a_paused_old_leader_that_wakes_writes_nothing(nats_server):
    """The old leader (epoch 1) wakes after its successor (epoch 2) published: it sees the
    buckets moved, re-reads them, finds epoch 2 and writes and deletes nothing."""
    link = await connected(nats_server.url)
    try:
        old = KvPublisher(link, epoch=1)
        assert await old.publish(wanted(replicas=("r1",), keys=("k1", "k2")))
        new = KvPublisher(link, epoch=2)
        assert await new.publish(wanted(replicas=("r2",), keys=("k1",)))
        after_new = {b: await items(link, b) for b in (BUCKET_DESIRED, BUCKET_ROUTES, BUCKET_KEYS)}

        puts, deletes = old.puts, old.deletes
        for _ in range(2):
            assert not await old.publish(wanted(replicas=("old",), route_clusters=(), keys=("k2", "k9")))
        assert all(old.fenced(b) for b in (BUCKET_DESIRED, BUCKET_ROUTES, BUCKET_KEYS))
        assert (old.puts, old.deletes) == (puts, deletes)
        assert {b: await items(link, b) for b in after_new} == after_new
        assert await new.publish(wanted(replicas=("r2",), keys=("k1",))) and new.puts == 4
    finally:
        await link.close()


async def test_an_old_leader_racing_its_successor_is_fenced_and_repaired(nats_server):
    """The successor publishes right after the old leader checked the buckets: the old
    one's compare-and-set writes and deletes lose and fence it; the key it creates (nobody
    to race) is deleted by the successor's next publish, which sees the bucket moved."""
    link = await connected(nats_server.url)
    try:
        old = KvPublisher(link, epoch=1)
        assert await old.publish(wanted(replicas=("r1",), keys=("k1", "k2")))
        new = KvPublisher(link, epoch=2)
        real_moved = old._moved

        async def successor_publishes_now() -> bool:
            moved = await real_moved()
            assert await new.publish(wanted(replicas=("r2",), keys=("k1", "k2")))
            return moved

        old._moved = successor_publishes_now
        stale = wanted(replicas=("old",), route_clusters=(), keys=("k1", "k9"))
        assert not await old.publish(stale)
        assert old.fenced(BUCKET_DESIRED) and old.fenced(BUCKET_ROUTES) and old.conflicts >= 2
        desired = await read(link, BUCKET_DESIRED, DesiredState)
        assert [r.replica_id for r in desired["a"].replicas] == ["r2"] and desired["a"].epoch == 2
        assert (await read(link, BUCKET_ROUTES, RoutingTable))["chat"].clusters[0].cluster == "a"
        keys = await read(link, BUCKET_KEYS, ApiKeyRecord)
        assert {k: v.epoch for k, v in keys.items()} == {"k1": 2, "k2": 2, "k9": 1}  # its delete of k2 lost
        assert old.fenced(BUCKET_KEYS)

        assert await new.publish(wanted(replicas=("r2",), keys=("k1", "k2")))
        assert await epochs(link) == {
            BUCKET_DESIRED: {"a": 2, "b": 2},
            BUCKET_ROUTES: {"chat": 2},
            BUCKET_KEYS: {"k1": 2, "k2": 2},
        }
    finally:
        await link.close()


async def test_the_successor_writes_over_a_stale_write_that_races_its_compare_and_set(nats_server):
    link = await connected(nats_server.url)
    try:
        new = KvPublisher(link, epoch=2)
        assert await new.publish(wanted(replicas=("r2",)))
        real_moved = new._moved

        async def stale_write_now() -> bool:  # lands after the successor's check
            moved = await real_moved()
            await link.kv_put(BUCKET_DESIRED, "a", DesiredState(cluster="a", epoch=1, generation=10**6))
            return moved

        new._moved = stale_write_now
        assert await new.publish(wanted(replicas=("r3",)))
        assert new.conflicts == 1 and not new.fenced(BUCKET_DESIRED)
        desired = (await read(link, BUCKET_DESIRED, DesiredState))["a"]
        assert [r.replica_id for r in desired.replicas] == ["r3"] and desired.epoch == 2
        assert desired.generation > 10**6  # above every generation the bucket has seen
    finally:
        await link.close()


def test_the_loops_publish_under_the_contexts_epoch(tmp_path):
    from control_plane.context import ControlPlaneContext
    from control_plane.loops import Loops
    from control_plane.loops.keys import KeyLoop
    from control_plane.settings import Settings

    link = NatsLink("nats://127.0.0.1:1", "unused")
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path), sessions=None, nats=link, epoch=7)  # type: ignore[arg-type]
    assert Loops(ctx).publisher.epoch == 7
    assert KeyLoop(ctx).publisher.epoch == 7


class PublishingLoops:
    """A leader's loops that publish under their context's epoch and report newer ones, as
    `control_plane.loops.Loops` does."""

    def __init__(self, ctx, link: NatsLink) -> None:
        self.ctx = ctx
        self.publisher = KvPublisher(link, epoch=ctx.epoch, on_newer_epoch=ctx.saw_epoch)
        self.published: bool | None = None
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True


def _elector(sessions, link: NatsLink, terms: list, replicas=("r2",)):
    from control_plane.context import ControlPlaneContext
    from control_plane.ha.elector import Elector
    from control_plane.settings import Settings

    async def start_loops(ctx):
        loops = PublishingLoops(ctx, link)
        terms.append(loops)
        loops.published = await loops.publisher.publish(wanted(replicas=replicas))
        return loops

    settings = Settings(leader_lease_s=15.0, leader_renew_deadline_s=10.0, leader_retry_s=5.0)
    return Elector(ControlPlaneContext(settings=settings, sessions=sessions), start_loops, member_id="a")


def _agent_fence_after(seen: dict[str, dict[str, int]]):
    """An agent's fence (agent.fencing) that obeyed every value in `seen`."""
    from agent.fencing import EpochFence

    fence = EpochFence()
    for bucket, values in seen.items():
        for key, epoch in values.items():
            assert fence.admits(bucket, key, epoch)
    return fence


async def test_a_fresh_databases_leader_publishes_above_the_epoch_the_buckets_hold(nats_server, sessions):
    """The buckets and agents hold epoch 7; a fresh database's leader gets epoch 1: its
    publisher is fenced, the leader raises the lease to 8 and publishes under it, and
    agents take it."""
    from control_plane.ha.lease_store import LeaseStore

    link = await connected(nats_server.url)
    terms: list[PublishingLoops] = []
    elector = None
    try:
        assert await KvPublisher(link, epoch=7).publish(wanted())  # the fleet's history
        fence = _agent_fence_after(await epochs(link))
        elector = await _elector(sessions, link, terms).start()
        await eventually(lambda: elector.epoch == 8 and len(terms) == 2 and terms[1].published is not None)
        assert terms[0].published is False and terms[0].stopped and terms[0].ctx.epoch == 1
        assert all(terms[0].publisher.fenced(b) for b in (BUCKET_DESIRED, BUCKET_ROUTES, BUCKET_KEYS))
        assert terms[1].published and terms[1].ctx.epoch == 8 and not terms[1].stopped
        assert elector.is_leader and elector.floor_raises == 1
        lease = LeaseStore(sessions).read()
        assert (lease.holder, lease.epoch) == ("a", 8)
        now = await epochs(link)
        assert {e for values in now.values() for e in values.values()} == {8}
        assert [r.replica_id for r in (await read(link, BUCKET_DESIRED, DesiredState))["a"].replicas] == [
            "r2"
        ]
        for bucket, values in now.items():
            assert all(fence.admits(bucket, key, epoch) for key, epoch in values.items())
            assert fence.epoch(bucket) == 8
        assert not fence.admits(BUCKET_DESIRED, "a", 7)  # and the old epochs are refused now
    finally:
        if elector is not None:
            await elector.stop()
        await link.close()


async def test_a_stale_leader_under_a_live_successors_epoch_demotes(nats_server, sessions):
    """The database holds epoch 9 (a successor acquired it) and so do the buckets: the old
    leader of epoch 1 is fenced and steps down; nothing is raised, nothing it wants lands."""
    from sqlalchemy import update

    from control_plane.db.models import ControlPlaneLease
    from control_plane.ha import LEASE_NAME
    from control_plane.ha.lease_store import LeaseStore

    link = await connected(nats_server.url)
    terms: list[PublishingLoops] = []
    elector = None
    try:
        elector = await _elector(sessions, link, terms, replicas=("old",)).start()
        assert elector.epoch == 1 and terms[0].published
        with sessions() as session:  # the successor's acquire, in a database with history
            session.execute(
                update(ControlPlaneLease)
                .where(ControlPlaneLease.name == LEASE_NAME)
                .values(holder="b", epoch=9)
            )
            session.commit()
        assert await KvPublisher(link, epoch=9).publish(wanted(replicas=("new",)))
        assert not await terms[0].publisher.publish(wanted(replicas=("old", "older")))
        await eventually(lambda: terms[0].stopped)
        assert not elector.is_leader and len(terms) == 1 and elector.floor_raises == 0
        assert "successor" in elector.last_demotion
        lease = LeaseStore(sessions).read()
        assert (lease.holder, lease.epoch) == ("b", 9)
        seen = await epochs(link)
        assert {e for values in seen.values() for e in values.values()} == {9}
        assert [r.replica_id for r in (await read(link, BUCKET_DESIRED, DesiredState))["a"].replicas] == [
            "new"
        ]
        fence = _agent_fence_after(seen)
        assert not fence.admits(BUCKET_DESIRED, "a", 1)
    finally:
        if elector is not None:
            await elector.stop()
        await link.close()


def test_an_agents_fence_above_the_leaders_epoch_reaches_the_elector(tmp_path):
    from control_plane.context import ControlPlaneContext
    from control_plane.loops import Loops
    from control_plane.settings import Settings

    heard: list[tuple[int, str]] = []
    link = NatsLink("nats://127.0.0.1:1", "unused")
    ctx = ControlPlaneContext(
        settings=Settings(home=tmp_path),
        sessions=None,  # type: ignore[arg-type]
        nats=link,
        epoch=1,
        on_wire_epoch=lambda epoch, where: heard.append((epoch, where)),
    )
    loops = Loops(ctx)
    loops._take_heartbeat(Heartbeat(cluster="c1", fence_epoch=1))
    loops._take_heartbeat(Heartbeat(cluster="c2"))  # an agent from before fencing: 0
    assert heard == []
    loops._take_heartbeat(Heartbeat(cluster="c3", fence_epoch=7))
    assert heard == [(7, "agent c3")]
    assert loops.publisher.on_newer_epoch == ctx.saw_epoch
