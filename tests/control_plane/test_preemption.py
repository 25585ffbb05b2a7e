"""Spot preemption: an agent reports replicas whose spot node was reclaimed; their
assignments go at once and the next reconcile re-places them on on-demand capacity."""

from __future__ import annotations

from control_plane.db import models as m
from control_plane.loops.ingest import apply_heartbeat
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from fleet_base.domain import Tier
from fleet_base.protocol import Heartbeat, PoolInventory
from tests.control_plane.test_loops import add_deployment, assignments, events

SPOT = PoolInventory(name="spot", gpu_model="L4", gpus_per_node=1, nodes=4, tier=Tier.spot, hourly_price=0.3)
ON_DEMAND = PoolInventory(name="od", gpu_model="L4", gpus_per_node=1, nodes=4, hourly_price=0.9)


def _placed(sessions, replicas: int):
    """c1 with a spot and an on-demand pool, and `replicas` of chat placed on it."""
    now = m.utcnow()
    hb = Heartbeat(cluster="c1", region="us-east4", provider="gcp", pools=[SPOT, ON_DEMAND])
    with sessions() as s:
        apply_heartbeat(s, hb, now)
        s.commit()
    add_deployment(sessions, "chat", replicas=replicas, gpu_models=["L4"])
    placer = get_placer("milp")
    memory = ({}, {})
    reconcile_once(sessions, placer, *memory)
    return now, hb, placer, memory


def test_preempted_spot_replicas_are_replaced_on_demand_at_once(sessions):
    now, hb, placer, memory = _placed(sessions, 3)
    with sessions() as s:
        rows = {a.replica_id: a.pool_name for a in s.query(m.ReplicaAssignment)}
    assert sorted(rows.values()) == ["spot"] * 3  # cheapest first

    # two spot nodes are reclaimed: the agent reports the replicas and its smaller inventory
    lost = sorted(rows)[:2]
    smaller = SPOT.model_copy(update={"nodes": 1})
    with sessions() as s:
        changed = apply_heartbeat(
            s, hb.model_copy(update={"pools": [smaller, ON_DEMAND], "preempted": lost}), now
        )
        s.commit()
    assert changed
    assert not set(lost) & set(assignments(sessions))
    assert sorted(e.replica_id for e in events(sessions, "replica_preempted")) == lost
    reconcile_once(sessions, placer, *memory)
    with sessions() as s:
        pools = sorted(a.pool_name for a in s.query(m.ReplicaAssignment))
    assert pools == ["od", "od", "spot"]
    # the same report again changes nothing; another cluster's replica ids are ignored
    with sessions() as s:
        again = apply_heartbeat(
            s, hb.model_copy(update={"pools": [smaller, ON_DEMAND], "preempted": lost}), now
        )
        other = apply_heartbeat(s, Heartbeat(cluster="c2", preempted=list(assignments(sessions))), now)
        s.commit()
    assert not again and len(assignments(sessions)) == 3
    assert other  # c2 registered, but nothing of c1's was dropped


def test_unschedulable_replicas_are_replaced_where_capacity_is(sessions):
    """The agent reports a replica its cluster cannot schedule and the pool shrunk to what
    the cluster holds (agent/capacity.py): it moves to capacity that exists."""
    now, hb, placer, memory = _placed(sessions, 2)
    rows = assignments(sessions)
    stuck = sorted(rows)[0]
    held = SPOT.model_copy(update={"nodes": 1})  # one replica scheduled, one pending
    with sessions() as s:
        changed = apply_heartbeat(
            s, hb.model_copy(update={"pools": [held, ON_DEMAND], "unschedulable": [stuck]}), now
        )
        s.commit()
    assert changed and stuck not in assignments(sessions)
    assert not events(sessions, "replica_preempted")  # the agent's replica_unschedulable says why
    reconcile_once(sessions, placer, *memory)
    with sessions() as s:
        pools = sorted(a.pool_name for a in s.query(m.ReplicaAssignment))
    assert pools == ["od", "spot"]
