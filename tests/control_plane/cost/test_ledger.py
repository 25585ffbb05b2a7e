"""The replica ledger through the real loops: the reconcile pass opens an interval per
placed replica at its pool's price, a spot interruption (heartbeat) closes it, scaling
in closes it as removed, a deleted deployment's are closed by the next pass, and a later
price change never rewrites an interval."""

from __future__ import annotations

from sqlalchemy import delete, select

from control_plane.cost import ledger
from control_plane.db import models as m
from control_plane.loops.ingest import apply_heartbeat
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from fleet_base.domain import Tier
from fleet_base.protocol import Heartbeat, PoolInventory
from tests.control_plane.test_loops import add_deployment, set_deployment

SPOT = PoolInventory(name="spot", gpu_model="L4", gpus_per_node=2, nodes=2, tier=Tier.spot, hourly_price=0.6)
ON_DEMAND = PoolInventory(name="od", gpu_model="L4", gpus_per_node=1, nodes=4, hourly_price=0.9)


def _intervals(sessions) -> dict[str, tuple]:
    with sessions() as s:
        return {
            r.replica_id: (r.pool, r.tier, r.gpus, r.hourly_price, r.ended_at is None, r.end_reason)
            for r in s.scalars(select(m.ReplicaInterval))
        }


def test_intervals_follow_placement_interruption_scale_in_and_deletion(sessions):
    now = m.utcnow()
    hb = Heartbeat(cluster="c1", region="us-east4", provider="gcp", pools=[SPOT])
    with sessions() as s:
        apply_heartbeat(s, hb, now)
        s.commit()
    add_deployment(sessions, "chat", replicas=3, gpu_models=["L4"])
    memory = ({}, {})
    placer = get_placer("ffd")
    reconcile_once(sessions, placer, *memory)
    opened = _intervals(sessions)
    assert sorted(opened.values()) == [("spot", "spot", 1, 0.3, True, None)] * 3  # $0.6/node, 2 GPUs a node

    # two spot replicas are reclaimed: their intervals end at once, as spot_interrupted
    lost = sorted(opened)[:2]
    smaller = SPOT.model_copy(update={"nodes": 1})
    with sessions() as s:
        apply_heartbeat(s, hb.model_copy(update={"pools": [smaller, ON_DEMAND], "preempted": lost}), now)
        s.commit()
    assert [_intervals(sessions)[r][4:] for r in lost] == [(False, "spot_interrupted")] * 2
    reconcile_once(sessions, placer, *memory)
    after = _intervals(sessions)
    running = {rid: v for rid, v in after.items() if v[4]}
    assert sorted(v[:4] for v in running.values()) == [("od", "on-demand", 1, 0.9)] * 2 + [
        ("spot", "spot", 1, 0.3)
    ]

    # a price change is the future's: running and past intervals keep their price
    dearer = ON_DEMAND.model_copy(update={"hourly_price": 5.0})
    with sessions() as s:
        apply_heartbeat(s, hb.model_copy(update={"pools": [smaller, dearer]}), now)
        s.commit()
    set_deployment(sessions, "chat", replicas=1)
    reconcile_once(sessions, placer, *memory)
    final = _intervals(sessions)
    assert {rid: v[3] for rid, v in final.items()} == {rid: v[3] for rid, v in after.items()}
    assert sum(v[4] for v in final.values()) == 1
    assert sorted(v[5] for v in final.values() if not v[4]) == ["removed"] * 2 + ["spot_interrupted"] * 2

    # the deployment is deleted (its assignments go by cascade): the next pass closes its interval
    with sessions() as s:
        s.execute(delete(m.Deployment).where(m.Deployment.name == "chat"))
        s.commit()
    reconcile_once(sessions, placer, *memory)
    assert not any(v[4] for v in _intervals(sessions).values())
    assert sorted(v[5] for v in _intervals(sessions).values()).count(ledger.GONE) == 1


def test_sync_opens_an_interval_for_a_replica_placed_before_the_ledger_once(sessions):
    with sessions() as s:
        apply_heartbeat(s, Heartbeat(cluster="c1", pools=[ON_DEMAND]), m.utcnow())
        s.commit()
    add_deployment(sessions, "chat", replicas=1, gpu_models=["L4"])
    reconcile_once(sessions, get_placer("ffd"), {}, {})
    with sessions() as s:
        s.execute(delete(m.ReplicaInterval))  # as if placed before the ledger existed
        s.commit()
    reconcile_once(sessions, get_placer("ffd"), {}, {})
    reconcile_once(sessions, get_placer("ffd"), {}, {})
    assert list(_intervals(sessions).values()) == [("od", "on-demand", 1, 0.9, True, None)]
