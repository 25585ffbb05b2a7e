"""First-fit-decreasing placement: properties over random fleets (hypothesis)."""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.placement import Assignment, FirstFitDecreasing, PoolCapacity, ReplicaDemand
from fleet_base.domain import ClusterStatus, Tier

FFD = FirstFitDecreasing()
REGIONS = ["r1", "r2", "r3"]
MODELS = ["a100", "h100", "cpu"]
PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pools_st(draw, ample: bool = False, healthy_only: bool = False) -> list[PoolCapacity]:
    n_clusters = draw(st.integers(1, 4))
    clusters = {
        f"c{i}": (
            draw(st.sampled_from(REGIONS)),
            ClusterStatus.healthy if healthy_only else draw(st.sampled_from(list(ClusterStatus))),
        )
        for i in range(n_clusters)
    }
    out = []
    for cluster, (region, status) in clusters.items():
        for j in range(draw(st.integers(1, 3))):
            out.append(
                PoolCapacity(
                    cluster=cluster,
                    name=f"p{j}",
                    region=region,
                    gpu_model=draw(st.sampled_from(MODELS)),
                    gpu_memory_gb=draw(st.sampled_from([0.0, 40.0, 80.0])),
                    gpus_per_node=8 if ample else draw(st.sampled_from([1, 2, 4, 8])),
                    nodes=draw(st.integers(40, 60)) if ample else draw(st.integers(0, 3)),
                    tier=draw(st.sampled_from(list(Tier))),
                    hourly_price=draw(st.floats(0, 40, allow_nan=False)),
                    cluster_status=status,
                )
            )
    return out


@st.composite
def demands_st(draw, loose: bool = False) -> list[ReplicaDemand]:
    names = draw(st.lists(st.sampled_from(["d0", "d1", "d2", "d3"]), unique=True, max_size=4))
    return [
        ReplicaDemand(
            deployment=name,
            version=draw(st.integers(1, 2)),
            count=draw(st.integers(0, 6)),
            gpu_models=()
            if loose
            else tuple(draw(st.lists(st.sampled_from(MODELS), unique=True, max_size=2))),
            gpu_count=draw(st.integers(1, 8)),
            gpu_memory_gb=0.0 if loose else draw(st.sampled_from([0.0, 0.0, 24.0, 60.0])),
            regions=() if loose else tuple(draw(st.lists(st.sampled_from([*REGIONS, "r*"]), max_size=2))),
            min_regions=draw(st.integers(1, 3)),
        )
        for name in names
    ]


def check_valid(demands, pools, current, result) -> None:
    by_pool = {p.key: p for p in pools}
    by_demand = {d.key: d for d in demands}
    current_ids = {a.replica_id for a in current}
    kept_ids = {a.replica_id for a in result.kept}
    added_ids = [a.replica_id for a in result.added]

    # the result partitions the current assignment, new ids are fresh and unique
    assert kept_ids <= current_ids
    assert kept_ids | set(result.removed) == current_ids
    assert not kept_ids & set(result.removed)
    assert len(set(added_ids)) == len(added_ids) and not set(added_ids) & current_ids

    used: Counter = Counter()
    for a in result.assignments:
        p = by_pool[a.pool_key]
        d = by_demand[(a.deployment, a.version)]
        assert d.acceptable(p), (a, p, d)  # GPU model, memory, region, per-node count
        assert a.gpus == d.gpu_count
        assert p.keeps_existing, "nothing stays on or goes to an unhealthy cluster"
        assert a.node is not None and 0 <= a.node < p.nodes
        used[(a.pool_key, a.node)] += a.gpus
    for a in result.added:
        assert by_pool[a.pool_key].accepts_new, "new replicas only on healthy clusters"
    for (key, _node), gpus in used.items():
        assert gpus <= by_pool[key].gpus_per_node, "a node is over-committed"

    placed = Counter((a.deployment, a.version) for a in result.assignments)
    missing = {(u.deployment, u.version): u.missing for u in result.unplaced}
    for d in demands:
        assert placed[d.key] + missing.get(d.key, 0) == d.count, (d, placed[d.key], missing)


@PROFILE
@given(pools=pools_st(), demands=demands_st())
def test_fresh_placement_respects_every_constraint(pools, demands):
    result = FFD.place(demands, pools)
    check_valid(demands, pools, [], result)


@PROFILE
@given(pools=pools_st(), demands=demands_st(), later=demands_st(), data=st.data())
def test_replacement_after_change_respects_every_constraint(pools, demands, later, data):
    """Place, then change demands and cluster health: the new plan is still valid."""
    first = FFD.place(
        demands, [p.model_copy(update={"cluster_status": ClusterStatus.healthy}) for p in pools]
    )
    strip = data.draw(st.booleans())
    current = [a.model_copy(update={"node": None}) if strip else a for a in first.assignments]
    result = FFD.place(later, pools, current)
    check_valid(later, pools, current, result)


@PROFILE
@given(pools=pools_st(), demands=demands_st(), data=st.data())
def test_arbitrary_current_assignments_never_break_the_rules(pools, demands, data):
    """Even a current assignment that over-commits nodes or breaks constraints is repaired."""
    current = []
    for i in range(data.draw(st.integers(0, 8))):
        p = data.draw(st.sampled_from(pools))
        d = data.draw(st.sampled_from(demands)) if demands else None
        current.append(
            Assignment(
                replica_id=f"cur-{i}",
                deployment=d.deployment if d else "gone",
                version=d.version if d else 1,
                cluster=p.cluster,
                pool=p.name,
                gpus=data.draw(st.integers(1, 8)),
                node=data.draw(st.none() | st.integers(0, 3)),
            )
        )
    check_valid(demands, pools, current, FFD.place(demands, pools, current))


@PROFILE
@given(pools=pools_st(), demands=demands_st())
def test_placing_the_result_again_changes_nothing(pools, demands):
    first = FFD.place(demands, pools)
    again = FFD.place(demands, pools, first.assignments)
    assert not again.added and not again.removed
    assert set(again.kept) == set(first.assignments)


@PROFILE
@given(pools=pools_st(ample=True, healthy_only=True), demands=demands_st(loose=True))
def test_ample_capacity_places_everything_across_min_regions(pools, demands):
    result = FFD.place(demands, pools)
    check_valid(demands, pools, [], result)
    assert not [u for u in result.unplaced if u.missing]
    regions_available = len({p.region for p in pools})
    by_demand = defaultdict(set)
    for a in result.assignments:
        by_demand[(a.deployment, a.version)].add(next(p.region for p in pools if p.key == a.pool_key))
    for d in demands:
        want = min(d.min_regions, d.count, regions_available)
        assert len(by_demand[d.key]) >= want, (d, by_demand[d.key])
