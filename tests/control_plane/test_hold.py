"""Make-before-break for a silent cluster (`placement.hold`): its replicas that were ready
stay in its desired state until their deployment version has the ready replicas it wants
elsewhere; routes leave the cluster at once either way."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.placement import Assignment, PoolCapacity, ReplicaDemand
from control_plane.placement.ffd import FirstFitDecreasing
from control_plane.placement.hold import hold_unreachable, waiting
from control_plane.placement.pipeline import PlacementInputs, run
from control_plane.placement.standby import StandbyDemand
from fleet_base.domain import ClusterStatus

SILENT = ClusterStatus.unhealthy


def _pool(cluster: str, status: ClusterStatus = ClusterStatus.healthy, nodes: int = 1) -> PoolCapacity:
    return PoolCapacity(
        cluster=cluster, name="p", region=f"r-{cluster}", gpu_model="l4", gpus_per_node=4, nodes=nodes,
        cluster_status=status,
    )  # fmt: skip


def _on(cluster: str, rid: str, version: int = 1) -> Assignment:
    return Assignment(replica_id=rid, deployment="x", version=version, cluster=cluster, pool="p")


def _plan(pools, current, count=2, ready=(), unreachable=(), version=1):
    demands = (ReplicaDemand(deployment="x", version=version, count=count),) if count else ()
    inputs = PlacementInputs(
        demands=demands,
        pools=tuple(pools),
        current=tuple(current),
        ready=frozenset(ready),
        unreachable=frozenset(unreachable),
    )
    return run(inputs, "ffd").result


def _kept(result, cluster: str) -> list[str]:
    return sorted(a.replica_id for a in result.kept if a.cluster == cluster)


# (case, pools' clusters and statuses, current (cluster, id), ready ids, unreachable ids,
#  count wanted, held on a, removed from a)
CASES = [
    ("nowhere else to go: both held, the shortfall still said",
     {"a": SILENT}, [("a", "x-1"), ("a", "x-2")], [], ["x-1", "x-2"], 2, ["x-1", "x-2"], []),
    ("replacements placed but not ready: both held",
     {"a": SILENT, "b": ClusterStatus.healthy}, [("a", "x-1"), ("a", "x-2")], [], ["x-1", "x-2"], 2,
     ["x-1", "x-2"], []),
    ("one replacement ready: one held",
     {"a": SILENT, "b": ClusterStatus.healthy}, [("a", "x-1"), ("a", "x-2"), ("b", "y-1"), ("b", "y-2")],
     ["y-1"], ["x-1", "x-2"], 2, ["x-1"], ["x-2"]),
    ("every replacement ready: none held",
     {"a": SILENT, "b": ClusterStatus.healthy}, [("a", "x-1"), ("a", "x-2"), ("b", "y-1"), ("b", "y-2")],
     ["y-1", "y-2"], ["x-1", "x-2"], 2, [], ["x-1", "x-2"]),
    ("not ready when the silence began (starting, failed): not held",
     {"a": SILENT}, [("a", "x-1"), ("a", "x-2")], [], ["x-2"], 2, ["x-2"], ["x-1"]),
    ("cordoned while silent: held the same",
     {"a": ClusterStatus.draining}, [("a", "x-1"), ("a", "x-2")], [], ["x-1", "x-2"], 2, ["x-1", "x-2"], []),
    ("the deployment scaled to zero meanwhile: not held",
     {"a": SILENT}, [("a", "x-1")], [], ["x-1"], 0, [], ["x-1"]),
    ("a healthy cluster's scale-down is the placer's alone",
     {"a": ClusterStatus.healthy}, [("a", "x-1"), ("a", "x-2"), ("a", "x-3")], [], ["x-1", "x-2", "x-3"], 2,
     None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "statuses, current, ready, unreachable, count, held, removed",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_silent_clusters_ready_replicas_are_held_until_replaced(
    statuses, current, ready, unreachable, count, held, removed
) -> None:
    pools = [_pool(c, s) for c, s in statuses.items()]
    assignments = [_on(c, rid) for c, rid in current]
    out = _plan(pools, assignments, count, ready, unreachable)
    if held is None:  # no silent cluster: exactly the placer's plan
        assert out == _plan(pools, assignments, count)
        assert len(out.removed) == 1
        return
    assert _kept(out, "a") == held
    assert sorted(r for r in out.removed if r.startswith("x-")) == removed
    if count and "b" not in statuses:
        assert [(u.deployment, u.missing) for u in out.unplaced] == [("x", count)]
    if "b" in statuses and count:  # the replacements are placed whatever is held
        assert len([a for a in out.assignments if a.cluster == "b"]) == count


def test_a_held_replica_is_kept_pass_after_pass_and_the_plan_is_stable() -> None:
    pools = [_pool("a", SILENT)]
    current = [_on("a", "x-1"), _on("a", "x-2")]
    first = _plan(pools, current, 2, (), ("x-1", "x-2"))
    again = _plan(pools, first.assignments, 2, (), ("x-1", "x-2"))
    assert not first.changed and not again.changed
    assert _kept(again, "a") == ["x-1", "x-2"]


@st.composite
def _fleets(draw):
    clusters = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True))
    pools = [
        _pool(c, draw(st.sampled_from([ClusterStatus.healthy, SILENT, ClusterStatus.draining])),
              nodes=draw(st.integers(0, 2)))
        for c in clusters
    ]  # fmt: skip
    current = [
        _on(draw(st.sampled_from(clusters)), f"r{i}", version=draw(st.integers(1, 2)))
        for i in range(draw(st.integers(0, 8)))
    ]
    ids = [a.replica_id for a in current]
    ready = draw(st.sets(st.sampled_from(ids))) if ids else set()
    unreachable = draw(st.sets(st.sampled_from(ids))) if ids else set()
    demands = tuple(ReplicaDemand(deployment="x", version=v, count=draw(st.integers(0, 6))) for v in (1, 2))
    return pools, current, frozenset(ready), frozenset(unreachable), demands


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=_fleets())
def test_only_what_is_lacking_is_held_and_only_from_silent_clusters(fleet) -> None:
    pools, current, ready, unreachable, demands = fleet
    held_back = waiting(current, pools, unreachable)
    silent = {p.cluster for p in pools if p.cluster_status == SILENT}
    healthy = {p.cluster for p in pools if p.cluster_status == ClusterStatus.healthy}
    assert all(a.cluster not in healthy and a.replica_id in unreachable for a in held_back)
    seen = [a for a in current if a not in held_back]
    plain = FirstFitDecreasing().place(demands, pools, seen)
    out = hold_unreachable(plain, held_back, demands, pools, ready)
    kept = {a.replica_id for a in held_back} - set(out.removed)
    assert out.added == plain.added
    assert set(out.removed) == set(plain.removed) | ({a.replica_id for a in held_back} - kept)
    assert {a.replica_id for a in out.kept} == {a.replica_id for a in plain.kept} | kept
    for d in demands:
        key = (d.deployment, d.version)
        serving = sum(
            1 for a in plain.assignments if (a.deployment, a.version) == key and a.replica_id in ready
            and a.cluster not in silent
        )  # fmt: skip
        mine = [a for a in held_back if (a.deployment, a.version) == key]
        assert len([a for a in mine if a.replica_id in kept]) == min(len(mine), max(0, d.count - serving))
    if not held_back:
        assert out == plain


def test_a_warm_standby_does_not_count_as_serving() -> None:
    pools = [_pool("a", SILENT), _pool("b"), _pool("s")]
    pools[2] = pools[2].model_copy(update={"region": "standby"})
    standby = StandbyDemand(deployment="x", version=1, regions=("standby",))
    warm = _on("s", "x-s")
    inputs = PlacementInputs(
        demands=(ReplicaDemand(deployment="x", version=1, count=2, regions=("r-a", "r-b")),),
        pools=tuple(pools),
        current=(_on("a", "x-1"), _on("a", "x-2"), warm),
        standby=(standby,),
        ready=frozenset({"x-s"}),
        unreachable=frozenset({"x-1", "x-2"}),
    )
    out = run(inputs, "ffd").result
    assert warm in out.kept and _kept(out, "a") == ["x-1", "x-2"]


def test_the_optimizing_placers_warm_start_still_matches_while_replicas_are_held() -> None:
    pools = [_pool("a", SILENT), _pool("b", nodes=0)]  # nowhere else to go
    inputs = PlacementInputs(
        demands=(ReplicaDemand(deployment="x", version=1, count=2),),
        pools=tuple(pools),
        current=(_on("a", "x-1"), _on("a", "x-2")),
        unreachable=frozenset({"x-1", "x-2"}),
    )
    first = run(inputs, "milp")
    again = run(
        inputs.model_copy(update={"current": first.result.assignments}), "milp", previous=first.solved
    )
    assert again.info is not None and again.info.method == "unchanged", again.info
    assert not again.result.changed and _kept(again.result, "a") == ["x-1", "x-2"]
