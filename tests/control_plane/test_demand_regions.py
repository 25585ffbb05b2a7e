"""The control plane steers new replicas toward where requests come from: recent usage
by gateway region -> ReplicaDemand.demand_regions -> the MILP's nearness term."""

from __future__ import annotations

from datetime import timedelta

from control_plane.db import models as m
from control_plane.fleet_model.demand_regions import _coarse, read_demand_regions
from control_plane.fleet_model.snapshot import read_snapshot
from control_plane.loops.ingest import apply_heartbeat
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from fleet_base.protocol import Heartbeat, PoolInventory
from tests.control_plane.test_loops import add_deployment, set_deployment

POOL = PoolInventory(name="h100", gpu_model="H100", gpus_per_node=8, nodes=4, hourly_price=20.0)


def _usage(sf, cluster, deployment, tokens, ago_s=10.0):
    with sf() as s:
        s.add(
            m.UsageRecord(
                at=m.utcnow() - timedelta(seconds=ago_s), cluster=cluster, key_id="k", deployment=deployment,
                prompt_tokens=tokens, completion_tokens=0,
            )
        )  # fmt: skip
        s.commit()


def _clusters(sf):
    now = m.utcnow()
    with sf() as s:
        for cid, region in (("c-east", "us-east4"), ("d-tokyo", "asia-northeast1")):
            hb = Heartbeat(
                cluster=cid, provider="gcp", region=region, pools=[POOL], gateway_url=f"http://{cid}"
            )
            apply_heartbeat(s, hb, now)
        s.commit()


def _placed(sf):
    with sf() as s:
        return sorted(a.cluster_id for a in s.query(m.ReplicaAssignment))


def test_shares_are_coarse_and_windowed(sessions):
    assert _coarse({"a": 3, "b": 1}) == {"a": 0.75, "b": 0.25}
    assert _coarse({"a": 99, "b": 1}) == {"a": 1.0}
    _clusters(sessions)
    _usage(sessions, "d-tokyo", "chat", 300)
    _usage(sessions, "c-east", "chat", 100)
    _usage(sessions, "c-east", "chat", 10_000, ago_s=3600)  # too old
    with sessions() as s:
        got = read_demand_regions(s, read_snapshot(s))
    assert got == {"chat": {"gcp:asia-northeast1": 0.75, "gcp:us-east4": 0.25}}


def test_new_replicas_go_where_requests_come_from(sessions):
    _clusters(sessions)
    placer = get_placer("milp")
    memory = ({}, {})
    add_deployment(sessions, "quiet", replicas=1, gpu_count=8)
    reconcile_once(sessions, placer, *memory)
    assert _placed(sessions) == ["c-east"]  # equal cost: the usual tie-break (cluster name)

    add_deployment(sessions, "asian", replicas=1, gpu_count=8)
    _usage(sessions, "d-tokyo", "asian", 500)
    reconcile_once(sessions, placer, *memory)
    assert _placed(sessions) == ["c-east", "d-tokyo"]
    set_deployment(sessions, "asian", replicas=2)
    reconcile_once(sessions, placer, *memory)
    assert _placed(sessions) == ["c-east", "d-tokyo", "d-tokyo"]
