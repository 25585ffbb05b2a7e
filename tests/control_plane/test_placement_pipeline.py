"""The placement pipeline: standby split and completion around the placer, the verify
step's FFD fallback, the explain step's removal reasons, the warm start passed in."""

from __future__ import annotations

import pytest

from control_plane.placement import Assignment, PlacementResult, Placer, PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import violations
from control_plane.placement.explain import RemovalContext
from control_plane.placement.milp import MilpPlacer
from control_plane.placement.pipeline import PlacementInputs, run
from control_plane.placement.standby import StandbyDemand
from fleet_base.domain import ClusterStatus, Tier


def _pool(cluster: str, region: str, tier: Tier = Tier.on_demand, nodes: int = 2) -> PoolCapacity:
    return PoolCapacity(cluster=cluster, name="p", region=region, gpu_model="l4", nodes=nodes, tier=tier)


class _AllOnSpot(Placer):
    """Ignores max_spot_fraction: its plan breaks a hard rule."""

    name = "all-on-spot"

    def place(self, demands, pools, current=()):
        spot = next(p for p in pools if p.tier == Tier.spot)
        added = tuple(
            Assignment(replica_id=f"{d.deployment}-{i}", deployment=d.deployment, version=d.version,
                       cluster=spot.cluster, pool=spot.name, node=i)
            for d in demands for i in range(d.count)
        )  # fmt: skip
        return PlacementResult(added=added)


class _Raises(Placer):
    name = "raises"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def place(self, demands, pools, current=()):
        raise self.error


def test_a_plan_that_breaks_a_rule_is_replaced_by_ffd():
    pools = (_pool("s", "r1", Tier.spot), _pool("o", "r1"))
    d = ReplicaDemand(deployment="x", version=1, count=2, max_spot_fraction=0.0)
    out = run(PlacementInputs(demands=(d,), pools=pools), _AllOnSpot())
    assert out.info is not None and out.info.method == "greedy-error" and "spot" in out.info.note
    assert {a.cluster for a in out.result.assignments} == {"o"} and len(out.result.assignments) == 2
    assert violations([d], pools, out.result.assignments) == []


def test_a_placer_that_raises_falls_back_but_bad_input_does_not():
    pools = (_pool("o", "r1"),)
    d = ReplicaDemand(deployment="x", version=1, count=2)
    out = run(PlacementInputs(demands=(d,), pools=pools), _Raises(RuntimeError("boom")))
    assert out.info.method == "greedy-error" and "boom" in out.info.note and len(out.result.added) == 2
    with pytest.raises(ValueError):
        run(PlacementInputs(demands=(d,), pools=pools), _Raises(ValueError("duplicate demand")))


def test_standby_is_set_aside_and_completed_around_the_placer():
    pools = (_pool("n", "north"), _pool("s", "south", nodes=1))
    running = Assignment(replica_id="x-s", deployment="x", version=1, cluster="s", pool="p", node=0)
    d = ReplicaDemand(deployment="x", version=1, count=2, regions=("north",))
    standby = StandbyDemand(deployment="x", version=1, regions=("south", "east"))
    out = run(PlacementInputs(demands=(d,), pools=pools, current=(running,), standby=(standby,)), "milp")
    assert running in out.result.kept and "x-s" not in out.result.removed  # the placer never saw it
    assert sorted(a.cluster for a in out.result.added) == ["n", "n"]
    assert [(u.missing, u.reason) for u in out.result.unplaced] == [
        (1, "standby region east: no healthy pool with room")
    ]


def test_removals_are_explained_and_the_warm_start_comes_back_in():
    pools = (
        _pool("a", "r1"),
        _pool("b", "r1").model_copy(update={"cluster_status": ClusterStatus.unhealthy}),
    )
    current = (
        Assignment(replica_id="gone-1", deployment="gone", version=1, cluster="a", pool="p", node=0),
        Assignment(replica_id="x-b", deployment="x", version=1, cluster="b", pool="p", node=0),
    )
    d = ReplicaDemand(deployment="x", version=1, count=1)
    context = RemovalContext(current_versions={"x": 1}, cluster_status={"a": "healthy", "b": "unhealthy"})
    placer = MilpPlacer()
    first = run(PlacementInputs(demands=(d,), pools=pools, current=current), placer, context=context)
    assert first.reasons == {"gone-1": "deployment deleted", "x-b": "cluster b is unhealthy"}
    again = PlacementInputs(demands=(d,), pools=pools, current=first.result.assignments)
    assert run(again, placer, previous=first.solved).info.method == "unchanged"
