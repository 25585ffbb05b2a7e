"""Heartbeats and gateway demand -> one Observation per deployment; version columns ->
settings; routes of deployments that may scale to zero."""

from __future__ import annotations

import asyncio

from agent.gateway.demand import DemandSignal
from agent.protocol import Demand, Heartbeat, ReplicaLoad, ReplicaState, ReplicaStatus
from control_plane.autoscale.observe import observe, settings_of
from control_plane.db.models import DeploymentVersion
from control_plane.loops.plan import build_routes
from control_plane.loops.snapshot import DeploymentRow, FleetSnapshot, VersionSpec


def rs(rid: str, dep: str, state: ReplicaState, running: int = 0, waiting: int = 0) -> ReplicaStatus:
    return ReplicaStatus(replica_id=rid, deployment=dep, version=1, state=state,
                         load=ReplicaLoad(running=running, waiting=waiting))  # fmt: skip


def test_observe_sums_clusters_and_fresh_demand() -> None:
    now = 1000.0
    hbs = [
        Heartbeat(cluster="a", sent_at=now - 1, replicas=[
            rs("a1", "chat", ReplicaState.ready, 3, 1), rs("a2", "chat", ReplicaState.starting),
            rs("a3", "code", ReplicaState.ready, 9, 9)]),
        Heartbeat(cluster="b", sent_at=now - 2, replicas=[rs("b1", "chat", ReplicaState.ready, 2, 0)]),
        Heartbeat(cluster="c", sent_at=now - 60, replicas=[rs("c1", "chat", ReplicaState.ready, 50, 50)]),  # stale
    ]  # fmt: skip
    demands = {
        ("a", "chat"): Demand(cluster="a", deployment="chat", queued=4, at=now - 1),
        ("b", "chat"): Demand(cluster="b", deployment="chat", queued=7, at=now - 30),  # expired
    }
    obs = observe("chat", hbs, demands, now=now, current=3)
    assert (obs.in_flight, obs.queued, obs.ready, obs.starting, obs.current) == (5, 5, 2, 1, 3)
    assert observe("none", hbs, demands, now=now, current=0).demand == 0


def test_settings_of_a_version_row() -> None:
    v = DeploymentVersion(version=1, model="m", min_replicas=0, max_replicas=4, autoscale_window_s=30.0,
                          scale_down_delay_s=10.0, target_concurrency=6.0, scale_to_zero=False)  # fmt: skip
    s = settings_of(v)
    assert (s.min_replicas, s.max_replicas, s.target_concurrency) == (0, 4, 6.0)
    assert s.stable_window_s == 30 and s.panic_window_s == 3 and s.scale_down_delay_s == 10
    assert s.scale_to_zero  # min 0 means it may reach zero


def test_routes_stay_for_a_deployment_that_scales_to_zero() -> None:
    snap = FleetSnapshot(
        deployments=(DeploymentRow(name="zero", replicas=0, current_version=1),
                     DeploymentRow(name="off", replicas=0, current_version=1)),
        specs={("zero", 1): VersionSpec(deployment="zero", version=1, model="m", min_replicas=0),
               ("off", 1): VersionSpec(deployment="off", version=1, model="m", min_replicas=1)},
    )  # fmt: skip
    routes = build_routes(snap, [])
    assert set(routes) == {"zero"} and routes["zero"].scale_to_zero and routes["zero"].clusters == []


def test_demand_signal_counts_waiters_and_sends_at_once_from_zero() -> None:
    sent: list[Demand] = []

    class Link:
        async def publish(self, subject: str, message: Demand) -> bool:
            assert subject == "fleet.v1.demand.a"
            sent.append(message)
            return True

    async def go() -> None:
        sig = DemandSignal(Link(), "a", every_s=60)  # type: ignore[arg-type]
        with sig.waiting("chat", ready=0):
            with sig.waiting("chat", ready=0):
                assert sig.queued == {"chat": 2}
            await asyncio.sleep(0)
        assert sig.queued == {}
        with sig.waiting("code", ready=2):  # first for this deployment: sent
            with sig.waiting("code", ready=2):  # within every_s and replicas ready: not sent
                await asyncio.sleep(0)

    asyncio.run(go())
    assert [(d.deployment, d.queued, d.ready) for d in sent] == [
        ("chat", 1, 0),
        ("chat", 2, 0),
        ("code", 1, 2),
    ]
