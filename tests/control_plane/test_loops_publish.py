"""Publishing to the KV buckets of a real nats-server: only changes are written, the
generation only goes up (across control-plane restarts and a NATS that lost its store),
unwanted keys are deleted."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from agent.nats_io import NatsLink
from agent.protocol import (
    BUCKET_DESIRED,
    BUCKET_KEYS,
    BUCKET_ROUTES,
    ApiKeyRecord,
    ClusterRoute,
    DesiredState,
    ReplicaSpec,
    RoutingTable,
)
from control_plane.local.nats_server import NatsServer
from control_plane.loops.publish import KvPublisher


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


async def read(link: NatsLink, bucket: str, model):
    return {k: model.from_bytes(v) for k, v in (await link.kv_items(bucket)).items()}


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
        assert await link.kv_items(BUCKET_KEYS) == {}
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
        assert "ghost" not in await link.kv_items(BUCKET_ROUTES)
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
        for _ in range(50):  # the buckets are re-created by the reconnect
            if await pub.publish(wanted(replicas=("x",))):
                break
            await asyncio.sleep(0.1)
        desired = await read(link, BUCKET_DESIRED, DesiredState)
        assert set(desired) == {"a", "b"}
        assert [r.replica_id for r in desired["a"].replicas] == ["x"]
        assert desired["a"].generation > before["a"] and desired["b"].generation > before["b"]
        assert set(await link.kv_items(BUCKET_KEYS)) == {"k1"}
    finally:
        await link.close()


def _async(fn):
    async def wrapper():
        fn()

    return wrapper
