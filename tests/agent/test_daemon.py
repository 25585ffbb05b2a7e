"""The agent end to end, as a real `python -m agent` process against a real nats-server
and real engine replicas on a tiny random checkpoint. The test plays the control plane
with nats-py: it writes DesiredState / RoutingTable / ApiKeyRecord into the KV buckets
and listens to heartbeats and events."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats
import psutil
import pytest

from control_plane.local.nats_server import NatsServer
from fleet_base import api_keys, protocol
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState, ReplicaSnapshot
from fleet_base.nats_io import ensure_jetstream
from fleet_base.protocol import (
    DesiredState,
    Event,
    Heartbeat,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RoutingTable,
    VersionWeight,
)
from tests.agent.conftest import AgentProcess, cluster_config
from tests.polling import eventually

CLUSTER = "test-east"


class ControlPlane:
    """Just enough of a control plane: KV writes, heartbeat and event listeners."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.heartbeats: list[Heartbeat] = []
        self.events: list[Event] = []
        self.nc: Any = None

    async def connect(self) -> ControlPlane:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await ensure_jetstream(self.js)

        async def on_heartbeat(msg: Any) -> None:
            self.heartbeats.append(Heartbeat.from_bytes(msg.data))

        async def on_event(msg: Any) -> None:
            self.events.append(Event.from_bytes(msg.data))

        await self.nc.subscribe(protocol.heartbeat_subject(CLUSTER), cb=on_heartbeat)
        await self.nc.subscribe(protocol.events_subject(CLUSTER), cb=on_event)
        return self

    async def put(self, bucket: str, key: str, message: protocol.Message) -> None:
        await (await self.js.key_value(bucket)).put(key, message.to_bytes())

    async def delete(self, bucket: str, key: str) -> None:
        await (await self.js.key_value(bucket)).delete(key)

    async def desire(self, generation: int, *specs: ReplicaSpec) -> None:
        desired = DesiredState(cluster=CLUSTER, generation=generation, replicas=list(specs))
        await self.put(protocol.BUCKET_DESIRED, CLUSTER, desired)

    def event_kinds(self, replica_id: str) -> list[str]:
        return [e.kind for e in self.events if e.replica_id == replica_id]

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


def spec(model: Path, rid: str, version: int = 1) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=rid, deployment="chat", version=version, model=str(model), engine_args={"max_num_seqs": 4}
    )


def snapshot(cfg: ClusterConfig) -> ReplicaSnapshot:
    return LocalState(cfg.state_dir).load_replicas() or ReplicaSnapshot(cluster=CLUSTER)


def replica(cfg: ClusterConfig, rid: str, state: ReplicaState | None = None) -> ReplicaStatus | None:
    for r in snapshot(cfg).replicas:
        if r.replica_id == rid and (state is None or r.state == state):
            return r
    return None


def runtime_pid(cfg: ClusterConfig, rid: str) -> int | None:
    try:
        data = json.loads((cfg.state_dir / "runtime.json").read_text())
    except FileNotFoundError:
        return None
    handle = data["replicas"].get(rid)
    return handle["pid"] if handle else None


def heartbeat_with(cp: ControlPlane, rid: str, **fields: Any) -> Heartbeat | None:
    for hb in reversed(cp.heartbeats):
        for r in hb.replicas:
            if r.replica_id == rid and all(getattr(r, k) == v for k, v in fields.items()):
                return hb
    return None


async def complete(url: str, prompt: str = "hello", max_tokens: int = 4) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post(
            "/v1/completions", json={"model": "chat", "prompt": prompt, "max_tokens": max_tokens}
        )
    assert r.status_code == 200, r.text
    return r.json()


def key_record(key_id: str) -> ApiKeyRecord:
    salt, digest = api_keys.hash_secret(f"fleet-{key_id}-secret")
    return ApiKeyRecord(key_id=key_id, name=key_id, salt=salt, hash=digest)


@pytest.fixture
async def control_plane(nats_server: NatsServer):
    cp = await ControlPlane(nats_server.url).connect()
    yield cp
    await cp.close()


@dataclass
class Started:
    """A running agent on a fresh state_dir, and its files."""

    cfg: ClusterConfig
    agent: AgentProcess
    files: LocalState


@pytest.fixture
def started(
    tmp_path: Path, nats_server: NatsServer, agent_factory: Callable[[ClusterConfig], AgentProcess]
) -> Started:
    cfg = cluster_config(tmp_path, nats_server.url)
    return Started(cfg, agent_factory(cfg).start(), LocalState(cfg.state_dir))


async def test_agent_runs_restarts_replaces_and_stops_replicas(
    model_dir: Path, nats_server: NatsServer, control_plane: ControlPlane, started: Started
) -> None:
    cp, cfg, agent, files = control_plane, started.cfg, started.agent, started.files

    # The agent announces itself (inventory, gateway, region) before anything is desired.
    hb = await eventually(lambda: cp.heartbeats and cp.heartbeats[-1], 20, "a first heartbeat")
    assert (hb.cluster, hb.region, hb.gateway_url) == (CLUSTER, "local-east", "http://127.0.0.1:9999")
    assert (hb.coordinates.lat, hb.coordinates.lon) == (40.7, -74.0)
    assert [(p.name, p.gpu_model, p.gpus_per_node) for p in hb.pools] == [("cpu", "cpu", 2)]
    assert hb.replicas == [] and hb.desired_generation == -1

    # Desired: one replica -> started, ready, serving; reported on disk and in heartbeats.
    await cp.desire(1, spec(model_dir, "chat-1-a"))
    ready = await eventually(lambda: replica(cfg, "chat-1-a", ReplicaState.ready), 30, "chat-1-a ready")
    assert (await complete(ready.url))["usage"]["completion_tokens"] >= 1
    hb = await eventually(
        lambda: heartbeat_with(cp, "chat-1-a", state=ReplicaState.ready), 10, "heartbeat: ready"
    )
    assert hb.desired_generation == 1
    assert files.load_desired() == DesiredState.model_validate_json(files.desired_path.read_bytes())
    assert [r.replica_id for r in files.load_desired().replicas] == ["chat-1-a"]
    assert cp.event_kinds("chat-1-a")[:2] == ["replica_starting", "replica_ready"]
    log = Path(cfg.state_dir / "logs" / "chat-1-a.log").read_text()
    assert "--served-model-name chat" in log and "--max-num-seqs 4" in log and "--threads 1" in log

    # Load is read from the replica's /metrics: generated tokens show up as tokens/s.
    await complete(ready.url, max_tokens=40)
    hb = await eventually(
        lambda: next((h for h in reversed(cp.heartbeats) if h.tokens_per_s > 0), None), 10, "tokens/s > 0"
    )
    assert hb.replicas[0].load.tokens_per_s == hb.tokens_per_s > 0

    # Routes and keys are mirrored to disk for the gateway, deletions included.
    table = RoutingTable(deployment="chat", versions=[VersionWeight(version=1)], generation=3)
    await cp.put(protocol.BUCKET_ROUTES, "chat", table)
    await cp.put(protocol.BUCKET_KEYS, "k1", key_record("k1"))
    await cp.put(protocol.BUCKET_KEYS, "k2", key_record("k2"))
    await eventually(lambda: set(files.load_keys().keys) == {"k1", "k2"}, 10, "keys.json with k1, k2")
    await eventually(lambda: "chat" in files.load_routes().routes, 10, "routes.json with chat")
    assert files.load_routes().routes["chat"].generation == 3
    await cp.delete(protocol.BUCKET_KEYS, "k1")
    await eventually(lambda: set(files.load_keys().keys) == {"k2"}, 10, "k1 dropped from keys.json")

    # kill -9 of the replica: detected, restarted (restarts=1), ready again on a new pid.
    pid = runtime_pid(cfg, "chat-1-a")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    again = await eventually(
        lambda: (r := replica(cfg, "chat-1-a", ReplicaState.ready)) and r.restarts == 1 and r, 30, "restart"
    )
    assert runtime_pid(cfg, "chat-1-a") != pid
    await complete(again.url)
    await eventually(
        lambda: heartbeat_with(cp, "chat-1-a", state=ReplicaState.ready, restarts=1), 10, "hb restarts=1"
    )
    kinds = cp.event_kinds("chat-1-a")
    assert kinds[2:5] == ["replica_failed", "replica_restarted", "replica_ready"], kinds
    failed = next(e for e in cp.events if e.kind == "replica_failed")
    assert "exited with code -9" in failed.message

    # A new version (new replica id) surges: the old one serves until the new one is ready.
    await cp.desire(2, spec(model_dir, "chat-2-a", version=2))
    seen: list[list[tuple[str, ReplicaState]]] = []

    def replaced() -> bool:
        snap = snapshot(cfg)
        seen.append([(r.replica_id, r.state) for r in snap.replicas])
        return [(r.replica_id, r.state) for r in snap.replicas] == [("chat-2-a", ReplicaState.ready)]

    await eventually(replaced, 30, "chat-2-a ready and chat-1-a gone")
    assert all(any(state == ReplicaState.ready for _, state in snap) for snap in seen), seen
    assert any(("chat-2-a", ReplicaState.starting) in snap for snap in seen)
    await eventually(
        lambda: psutil.pid_exists(pid) is False or not runtime_pid(cfg, "chat-1-a"), 5, "old pid gone"
    )
    await eventually(lambda: "replica_stopped" in cp.event_kinds("chat-1-a"), 5, "chat-1-a stopped event")

    # Removed from the desired state: drained and stopped, its process gone.
    pid2 = runtime_pid(cfg, "chat-2-a")
    await cp.desire(3)
    await eventually(lambda: snapshot(cfg).replicas == [], 20, "no replicas")

    def latest() -> Heartbeat:
        return cp.heartbeats[-1]

    await eventually(
        lambda: not latest().replicas and latest().desired_generation == 3, 5, "hb: nothing runs"
    )
    assert pid2 is not None and not _alive(pid2)
    assert "replica_stopped" in cp.event_kinds("chat-2-a")

    assert agent.terminate() == 0
    assert "Traceback" not in agent.log(), agent.log()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def test_agent_serves_from_disk_without_nats_and_resumes(
    model_dir: Path, nats_server: NatsServer, control_plane: ControlPlane, started: Started
) -> None:
    cp, cfg, agent, files = control_plane, started.cfg, started.agent, started.files
    await cp.put(protocol.BUCKET_KEYS, "k1", key_record("k1"))
    await cp.desire(1, spec(model_dir, "chat-1-a"))
    first = await eventually(lambda: replica(cfg, "chat-1-a", ReplicaState.ready), 30, "chat-1-a ready")
    await eventually(lambda: "k1" in files.load_keys().keys, 10, "k1 on disk")
    pid = runtime_pid(cfg, "chat-1-a")

    # The agent dies hard; the key is deleted meanwhile; then NATS goes away too.
    agent.kill()
    await cp.delete(protocol.BUCKET_KEYS, "k1")
    await cp.close()
    nats_server.stop()

    # Restarted without NATS: resumes from disk and adopts the live replica (no duplicate).
    agent.start()
    await eventually(lambda: "adopted replica chat-1-a" in agent.log(), 20, "adoption")
    adopted = await eventually(
        lambda: replica(cfg, "chat-1-a", ReplicaState.ready), 10, "adopted replica ready"
    )
    assert adopted.url == first.url and runtime_pid(cfg, "chat-1-a") == pid
    await complete(adopted.url)
    assert "k1" in files.load_keys().keys  # cannot know about the deletion yet

    # Again, but the replica died too: started afresh from desired.json, still without NATS.
    agent.kill()
    os.kill(pid, signal.SIGKILL)
    agent.start()
    fresh = await eventually(
        lambda: (r := replica(cfg, "chat-1-a", ReplicaState.ready)) and r.url != adopted.url and r,
        30,
        "a fresh chat-1-a",
    )
    assert runtime_pid(cfg, "chat-1-a") not in (None, pid)
    await complete(fresh.url)

    # NATS is back (same port, same store): heartbeats resume, the deleted key is dropped.
    nats_server.start()
    cp2 = await ControlPlane(nats_server.url).connect()
    try:
        hb = await eventually(
            lambda: heartbeat_with(cp2, "chat-1-a", state=ReplicaState.ready), 20, "heartbeats resume"
        )
        assert hb.desired_generation == 1
        await eventually(lambda: "k1" not in files.load_keys().keys, 10, "k1 pruned after reconnect")
        # and the desired state still flows: removing the replica stops it
        await cp2.desire(2)
        await eventually(lambda: snapshot(cfg).replicas == [], 20, "no replicas")
        await cp2.desire(3, spec(model_dir, "chat-3-a", version=3))
        await eventually(lambda: replica(cfg, "chat-3-a", ReplicaState.ready), 30, "chat-3-a ready")
        pid3 = runtime_pid(cfg, "chat-3-a")
    finally:
        await cp2.close()

    # SIGTERM: the agent drains its replica and exits 0, leaving no process behind.
    assert agent.terminate() == 0
    assert pid3 is not None and not _alive(pid3)
    assert snapshot(cfg).replicas == []
    assert json.loads((cfg.state_dir / "runtime.json").read_text())["replicas"] == {}
