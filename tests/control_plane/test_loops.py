"""The control loops' decisions against a real SQLite database (no NATS): snapshot ->
placement -> assignments and events; desired state, routes and keys built from them;
heartbeats, agent events and the failover rule."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from control_plane.db import models as m
from control_plane.fleet_model.plan import build_routes, next_assignments, placement_inputs
from control_plane.fleet_model.snapshot import live_keys, read_snapshot
from control_plane.loops.ingest import (
    apply_heartbeat,
    is_silent,
    mark_silent_unhealthy,
    record_events,
)
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from fleet_base.domain import Coordinates, Tier
from fleet_base.protocol import (
    BUCKET_DESIRED,
    BUCKET_KEYS,
    BUCKET_ROUTES,
    Event,
    Heartbeat,
    PoolInventory,
    ReplicaState,
    ReplicaStatus,
)
from fleet_base.wire import heartbeat_problem


def add_cluster(sessions, cid, region="r1", status="healthy", slots=2, gpu="cpu", price=0.0, heartbeat=True):
    with sessions() as s:
        c = m.Cluster(
            id=cid, region=region, status=status, gateway_url=f"http://{cid}:9000", lat=1.0, lon=2.0,
            last_heartbeat_at=m.utcnow() if heartbeat else None, load={},
        )  # fmt: skip
        c.pools = [
            m.CapacityPool(name="main", gpu_model=gpu, gpus_per_node=slots, nodes=1, hourly_price=price)
        ]
        s.add(c)
        s.commit()


def add_deployment(sessions, name, replicas=1, model="tiny", **spec):
    with sessions() as s:
        d = m.Deployment(name=name, replicas=replicas, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model=model, engine_args={"threads": 1}, **spec)]
        s.add(d)
        s.commit()


def set_deployment(sessions, name, **values):
    with sessions() as s:
        d = s.scalar(select(m.Deployment).where(m.Deployment.name == name))
        for k, v in values.items():
            setattr(d, k, v)
        s.commit()


def assignments(sessions):
    with sessions() as s:
        return {
            a.replica_id: (a.cluster_id, a.state, a.version) for a in s.scalars(select(m.ReplicaAssignment))
        }


def events(sessions, kind):
    with sessions() as s:
        return list(s.scalars(select(m.Event).where(m.Event.kind == kind).order_by(m.Event.id)))


def run(sessions, memory=None):
    nodes, reported = memory if memory is not None else ({}, {})
    return reconcile_once(sessions, get_placer("ffd"), nodes, reported)


def test_reconcile_places_writes_and_describes_every_cluster(sessions):
    add_cluster(sessions, "a", region="r1", price=1.0)
    add_cluster(sessions, "b", region="r2", price=2.0)
    add_cluster(sessions, "fresh", status="unhealthy", heartbeat=False)  # registered by hand, never seen
    add_deployment(sessions, "chat", replicas=3, gpu_models=["cpu"], min_regions=2)

    out = run(sessions)
    rows = assignments(sessions)
    assert sorted(c for c, _, _ in rows.values()) == ["a", "a", "b"]
    assert all(state == "pending" for _, state, _ in rows.values())
    assert {e.replica_id for e in events(sessions, "placed")} == set(rows)

    desired = out.wanted[BUCKET_DESIRED]
    assert set(desired) == {"a", "b", "fresh"}
    assert desired["fresh"].replicas == []
    spec = desired["b"].replicas[0]
    assert spec.deployment == "chat" and spec.version == 1 and spec.model == "tiny"
    assert spec.engine_args == {"threads": 1} and spec.pool == "main" and spec.resources.gpu_models == ["cpu"]
    assert {r.replica_id for d in desired.values() for r in d.replicas} == set(rows)

    route = out.wanted[BUCKET_ROUTES]["chat"]
    assert [(v.version, v.weight) for v in route.versions] == [(1, 1.0)]
    assert [(c.cluster, c.region, c.gateway_url, c.replicas) for c in route.clusters] == [
        ("a", "r1", "http://a:9000", 0),
        ("b", "r2", "http://b:9000", 0),
    ]  # nothing ready yet

    again = run(sessions)
    assert not again.changed and assignments(sessions) == rows
    assert len(events(sessions, "placed")) == 3


def test_routes_count_ready_replicas_and_skip_unhealthy_clusters(sessions):
    add_cluster(sessions, "a")
    add_cluster(sessions, "b", region="r2")
    add_deployment(sessions, "chat", replicas=2, min_regions=2)
    run(sessions)
    with sessions() as s:
        snap = read_snapshot(s)
    rows = [r.model_copy(update={"state": "ready"}) if r.cluster == "a" else r for r in snap.assignments]
    sick = [c.model_copy(update={"status": "unhealthy"}) if c.id == "b" else c for c in snap.clusters]
    snap = snap.model_copy(update={"assignments": tuple(rows), "clusters": tuple(sick)})
    route = build_routes(snap, list(snap.assignments))["chat"]
    assert [(c.cluster, c.replicas, c.healthy) for c in route.clusters] == [("a", 1, True)]


def test_failover_replaces_replicas_of_an_unhealthy_cluster(sessions):
    add_cluster(sessions, "a", price=1.0)
    add_cluster(sessions, "b", price=5.0)
    add_deployment(sessions, "chat", replicas=2)
    memory = ({}, {})
    run(sessions, memory)
    before = assignments(sessions)
    assert {c for c, _, _ in before.values()} == {"a"}

    with sessions() as s:
        s.get(m.Cluster, "a").status = "unhealthy"
        s.commit()
    out = run(sessions, memory)
    after = assignments(sessions)
    assert set(out.result.removed) == set(before)
    assert {c for c, _, _ in after.values()} == {"b"} and not set(after) & set(before)
    assert out.wanted[BUCKET_DESIRED]["a"].replicas == []
    assert [c.cluster for c in out.wanted[BUCKET_ROUTES]["chat"].clusters] == ["b"]
    removed = events(sessions, "removed")
    assert len(removed) == 2 and all("cluster a is unhealthy" in e.message for e in removed)


def test_scale_to_zero_delete_and_new_version(sessions):
    add_cluster(sessions, "a", slots=4)
    add_deployment(sessions, "chat", replicas=2)
    add_deployment(sessions, "code", replicas=1)
    run(sessions)
    v1 = {rid for rid, (_, _, v) in assignments(sessions).items() if rid.startswith("chat")}

    with sessions() as s:
        d = s.scalar(select(m.Deployment).where(m.Deployment.name == "chat"))
        d.versions.append(m.DeploymentVersion(version=2, model="tiny-2"))
        d.current_version = 2
        s.commit()
    out = run(sessions)
    chat = {rid: v for rid, (_, _, v) in assignments(sessions).items() if rid.startswith("chat")}
    assert set(chat.values()) == {2} and not set(chat) & v1
    assert {r.model for r in out.wanted[BUCKET_DESIRED]["a"].replicas if r.deployment == "chat"} == {"tiny-2"}
    assert any("replaced by version 2" in e.message for e in events(sessions, "removed"))

    set_deployment(sessions, "chat", replicas=0)
    out = run(sessions)
    assert all(not rid.startswith("chat") for rid in assignments(sessions))
    assert set(out.wanted[BUCKET_ROUTES]) == {"code"}

    with sessions() as s:
        s.delete(s.scalar(select(m.Deployment).where(m.Deployment.name == "code")))
        s.commit()
    out = run(sessions)
    assert assignments(sessions) == {} and out.wanted[BUCKET_ROUTES] == {}
    assert out.wanted[BUCKET_DESIRED]["a"].replicas == []


def test_shortfall_is_an_event_once_until_it_changes(sessions):
    add_cluster(sessions, "a", slots=1)
    add_deployment(sessions, "chat", replicas=3)
    memory = ({}, {})
    out = run(sessions, memory)
    assert out.result.unplaced[0].missing == 2
    run(sessions, memory)
    short = events(sessions, "placement_short")
    assert len(short) == 1 and "2 replica(s) unplaced" in short[0].message
    add_cluster(sessions, "b", slots=4)
    run(sessions, memory)
    assert len(assignments(sessions)) == 3


def test_keys_published_only_while_not_revoked(sessions):
    with sessions() as s:
        s.add(
            m.ApiKey(
                key_id="k1", name="app", salt="s", hash="h", scopes=["inference"], quotas={"priority": 2}
            )
        )
        s.add(m.ApiKey(key_id="k2", name="old", salt="s", hash="h", revoked_at=m.utcnow()))
        s.commit()
    assert BUCKET_KEYS not in run(sessions).wanted  # keys are published by their own loop, not placement
    with sessions() as s:
        keys = {k.key_id: k for k in live_keys(s)}
    assert set(keys) == {"k1"}
    assert keys["k1"].quotas.priority == 2 and keys["k1"].hash == "h" and keys["k1"].deployments is None


def test_node_memory_keeps_mixed_sizes_stable(sessions):
    add_cluster(sessions, "a", slots=4)
    with sessions() as s:
        s.get(m.Cluster, "a").pools[0].nodes = 3
        s.commit()
    add_deployment(sessions, "big", replicas=3, gpu_count=3)
    add_deployment(sessions, "small", replicas=3, gpu_count=1)
    memory = ({}, {})
    run(sessions, memory)
    with sessions() as s:
        _, _, current = placement_inputs(read_snapshot(s), memory[0])
    assert all(a.node is not None for a in current)
    assert not run(sessions, memory).changed


# --------------------------------------------------------------------- heartbeats and failover


def heartbeat(cluster="c1", **kw) -> Heartbeat:
    values = dict(
        cluster=cluster, provider="local", region="eu-west", coordinates=Coordinates(lat=50, lon=8),
        gateway_url=f"http://{cluster}:9000",
        pools=[PoolInventory(name="cpu", gpu_model="cpu", gpus_per_node=2, tier=Tier.on_demand)],
    )  # fmt: skip
    values.update(kw)
    return Heartbeat(**values)


def test_heartbeat_registers_cluster_and_pools_then_only_timestamps_change(sessions):
    now = m.utcnow()
    with sessions() as s:
        assert apply_heartbeat(s, heartbeat(queue_depth=3), now)
        s.commit()
    with sessions() as s:
        c = s.get(m.Cluster, "c1")
        # the heartbeat's gateway_url is a claim: only enrolment (the API) sets where peers forward
        assert (c.region, c.status, c.gateway_url, c.lat) == ("eu-west", "healthy", "", 50)
        assert c.last_heartbeat_at == now and c.load["queue_depth"] == 3
        assert [(p.name, p.gpu_model, p.gpus_per_node) for p in c.pools] == [("cpu", "cpu", 2)]
    later = now + timedelta(seconds=1)
    with sessions() as s:
        assert not apply_heartbeat(s, heartbeat(queue_depth=5), later)
        s.commit()
    with sessions() as s:
        assert s.get(m.Cluster, "c1").last_heartbeat_at == later
    with sessions() as s:  # the agent's inventory is the truth: new pool in, old pool out
        pools = [
            PoolInventory(name="gpu", gpu_model="a100", gpu_memory_gb=80, gpus_per_node=8, tier=Tier.spot)
        ]
        assert apply_heartbeat(s, heartbeat(pools=pools), later)
        s.commit()
    with sessions() as s:
        assert [(p.name, p.tier, p.gpus_per_node) for p in s.get(m.Cluster, "c1").pools] == [
            ("gpu", "spot", 8)
        ]


def test_heartbeat_updates_replica_states_and_revives_an_unhealthy_cluster(sessions):
    with sessions() as s:
        apply_heartbeat(s, heartbeat(), m.utcnow())
        s.commit()
    add_deployment(sessions, "chat", replicas=1)
    run(sessions)
    (rid,) = assignments(sessions)
    with sessions() as s:
        s.get(m.Cluster, "c1").status = "unhealthy"
        s.commit()
    status = ReplicaStatus(
        replica_id=rid, deployment="chat", version=1, state=ReplicaState.ready, url="http://x:1"
    )
    stray = ReplicaStatus(replica_id="not-ours", deployment="chat", version=1, state=ReplicaState.ready)
    with sessions() as s:
        assert apply_heartbeat(s, heartbeat(replicas=[status, stray]), m.utcnow())
        s.commit()
    with sessions() as s:
        assert s.get(m.ReplicaAssignment, rid).state == "ready"
        assert s.get(m.ReplicaAssignment, rid).url == "http://x:1"
        assert s.get(m.Cluster, "c1").status == "healthy"
    assert len(events(sessions, "cluster_healthy")) == 1


def test_silent_clusters_become_unhealthy_counted_from_when_we_listen(sessions):
    now = m.utcnow()
    add_cluster(sessions, "alive")
    add_cluster(sessions, "silent")
    add_cluster(sessions, "cordoned", status="draining")
    add_cluster(sessions, "by-hand", heartbeat=False)
    with sessions() as s:
        s.get(m.Cluster, "silent").last_heartbeat_at = now - timedelta(seconds=10)
        s.get(m.Cluster, "cordoned").last_heartbeat_at = now - timedelta(seconds=10)
        s.get(m.Cluster, "alive").last_heartbeat_at = now - timedelta(seconds=1)
        s.commit()
    # Just started listening: nobody is silent yet, however old their last heartbeat.
    with sessions() as s:
        assert mark_silent_unhealthy(s, now - timedelta(seconds=1), now, limit_s=3) == []
    with sessions() as s:
        assert sorted(mark_silent_unhealthy(s, now - timedelta(seconds=60), now, limit_s=3)) == [
            "cordoned",
            "silent",
        ]
        s.commit()
    with sessions() as s:
        assert {c.id: c.status for c in s.scalars(select(m.Cluster))} == {
            "alive": "healthy", "silent": "unhealthy", "cordoned": "unhealthy", "by-hand": "healthy",
        }  # fmt: skip
    assert {e.cluster for e in events(sessions, "cluster_unhealthy")} == {"silent", "cordoned"}
    assert not is_silent(None, now, now + timedelta(hours=1), 3)
    # Heart-beating again: the silent one is healthy, the cordoned one still draining.
    with sessions() as s:
        apply_heartbeat(s, heartbeat(cluster="silent"), m.utcnow())
        apply_heartbeat(s, heartbeat(cluster="cordoned"), m.utcnow())
        s.commit()
    with sessions() as s:
        assert s.get(m.Cluster, "silent").status == "healthy"
        assert s.get(m.Cluster, "cordoned").status == "draining"


def test_agent_events_are_recorded(sessions):
    with sessions() as s:
        n = record_events(
            s, [Event(cluster="c1", kind="replica_failed", message="boom", replica_id="r-1", at=1e9)]
        )
        s.commit()
    assert n == 1
    (e,) = events(sessions, "replica_failed")
    assert (e.cluster, e.replica_id, e.message, e.at.year) == ("c1", "r-1", "boom", 2001)


def test_next_assignments_keeps_states_and_adds_pending(sessions):
    add_cluster(sessions, "a")
    add_deployment(sessions, "chat", replicas=1)
    run(sessions)
    with sessions() as s:
        s.scalars(select(m.ReplicaAssignment)).one().state = "ready"
        s.commit()
    set_deployment(sessions, "chat", replicas=2)
    with sessions() as s:
        snap = read_snapshot(s)
    demands, pools, current = placement_inputs(snap)
    result = get_placer("ffd").place(demands, pools, current)
    assert sorted(a.state for a in next_assignments(snap, result)) == ["pending", "ready"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"cluster": "Bad_ID"}, "cluster id"),
        ({"cluster": "x" * 64}, "cluster id"),
        ({"region": "r" * 64}, "region"),
        ({"gateway_url": "http://" + "g" * 600}, "gateway_url"),
        ({"pools": [PoolInventory(name="p", gpu_model="cpu")] * 2}, "repeat"),
        ({"pools": [PoolInventory(name="p" * 64, gpu_model="cpu")]}, "pool"),
    ],
)
def test_heartbeats_that_cannot_be_stored_are_refused_with_a_reason(change, reason):
    assert heartbeat_problem(heartbeat()) is None
    assert reason in heartbeat_problem(heartbeat(**change))
