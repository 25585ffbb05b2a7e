"""After a rollback (or an abort, a promotion, a spec change without a rollout) on a
full fleet, the old version's ready replicas are drained by the surge budget: the
ready count of both versions never drops below `replicas - max_unavailable`, and while
both serve, routes split traffic by ready replicas. Reconcile passes on a real
database; between passes the "agent" brings pending replicas up."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from control_plane.db import models as m
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer

N = 4


@pytest.fixture
def sessions(sessions):
    with sessions() as s:
        c = m.Cluster(id="c1", region="r1", status="healthy", load={}, last_heartbeat_at=m.utcnow())
        c.pools = [m.CapacityPool(name="sim", gpu_model="sim", gpus_per_node=1, nodes=N, hourly_price=1.0)]
        d = m.Deployment(name="web", replicas=N, current_version=1)
        d.versions = [
            m.DeploymentVersion(version=v, model=f"m{v}", min_replicas=N, max_replicas=N) for v in (1, 2)
        ]
        s.add_all([c, d])
        s.commit()
    return sessions


def _seed(sessions, versions: list[int], current: int) -> None:
    """Ready replicas of the given versions fill the pool; `current` is the deployment's version."""
    with sessions() as s:
        d = s.scalar(select(m.Deployment))
        d.current_version = current
        for i, v in enumerate(versions):
            s.add(m.ReplicaAssignment(
                replica_id=f"web-v{v}-{i}", deployment_id=d.id, version=v, cluster_id="c1", pool_name="sim",
                state="ready"))  # fmt: skip
        s.commit()


def _ready(sessions) -> dict[int, int]:
    with sessions() as s:
        out: dict[int, int] = {}
        for a in s.scalars(select(m.ReplicaAssignment).where(m.ReplicaAssignment.state == "ready")):
            out[a.version] = out.get(a.version, 0) + 1
        return out


def _start_pending(sessions) -> None:
    with sessions() as s:
        for a in s.scalars(select(m.ReplicaAssignment).where(m.ReplicaAssignment.state == "pending")):
            a.state = "ready"
        s.commit()


def _drive(sessions, placer: str) -> tuple[list[dict[int, int]], list]:
    p, memory, seen, routes = get_placer(placer), ({}, {}), [], []
    for _ in range(4 * N):
        out = reconcile_once(sessions, p, *memory)  # removals happen here, before replacements start
        seen.append(_ready(sessions))
        routes.append(out.wanted["fleet_routes"]["web"].versions)
        if seen[-1] == {1: N}:
            break
        _start_pending(sessions)
    return seen, routes


@pytest.mark.parametrize("placer", ["milp", "ffd"])
@pytest.mark.parametrize("canary", [1, 3, 4])
def test_a_rollback_at_any_step_keeps_the_ready_bound(sessions, placer, canary):
    _seed(sessions, [1] * (N - canary) + [2] * canary, current=1)  # rolled back from version 2
    seen, routes = _drive(sessions, placer)
    assert seen[-1] == {1: N}, seen
    assert all(sum(r.values()) >= N - 1 for r in seen), seen  # max_unavailable 25% of 4 = 1
    # Old ready replicas beyond what max_unavailable lets go at once serve until replaced.
    split = {v.version for v in routes[0]}
    assert split == {1: {1}, 3: {1, 2}, 4: {2}}[canary], routes[0]
    assert [v.version for v in routes[-1]] == [1]


def test_a_spec_change_without_a_rollout_replaces_within_the_budget(sessions):
    _seed(sessions, [1] * N, current=2)
    with sessions() as s:  # the new version is 2: the seeded replicas are the old ones
        for a in s.scalars(select(m.ReplicaAssignment)):
            a.version = 1
        s.commit()
    p, memory, seen = get_placer("milp"), ({}, {}), []
    for _ in range(4 * N):
        reconcile_once(sessions, p, *memory)
        seen.append(_ready(sessions))
        if seen[-1] == {2: N}:
            break
        _start_pending(sessions)
    assert seen[-1] == {2: N} and all(sum(r.values()) >= N - 1 for r in seen), seen
