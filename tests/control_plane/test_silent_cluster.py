"""A cluster that goes silent keeps its ready replicas in its desired state until they are
ready elsewhere (a real SQLite database through the reconcile pass, no NATS): a silence
with nowhere else to go restarts nothing when the cluster is heard again, and one with
room elsewhere gives the replicas up only once their replacements are ready. Routes leave
the silent cluster at once in both."""

from __future__ import annotations

from datetime import timedelta

import pytest

from control_plane.db import models as m
from control_plane.loops.ingest import apply_heartbeat, mark_silent_unhealthy
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from fleet_base.protocol import BUCKET_DESIRED, BUCKET_ROUTES, ReplicaState, ReplicaStatus
from tests.control_plane.test_loops import add_deployment, assignments, events, heartbeat, run


def _beat(sessions, cluster: str, states: dict[str, ReplicaState]) -> None:
    """`cluster` heart-beats, reporting its replicas in `states`."""
    replicas = [
        ReplicaStatus(replica_id=rid, deployment="chat", version=1, state=state, url=f"http://{rid}:1")
        for rid, state in states.items()
    ]
    with sessions() as s:
        apply_heartbeat(s, heartbeat(cluster=cluster, replicas=replicas), m.utcnow())
        s.commit()


def _two_ready_on_a(sessions, memory) -> list[str]:
    """Cluster a runs the deployment's two replicas, both reported ready; their ids."""
    _beat(sessions, "a", {})
    add_deployment(sessions, "chat", replicas=2)
    run(sessions, memory)
    ids = sorted(assignments(sessions))
    _beat(sessions, "a", dict.fromkeys(ids, ReplicaState.ready))
    return ids


def _silence(sessions) -> list[str]:
    """Every cluster has been silent for a minute."""
    now = m.utcnow()
    with sessions() as s:
        marked = mark_silent_unhealthy(s, now - timedelta(hours=1), now + timedelta(minutes=1), limit_s=5)
        s.commit()
    return marked


def _desired(out, cluster: str) -> list[str]:
    return [r.replica_id for r in out.wanted[BUCKET_DESIRED][cluster].replicas]


def _routed(out) -> list[str]:
    route = out.wanted[BUCKET_ROUTES].get("chat")
    return [c.cluster for c in route.clusters] if route else []


def test_a_silent_cluster_with_nowhere_else_to_go_keeps_its_replicas_and_restarts_none(sessions) -> None:
    memory = ({}, {})
    ids = _two_ready_on_a(sessions, memory)

    assert _silence(sessions) == ["a"]
    assert {state for _, state, _ in assignments(sessions).values()} == {"unreachable"}
    out = run(sessions, memory)
    assert out.result.removed == () and sorted(assignments(sessions)) == ids
    assert _desired(out, "a") == ids  # the agent, if it still listens, stops nothing
    assert _routed(out) == []  # but no traffic is sent there
    assert events(sessions, "placement_short") and not events(sessions, "removed")

    _beat(sessions, "a", dict.fromkeys(ids, ReplicaState.ready))  # heard again
    out = run(sessions, memory)
    assert not out.changed and _desired(out, "a") == ids and _routed(out) == ["a"]
    assert {state for _, state, _ in assignments(sessions).values()} == {"ready"}


def test_a_silent_clusters_replicas_go_once_their_replacements_are_ready(sessions) -> None:
    memory = ({}, {})
    old = _two_ready_on_a(sessions, memory)
    _beat(sessions, "b", {})  # room elsewhere, heard from since

    with sessions() as s:  # only a has been silent for long
        s.get(m.Cluster, "b").last_heartbeat_at = m.utcnow() + timedelta(minutes=1)
        s.commit()
    assert _silence(sessions) == ["a"]
    out = run(sessions, memory)
    new = sorted(a.replica_id for a in out.result.added)
    assert len(new) == 2 and {a.cluster for a in out.result.added} == {"b"}
    assert out.result.removed == () and _desired(out, "a") == old and _routed(out) == ["b"]

    _beat(sessions, "b", {new[0]: ReplicaState.ready, new[1]: ReplicaState.starting})
    out = run(sessions, memory)
    assert len(out.result.removed) == 1 and len(_desired(out, "a")) == 1  # one replaced so far
    assert _routed(out) == ["b"]

    _beat(sessions, "b", dict.fromkeys(new, ReplicaState.ready))
    out = run(sessions, memory)
    assert sorted(assignments(sessions)) == new and _desired(out, "a") == []
    removed = events(sessions, "removed")
    assert len(removed) == 2 and all("cluster a is unhealthy" in e.message for e in removed)


def test_a_cluster_silent_for_longer_than_the_hold_gives_its_replicas_up(sessions) -> None:
    memory = ({}, {})
    ids = _two_ready_on_a(sessions, memory)
    assert _silence(sessions) == ["a"]
    nodes, reported = memory
    out = reconcile_once(sessions, get_placer("ffd"), nodes, reported, hold_s=0.0)
    assert sorted(out.result.removed) == ids and _desired(out, "a") == []
    assert not assignments(sessions) and len(events(sessions, "removed")) == 2


@pytest.mark.parametrize("placer", ["ffd", "milp"])
def test_a_cluster_heard_again_keeps_its_warm_replicas_over_replacements_still_starting(
    sessions, placer: str
) -> None:
    """The replacements' cluster is the preferred one (same price, first by name), yet the
    warm replicas stay and the starting replacements go: no capacity is traded for it."""
    memory = ({}, {})
    nodes, reported = memory
    _beat(sessions, "z", {})
    add_deployment(sessions, "chat", replicas=2)
    reconcile_once(sessions, get_placer(placer), nodes, reported)
    old = sorted(assignments(sessions))
    _beat(sessions, "z", dict.fromkeys(old, ReplicaState.ready))
    _beat(sessions, "a", {})
    with sessions() as s:  # only z has been silent for long
        s.get(m.Cluster, "a").last_heartbeat_at = m.utcnow() + timedelta(minutes=1)
        s.commit()
    assert _silence(sessions) == ["z"]
    out = reconcile_once(sessions, get_placer(placer), nodes, reported)
    new = sorted(a.replica_id for a in out.result.added)
    assert len(new) == 2 and {a.cluster for a in out.result.added} == {"a"}

    _beat(sessions, "a", dict.fromkeys(new, ReplicaState.starting))
    _beat(sessions, "z", dict.fromkeys(old, ReplicaState.ready))  # heard again, still warm
    out = reconcile_once(sessions, get_placer(placer), nodes, reported)
    assert sorted(out.result.removed) == new, out.result
    assert sorted(assignments(sessions)) == old and _desired(out, "z") == old
    assert _routed(out) == ["z"]
