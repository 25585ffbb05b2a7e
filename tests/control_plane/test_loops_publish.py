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
