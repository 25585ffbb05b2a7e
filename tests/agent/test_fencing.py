"""Agents obey no value of an older control-plane epoch than the highest they saw in its
bucket (agent.fencing): a deposed leader that wakes up cannot undo its successor's
decisions, across an agent restart too; equal and higher epochs are obeyed."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.daemon import Agent
from agent.fencing import EpochFence
from agent.gateway.fence_metrics import FencedWritesCollector
from fleet_base import api_keys, protocol
from fleet_base.api_keys import ApiKeyRecord
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState
from fleet_base.protocol import DesiredState, ReplicaSpec, RoutingTable


@pytest.mark.parametrize(
    ("epochs", "admitted"),
    [
        ((0, 0, 0), (True, True, True)),  # unfenced legacy writers
        ((1, 1, 2, 2), (True, True, True, True)),  # equal and higher
        ((2, 1), (True, False)),  # a deposed leader
        ((2, 0), (True, False)),  # epoch 0 after a higher one
        ((3, 1, 3, 2, 4, 3), (True, False, True, False, True, False)),
        ((0, 5, 4, 5, 6), (True, True, False, True, True)),
    ],
)
def test_the_fence_admits_equal_and_higher_epochs_only(epochs, admitted):
    fence = EpochFence()
    assert tuple(fence.admits("b", "k", e) for e in epochs) == admitted
    assert fence.epoch("b") == max(epochs)
    assert fence.refused("b") == admitted.count(False)
    assert fence.epoch("other") == 0 and fence.admits("other", "k", 0)  # per bucket


def spec(replica_id: str) -> ReplicaSpec:
    return ReplicaSpec(replica_id=replica_id, deployment="d", version=1, model="m")


def agent_at(tmp_path) -> Agent:
    return Agent(ClusterConfig(cluster="east", state_dir=tmp_path / "state", runtime="sim"))


def fenced_metric(files: LocalState) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(FencedWritesCollector(files.load_fence))
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("fleet_agent_fenced_writes_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('"')[1]] = float(value)
    return out


async def test_agent_refuses_older_epochs_in_every_bucket_and_counts_them(tmp_path, caplog):
    agent = agent_at(tmp_path)
    desired = agent.desired_mirror
    await desired.on_entry(
        "east", DesiredState(cluster="east", generation=5, replicas=[spec("r2")], epoch=2).to_bytes()
    )
    # A deposed leader's write, even with a higher generation; and a legacy (epoch 0) one.
    await desired.on_entry(
        "east", DesiredState(cluster="east", generation=99, replicas=[], epoch=1).to_bytes()
    )
    await desired.on_entry("east", DesiredState(cluster="east", generation=98, replicas=[]).to_bytes())
    assert agent.desired.replicas == [spec("r2")] and agent.files.load_desired().epoch == 2
    # The same leader again, and a newer one whose generation is lower: both obeyed.
    await desired.on_entry(
        "east", DesiredState(cluster="east", generation=6, replicas=[spec("r3")], epoch=2).to_bytes()
    )
    assert agent.desired.replicas == [spec("r3")]
    await desired.on_entry(
        "east", DesiredState(cluster="east", generation=1, replicas=[spec("r4")], epoch=3).to_bytes()
    )
    assert agent.desired.replicas == [spec("r4")] and agent.desired.epoch == 3

    routes = agent.route_mirror
    await routes.on_entry("chat", RoutingTable(deployment="chat", scale_to_zero=True, epoch=3).to_bytes())
    await routes.on_entry("chat", RoutingTable(deployment="chat", epoch=2).to_bytes())
    await routes.on_entry("new", RoutingTable(deployment="new", epoch=2).to_bytes())  # a key it created
    assert set(routes.entries) == {"chat"} and routes.entries["chat"].scale_to_zero
    assert set(agent.files.load_routes().routes) == {"chat"}

    keys = agent.key_mirror
    record = ApiKeyRecord(key_id="k1", name="k1", salt="s", hash="h", epoch=3)
    await keys.on_entry("k1", record.to_bytes())
    await keys.on_entry("k1", record.model_copy(update={"revoked": True, "epoch": 0}).to_bytes())
    await keys.on_entry(api_keys.KEYS_LEASE, api_keys.KeyLease(epoch=2).to_bytes())
    assert not keys.entries["k1"].revoked and agent.files.load_key_lease() is None
    await keys.on_entry(api_keys.KEYS_LEASE, api_keys.KeyLease(epoch=3).to_bytes())
    assert agent.files.load_key_lease() is not None

    # Deletions carry no epoch and are obeyed (agent.fencing says why).
    await keys.on_entry("k1", None)
    assert keys.entries == {}

    assert fenced_metric(agent.files) == {
        protocol.BUCKET_DESIRED: 2.0,
        protocol.BUCKET_KEYS: 2.0,
        protocol.BUCKET_ROUTES: 2.0,
    }
    refusals = [r for r in caplog.records if r.levelname == "WARNING" and "refusing" in r.getMessage()]
    assert len(refusals) == 5  # once per bucket and stale epoch (routes: 2 refused, 1 logged)

    # Counted, not logged, when the same stale epoch comes again.
    await routes.on_entry("chat", RoutingTable(deployment="chat", epoch=2).to_bytes())
    assert len([r for r in caplog.records if "refusing" in r.getMessage()]) == 5
    assert fenced_metric(agent.files)[protocol.BUCKET_ROUTES] == 3.0

    # A restart keeps the fence (fence.json): the deposed leader's writes stay refused.
    again = agent_at(tmp_path)
    again.desired_mirror.load()
    await again.desired_mirror.on_entry(
        "east", DesiredState(cluster="east", generation=100, replicas=[], epoch=2).to_bytes()
    )
    assert again.desired.replicas == [spec("r4")]
    assert again.fence.epoch(protocol.BUCKET_ROUTES) == 3


async def test_an_agent_upgraded_from_before_fencing_starts_from_the_epochs_on_disk(tmp_path):
    agent = agent_at(tmp_path)
    await agent.route_mirror.on_entry("chat", RoutingTable(deployment="chat", epoch=4).to_bytes())
    agent.files.fence_path.unlink()  # state written before fence.json existed

    again = agent_at(tmp_path)
    for mirror in again.mirrors:
        mirror.load()
    assert again.fence.epoch(protocol.BUCKET_ROUTES) == 4
    await again.route_mirror.on_entry(
        "chat", RoutingTable(deployment="chat", scale_to_zero=True, epoch=3).to_bytes()
    )
    assert not again.route_mirror.entries["chat"].scale_to_zero


async def test_the_heartbeat_reports_the_highest_epoch_accepted_in_any_bucket(tmp_path):
    """The leader compares it with its own epoch (control_plane.ha.elector.raise_floor)."""
    agent = agent_at(tmp_path)
    assert agent.reporter.heartbeat().fence_epoch == 0
    await agent.route_mirror.on_entry("chat", RoutingTable(deployment="chat", epoch=7).to_bytes())
    await agent.desired_mirror.on_entry("east", DesiredState(cluster="east", epoch=5).to_bytes())
    await agent.route_mirror.on_entry("chat", RoutingTable(deployment="chat", epoch=3).to_bytes())  # refused
    assert agent.fence.highest() == 7
    assert agent.reporter.heartbeat().fence_epoch == 7
    assert agent_at(tmp_path).reporter.heartbeat().fence_epoch == 7  # fence.json, after a restart
