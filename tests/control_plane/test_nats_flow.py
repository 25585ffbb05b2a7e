"""Deploy, failover and restart end to end with real processes: a real nats-server, a real
control plane (`python -m control_plane`), deployments made with `fleetctl`, and three
simulated agents (a test client of NATS) that heart-beat their pools and report the
replicas they are told to run as ready.

deploy -> the right clusters' `fleet_desired` keys hold the right replicas and
`fleet_routes` lists them; a cluster that stops heart-beating becomes unhealthy, its
replicas move to the others and its routes go; a control-plane restart republishes
what NATS lost and keeps generations rising."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import Counter

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from control_plane.local.nats_server import NatsServer
from fleet_base.domain import Coordinates, Tier
from fleet_base.protocol import (
    BUCKET_DESIRED,
    BUCKET_ROUTES,
    DesiredState,
    Heartbeat,
    PoolInventory,
    ReplicaState,
    ReplicaStatus,
    RoutingTable,
    heartbeat_subject,
)
from tests.control_plane.cp_server import ControlPlaneServer
from tests.fleetctl import fleetctl_json
from tests.polling import eventually

BEAT_S = 0.25
CLUSTERS = {
    # id: (region, coordinates, pools)
    "east": (
        "us-east",
        (40.7, -74.0),
        [PoolInventory(name="cpu", gpu_model="cpu", gpus_per_node=4, hourly_price=2)],
    ),
    "west": (
        "us-west",
        (37.8, -122.4),
        [PoolInventory(name="cpu", gpu_model="cpu", gpus_per_node=4, hourly_price=2)],
    ),
    "gpu": (
        "eu-west",
        (50.1, 8.7),
        [
            PoolInventory(
                name="a100",
                gpu_model="A100",
                gpu_memory_gb=80,
                gpus_per_node=8,
                tier=Tier.spot,
                hourly_price=20,
            )
        ],
    ),
}


class SimAgent:
    """Heart-beats like an agent: its pools, and every replica of its desired state as ready."""

    def __init__(self, nc, kv, cluster: str) -> None:
        self.nc, self.kv, self.cluster = nc, kv, cluster
        region, (lat, lon), pools = CLUSTERS[cluster]
        self.region, self.coordinates, self.pools = region, Coordinates(lat=lat, lon=lon), pools
        self.beating = True
        self.desired: DesiredState | None = None

    async def beat(self) -> None:
        with contextlib.suppress(KeyNotFoundError):
            self.desired = DesiredState.from_bytes((await self.kv.get(self.cluster)).value)
        replicas = [
            ReplicaStatus(
                replica_id=r.replica_id,
                deployment=r.deployment,
                version=r.version,
                state=ReplicaState.ready,
                url=f"http://{self.cluster}.invalid/{r.replica_id}",
                pool=r.pool,
            )
            for r in (self.desired.replicas if self.desired else [])
        ]
        hb = Heartbeat(
            cluster=self.cluster,
            region=self.region,
            coordinates=self.coordinates,
            gateway_url=f"http://{self.cluster}.invalid:9000",
            pools=self.pools,
            replicas=replicas,
            desired_generation=self.desired.generation if self.desired else -1,
        )
        await self.nc.publish(heartbeat_subject(self.cluster), hb.to_bytes())

    async def run(self) -> None:
        while True:
            if self.beating:
                with contextlib.suppress(Exception):
                    await self.beat()
            await asyncio.sleep(BEAT_S)


async def cli(home, *args: str):
    return await asyncio.to_thread(fleetctl_json, home, *args)


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
def control_plane(tmp_path, nats_server, monkeypatch):
    monkeypatch.setenv("FLEET_MISSED_HEARTBEATS", "2")  # x 1 s heartbeat interval
    cp = ControlPlaneServer(
        tmp_path / "home", f"sqlite:///{tmp_path / 'fleet.db'}", nats_server.url, loops=True
    )
    yield cp
    cp.kill()


async def _desired_states(desired_kv) -> dict[str, DesiredState]:
    out = {}
    for key in CLUSTERS:
        with contextlib.suppress(KeyNotFoundError):
            out[key] = DesiredState.from_bytes((await desired_kv.get(key)).value)
    return out


async def _route(routes_kv, name: str) -> RoutingTable | None:
    try:
        return RoutingTable.from_bytes((await routes_kv.get(name)).value)
    except KeyNotFoundError:
        return None


def placed(states: dict[str, DesiredState]) -> dict[str, Counter]:
    return {c: Counter(r.deployment for r in d.replicas) for c, d in states.items()}


async def test_deploy_failover_and_restart_over_real_nats(control_plane, nats_server):
    cp = control_plane
    await asyncio.to_thread(cp.start)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    agents_tasks = []
    try:
        desired_kv = await eventually(lambda: _kv(js, BUCKET_DESIRED), what="the buckets")
        routes_kv = await js.key_value(BUCKET_ROUTES)
        agents = {c: SimAgent(nc, desired_kv, c) for c in CLUSTERS}
        agents_tasks = [asyncio.create_task(a.run()) for a in agents.values()]

        desired = functools.partial(_desired_states, desired_kv)
        route = functools.partial(_route, routes_kv)

        # Heartbeats register the clusters and their pools; each gets a (still empty) desired key.
        await eventually(lambda: _all_keys(desired), what="a desired key per cluster")
        clusters = {c["id"]: c for c in await cli(cp.home, "clusters")}
        assert {c: (v["status"], v["region"]) for c, v in clusters.items()} == {
            "east": ("healthy", "us-east"),
            "west": ("healthy", "us-west"),
            "gpu": ("healthy", "eu-west"),
        }

        # Peers forward to the URL enrolled with the control plane, never to a heartbeat's claim.
        with cp.client() as api:
            api.patch(
                "/v1/clusters/west", json={"gateway_url": "https://west.enrolled:9443"}
            ).raise_for_status()

        # CPU replicas spread over two regions; the GPU deployment goes to the GPU pool.
        await cli(
            cp.home,
            "deploy",
            "chat",
            "--model",
            "tiny",
            "--replicas",
            "3",
            "--gpu",
            "cpu",
            "--min-regions",
            "2",
        )
        await cli(
            cp.home, "deploy", "big", "--model", "tiny", "--replicas", "1", "--gpu", "a100", "--gpus", "4"
        )

        async def first_layout():
            now = placed(await desired())
            ok = now == {"east": Counter(chat=2), "west": Counter(chat=1), "gpu": Counter(big=1)}
            return now if ok else None

        await eventually(first_layout, what="chat on east x2 + west, big on gpu")
        before = await desired()
        big = before["gpu"].replicas[0]
        assert (big.model, big.resources.gpu_count, big.resources.gpu_models, big.pool) == (
            "tiny",
            4,
            ["a100"],
            "a100",
        )

        async def chat_ready():
            status = await cli(cp.home, "status", "chat")
            return status if status["ready_replicas"] == 3 else None

        status = await eventually(chat_ready, what="chat ready (reported by the agents' heartbeats)")
        assert status["desired_replicas"] == 3
        assert sorted(p["cluster"] for p in status["placements"]) == ["east", "east", "west"]

        async def chat_route_ready():
            r = await route("chat")
            return r if r and {c.cluster: c.replicas for c in r.clusters} == {"east": 2, "west": 1} else None

        r = await eventually(chat_route_ready, what="chat's route with ready counts")
        assert [(v.version, v.weight) for v in r.versions] == [(1, 1.0)]
        assert {c.cluster: c.gateway_url for c in r.clusters}["west"] == "https://west.enrolled:9443"

        # A jurisdiction set on a cluster reaches its routes (by_region too) and its desired state.
        assert (await cli(cp.home, "clusters", "set", "west", "--jurisdiction", "ca"))["jurisdiction"] == "ca"

        async def west_in_ca():
            r, west = await route("chat"), (await desired()).get("west")
            tables = [r.clusters, *r.by_region.values()] if r else []
            routes = [c for table in tables for c in table if c.cluster == "west"]
            ok = west and west.jurisdiction == "ca" and routes and all(c.jurisdiction == "ca" for c in routes)
            return ok or None

        await eventually(
            west_in_ca, timeout=10, what="west's jurisdiction in chat's route and its desired state"
        )

        # East goes silent: unhealthy after 2 missed heartbeats, its replicas move west, its route goes.
        agents["east"].beating = False
        east_generation = before["east"].generation

        async def east_unhealthy():
            rows = {c["id"]: c["status"] for c in await cli(cp.home, "clusters")}
            return rows if rows["east"] == "unhealthy" else None

        silent_at = time.monotonic()
        rows = await eventually(east_unhealthy, timeout=20, what="east unhealthy")
        assert rows == {"east": "unhealthy", "west": "healthy", "gpu": "healthy"}
        assert time.monotonic() - silent_at >= 1.5  # not before its heartbeats were missed

        async def moved():
            now = placed(await desired())
            return now if now == {"east": Counter(), "west": Counter(chat=3), "gpu": Counter(big=1)} else None

        await eventually(moved, what="chat re-placed on west")
        after = await desired()
        assert after["east"].generation > east_generation
        assert after["gpu"].generation == before["gpu"].generation  # unchanged content, not republished
        old_ids = {r.replica_id for r in before["east"].replicas}
        assert not old_ids & {r.replica_id for r in after["west"].replicas}

        async def east_dropped():
            r = await route("chat")
            return r if r and [c.cluster for c in r.clusters] == ["west"] else None

        await eventually(east_dropped, what="east dropped from chat's route")
        kinds = {e["kind"] for e in await cli(cp.home, "events", "--cluster", "east")}
        assert {"cluster_unhealthy", "removed"} <= kinds

        # Restart the control plane; meanwhile NATS loses west's key and gains a stale route.
        old = await desired()
        generations = {c: d.generation for c, d in old.items()}
        await asyncio.to_thread(cp.stop)
        await desired_kv.delete("west")
        await routes_kv.put("ghost", RoutingTable(deployment="ghost").to_bytes())
        await asyncio.to_thread(cp.start)

        async def republished():
            now = await desired()
            gone = await route("ghost") is None
            return now if "west" in now and gone else None

        now = await eventually(republished, what="west republished and the stale route deleted")
        assert placed(now)["west"] == Counter(chat=3)
        assert now["west"].generation > generations["west"]
        # A restarted control plane leads under a new epoch: it rewrites every key with it (so
        # agents learn the epoch), the content unchanged.
        assert now["gpu"].epoch > old["gpu"].epoch
        assert now["gpu"].replicas == old["gpu"].replicas

        await cli(cp.home, "delete", "big")

        async def big_gone():
            now = await desired()
            return now if not now["gpu"].replicas and await route("big") is None else None

        now = await eventually(big_gone, what="big's replicas and route removed")
        assert now["gpu"].generation > generations["gpu"]
    finally:
        for task in agents_tasks:
            task.cancel()
        for task in agents_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await nc.close()


async def _kv(js, bucket):
    try:
        return await js.key_value(bucket)
    except Exception:
        return None


async def _all_keys(desired) -> dict | None:
    now = await desired()
    return now if set(now) == set(CLUSTERS) else None
