"""What a message claims must match where it came from: NATS permissions bind each agent
to its own subjects, and the control plane drops a heartbeat or event whose claimed
cluster is not the subject's. An agent never acts on a desired state whose generation
went down (a replay, or a forgery that got past everything else)."""

from __future__ import annotations

from types import SimpleNamespace

from agent.daemon import Agent
from control_plane.context import ControlPlaneContext
from control_plane.counters import Rejections
from control_plane.db.models import Event as EventRow
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.loops import Loops
from control_plane.loops.durable import Received
from control_plane.loops.ingest import store_event_batch
from control_plane.settings import Settings
from fleet_base import protocol
from fleet_base.cluster_config import ClusterConfig


def msg(subject: str, message: protocol.Message) -> SimpleNamespace:
    return SimpleNamespace(subject=subject, data=message.to_bytes())


async def test_control_plane_drops_messages_whose_cluster_is_not_their_subject(tmp_path):
    loops = Loops(ControlPlaneContext(settings=Settings(home=tmp_path), sessions=None))  # type: ignore[arg-type]
    await loops._on_heartbeat(msg(protocol.heartbeat_subject("east"), protocol.Heartbeat(cluster="west")))
    assert loops._heartbeats == {}
    await loops._on_heartbeat(msg(protocol.heartbeat_subject("east"), protocol.Heartbeat(cluster="east")))
    assert list(loops._heartbeats) == ["east"]

    # Events arrive through the durable consumer's store: a forged claim is poison, never stored.
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    upgrade_to_head(url)
    sessions = make_sessions(url)
    subject = protocol.events_subject("east")
    forged = protocol.Event(cluster="west", kind="info", event_id="forged")
    honest = protocol.Event(cluster="east", kind="info", event_id="honest")
    batch = [Received(subject, forged.to_bytes(), 1), Received(subject, honest.to_bytes(), 2)]
    rejections = Rejections()
    verdicts = store_event_batch(sessions, batch, rejections)
    assert verdicts.poison == {0}
    assert rejections.counts[(protocol.EVENTS_WILDCARD, "subject")] == 1
    with sessions() as session:
        assert [(e.cluster, e.event_id) for e in session.query(EventRow).all()] == [("east", "honest")]


async def test_agent_ignores_a_desired_state_whose_generation_goes_down(tmp_path):
    config = ClusterConfig(cluster="east", state_dir=tmp_path / "state", runtime="sim")
    agent = Agent(config)
    spec = protocol.ReplicaSpec(replica_id="r1", deployment="d", version=1, model="m")
    newer = protocol.DesiredState(cluster="east", generation=5, replicas=[spec])
    await agent.desired_mirror.on_entry("east", newer.to_bytes())
    older = protocol.DesiredState(cluster="east", generation=3, replicas=[])
    await agent.desired_mirror.on_entry("east", older.to_bytes())
    assert agent.desired is not None and agent.desired.generation == 5 and agent.desired.replicas == [spec]
    assert agent.files.load_desired().generation == 5  # and the copy on disk did not go back either
    for other in (protocol.DesiredState(cluster="west", generation=9),):  # another cluster's state
        await agent.desired_mirror.on_entry("east", other.to_bytes())
    assert agent.desired.generation == 5


async def test_a_cluster_flooding_heartbeats_is_dropped_unparsed_and_others_are_heard(tmp_path):
    """A compromised cluster's oversize heartbeats and its flood past its budget are dropped
    before they are parsed (counted "size" and "rate"); another cluster's still arrive."""
    loops = Loops(ControlPlaneContext(settings=Settings(home=tmp_path), sessions=None))  # type: ignore[arg-type]
    west = protocol.heartbeat_subject("west")
    huge = SimpleNamespace(subject=west, data=b"{" + b" " * (2 << 20) + b"}")
    await loops._on_heartbeat(huge)
    for _ in range(1000):
        await loops._on_heartbeat(msg(west, protocol.Heartbeat(cluster="west")))
    await loops._on_heartbeat(msg(protocol.heartbeat_subject("east"), protocol.Heartbeat(cluster="east")))
    counts = loops.inbox.rejections.snapshot()
    assert counts[("fleet.v1.heartbeat.*", "size")] == 1
    assert counts[("fleet.v1.heartbeat.*", "rate")] >= 1000 - 20 * 8 - 1
    assert "east" in loops._heartbeats
