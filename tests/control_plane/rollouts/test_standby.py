"""Active-passive through the real database and reconcile: the standby region holds
max(1, min_replicas) warm replicas flagged `standby` in routes while the primaries serve;
when every primary cluster is unhealthy the standby region takes the whole deployment,
and gives it back when a primary returns."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from control_plane.db import models as m
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from tests.control_plane.rollouts.helpers import assignments_by


@pytest.fixture
def sessions(sessions):
    with sessions() as s:
        for cid, region, price in (("e1", "east", 1.0), ("w1", "west", 0.5), ("s1", "south", 0.1)):
            c = m.Cluster(id=cid, region=region, status="healthy", gateway_url=f"http://{cid}:9000", load={})
            c.pools = [
                m.CapacityPool(name="main", gpu_model="cpu", gpus_per_node=4, nodes=1, hourly_price=price)
            ]
            s.add(c)
        d = m.Deployment(name="web", replicas=3, current_version=1)
        d.versions = [
            m.DeploymentVersion(version=1, model="a", min_replicas=1, max_replicas=3, min_regions=2, standby_regions=["south"])
        ]  # fmt: skip
        s.add(d)
        s.commit()
    return sessions


def by_cluster(sessions) -> dict[str, int]:
    return assignments_by(sessions, "cluster_id")


def run(sessions):
    return reconcile_once(sessions, get_placer("ffd"), {}, {})


def set_status(sessions, cid: str, status: str) -> None:
    with sessions() as s:
        s.execute(update(m.Cluster).where(m.Cluster.id == cid).values(status=status))
        s.commit()


def test_standby_is_warm_at_its_minimum_and_flagged_in_routes(sessions):
    out = run(sessions)
    # the cheapest region (south) is the standby: it gets exactly min_replicas, the primaries the 3
    counts = by_cluster(sessions)
    assert counts["s1"] == 1 and counts.get("e1", 0) + counts.get("w1", 0) == 3 and counts.get("e1", 0) >= 1
    routes = {c.cluster: c.standby for c in out.wanted["fleet_routes"]["web"].clusters}
    assert routes == {"e1": False, "w1": False, "s1": True}
    again = run(sessions)
    assert not again.result.changed  # stable


def test_standby_takes_over_while_every_primary_is_down_and_gives_back(sessions):
    run(sessions)
    set_status(sessions, "e1", "unhealthy")
    run(sessions)
    assert by_cluster(sessions) == {"w1": 3, "s1": 1}  # one primary left: it serves, standby stays warm
    set_status(sessions, "w1", "unhealthy")
    out = run(sessions)
    assert by_cluster(sessions) == {"s1": 4}  # the standby region takes the whole deployment
    assert [c.cluster for c in out.wanted["fleet_routes"]["web"].clusters] == ["s1"]
    set_status(sessions, "w1", "healthy")
    run(sessions)
    assert by_cluster(sessions) == {"w1": 3, "s1": 1}


def test_standby_without_room_is_a_shortfall_not_a_crash(sessions):
    with sessions() as s:
        s.execute(
            update(m.CapacityPool).where(m.CapacityPool.cluster_id == "s1").values(gpus_per_node=1, nodes=0)
        )
        s.commit()
    out = run(sessions)
    assert "s1" not in by_cluster(sessions)
    assert any("standby region south" in u.reason for u in out.result.unplaced)
